"""The ``serve_overhead`` load without a server: what HiCache costs and gives the engine alone.

``serve_overhead`` runs ``vllm serve`` and ``vllm bench serve`` on the same
machine, so on a small one the API server and the benchmark client take CPU
from the engine, and whatever HiCache adds to the engine core's step is paid
again in that contention. This benchmark sends the same kind of load
(``--num-prefixes`` random prefixes of ``--prefix-len`` tokens, each prompt
one of them plus ``--suffix-len`` random tokens, ``--output-len`` greedy
tokens, seeded) to vLLM's ``LLM.generate`` in-process, ``--concurrency``
requests at once (``max_num_seqs``), with no HTTP and no client.

Cases (the names of ``serve_overhead``): ``null`` and ``hicache`` with an L1
of ``--l1-blocks`` (every prefix fits: HiCache's cost, nothing to gain), and
``null-small-l1`` (recompute) and ``hicache-small-l1`` with ``--small-l1-blocks``
(the running batch fits, the prefixes do not). Each case runs in a fresh
subprocess; ``--rounds`` alternates them. Prints requests/s, the share of
prompt tokens served from cache, and each case against the floor (``null``)
and recompute (``null-small-l1``) of its round, and writes ``engine_only.json``.

    python -m hicache.integration.bench.micro.engine_only [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hicache.integration.bench.micro.rounds import alternate, pick_cases

CASES = {  # name -> (connector, small L1)
    "null": ("null", False),
    "hicache": ("hicache", False),
    "null-small-l1": ("null", True),
    "hicache-small-l1": ("hicache", True),
}


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """The load's prompts: each a seeded random prefix of ``args.num_prefixes`` plus a
    random suffix (token ids in [10, 2000): inside any test vocabulary)."""
    import numpy as np

    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(10, 2000, args.prefix_len).tolist()
                for _ in range(args.num_prefixes)]
    return [prefixes[int(rng.integers(0, args.num_prefixes))]
            + rng.integers(10, 2000, args.suffix_len).tolist()
            for _ in range(args.num_prompts)]


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One case in this process: its engine, the whole load, the engine closed."""
    from hicache.integration.models.tiny_model import ensure_tiny_model
    from hicache.integration.vllm.engine import EngineSpec, close_llm, greedy_params, open_llm
    from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

    kind, small = CASES[name]
    hicache = {"hicache_size": args.host_gb, "page_size": 32} if kind == "hicache" else None
    llm = open_llm(EngineSpec(
        str(ensure_tiny_model("test")), hicache=hicache,
        kv_transfer=TRANSFER_CONFIG if kind == "null" else None,
        num_blocks=args.small_l1_blocks if small else args.l1_blocks,
        max_num_seqs=args.concurrency, dtype="bfloat16", in_process=True))
    try:
        load = [{"prompt_token_ids": p} for p in prompts(args)]
        t0 = time.perf_counter()
        outs = llm.generate(load, greedy_params(args.output_len), use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        close_llm(llm)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in load)
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return {"case": name, "status": "ok", "seconds": round(seconds, 2),
            "req_per_s": len(outs) / seconds, "cached_share": cached / prompt_tokens}


def run_case(name: str, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """One case in a subprocess of its own (a fresh engine, nothing shared)."""
    cmd = [sys.executable, "-m", __spec__.name if __spec__ else __name__, "--one", name,
           *_forwarded(args)]
    with log.open("wb") as f:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f)
    lines = [ln for ln in done.stdout.decode().splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        return {"case": name, "status": f"failed (exit {done.returncode}, see {log})"}
    return json.loads(lines[-1])


def _forwarded(args: argparse.Namespace) -> list[str]:
    keys = ("num_prompts", "concurrency", "num_prefixes", "prefix_len", "suffix_len",
            "output_len", "l1_blocks", "small_l1_blocks", "host_gb", "seed")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput against the floor (``null``) and recompute
    (``null-small-l1``) of its round, where those ran."""
    ok = [r for r in rows if r["status"] == "ok"]
    for base, key in (("null", "x_floor"), ("null-small-l1", "x_recompute")):
        by_round = {r["round"]: r["req_per_s"] for r in ok if r["case"] == base}
        for r in ok:
            if r["round"] in by_round:
                r[key] = r["req_per_s"] / by_round[r["round"]]


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = ["| round | case | req/s | cached | × floor | × recompute |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['round']} | {r['case']} | {r['status']} | | | |")
            continue
        lines.append(f"| {r['round']} | {r['case']} | {r['req_per_s']:.2f} | "
                     f"{r['cached_share']:.1%} | {f(r.get('x_floor'))} | "
                     f"{f(r.get('x_recompute'))} |")
    medians = []
    for name in dict.fromkeys(r["case"] for r in rows):
        for key in ("x_floor", "x_recompute"):
            xs = [r[key] for r in rows if r["case"] == name and key in r]
            if xs and not name.startswith("null"):
                medians.append(f"{name} {key}: median {statistics.median(xs):.3f}")
    return "\n".join([*lines, "", *medians])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=768)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prefixes", type=int, default=48)
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--l1-blocks", type=int, default=3200)
    p.add_argument("--small-l1-blocks", type=int, default=1000)
    p.add_argument("--host-gb", type=float, default=0.25,
                   help="L2 (GB): the default holds every prefix and every prompt's own pages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", default="null,null-small-l1,hicache-small-l1",
                   help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--rounds", type=int, default=2,
                   help="run the cases this many times, in turn (machine noise)")
    p.add_argument("--out", default="bench_results/engine-only")
    p.add_argument("--one", choices=list(CASES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return
    names = pick_cases(p, args.cases, CASES)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = alternate(names, args.rounds, lambda round_, name: {
        "round": round_, **run_case(name, args, out / f"{name}-r{round_}.log")})
    add_ratios(rows)
    (out / "engine_only.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                     indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
