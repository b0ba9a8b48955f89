"""A production trace replayed against vLLM alone, HiCache and the all-in-L1 floor.

Each case is a ``vllm serve`` of the tiny model (bf16, CPU, block 32) driven by
``hicache bench replay``'s client (integration/bench/replay.py): the first
``--requests`` replayable requests of a Mooncake-format trace (default: the
FAST'25 conversation trace in ``../shared/traces``), ``--concurrency`` in
flight, answers of ``--output-tokens`` tokens (1: prefill-bound, as SGLang's
multi-turn HiCache benchmark simulates PD) or of the trace's length capped at
``--max-output-tokens``.

Cases (``--cases``, in this order within a round; ``--rounds`` alternates them):

- ``vllm``: vLLM with a do-nothing connector and the small L1 (``--l1-blocks``):
  what a server without HiCache does on the same load. The do-nothing
  connector is the baseline because vLLM's CPU path computes differently once
  any connector is configured.
- ``hicache``: the same L1, HiCache with L2 = ``--l2-ratio`` x L1 and a file L3
  in a fresh directory (HiCache's defaults otherwise; ``--extra`` adds keys).
- ``hicache-reused``: ``hicache`` with ``hicache_l3_admission: reused`` (a page
  goes to L3 once a second request uses it).
- ``hicache-l2``: the same without L3.
- ``hicache-inherit``: ``hicache`` with ``hicache_helper_cpus: inherit`` (its L3
  threads on the core of vLLM's forward thread, tiers/worker/helper_cpus.py).
- ``hicache-l1-all``: HiCache on the floor's L1 (below), its L2 the size of
  ``hicache``'s and a file L3: every hit is L1's, as the floor's, and
  HiCache still stores every new page to L2 and L3; what that costs the
  floor's steps.
- ``floor``: the do-nothing connector with an L1 that holds every page of
  the slice (nothing is ever evicted): what a perfect cache gives.

Prints, per case and round, request throughput, TTFT mean / p50 / p99 and the
share of prompt tokens served from a cache (vLLM's ``cached_tokens``), with
ratios to ``vllm`` and ``floor`` of the same round; then the medians over
rounds. Writes ``trace_replay.json``, each case's replay (``<case>-r<round>.json``)
and a TTFT CDF of the last round. ``--profile`` turns on HiCache's step profile
(``HICACHE_PROFILE``, connector/profile.py) in every server and keeps each
case's timeline next to its result. ``--scrape-interval S`` reads vLLM's
``/metrics`` every S seconds during each replay, as a Prometheus server would.
Before a round with a file L3 it waits (``--settle-s``, up to 6 minutes) until
a new file in its work folder is cheap again: a previous round's deleted store
makes every page file dearer for minutes (docs/benchmarks-trace.md section 7).

    python -m hicache.integration.bench.micro.trace_replay --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.integration.bench.compare import stop_server, wait_ready
from hicache.integration.bench.metrics_poll import MetricsPoller
from hicache.integration.bench.micro.rounds import alternate, pick_cases
from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.bench.replay import (
    LoadedTrace,
    ReplaySpec,
    ideal_cached_share,
    load_trace,
    replay_sync,
)
from hicache.integration.bench.systems import (
    SLOW_CREATE_US,
    CompareConfig,
    SystemSpec,
    plan,
    remove_stores,
    server_env,
    settled_create_us,
)

if TYPE_CHECKING:
    import httpx

DEFAULT_TRACE = Path("../shared/traces/mooncake_fast25/conversation_trace.jsonl")
BLOCK = 32


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "null" | "hicache"
    l1: str = "small"  # "small" | "all"
    extra_config: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case("vllm", "null"),
    Case("hicache", "hicache", extra_config={"l3": "file"}),
    Case("hicache-reused", "hicache",
         extra_config={"l3": "file", "hicache_l3_admission": "reused"}),
    Case("hicache-l2", "hicache"),
    Case("hicache-inherit", "hicache",
         extra_config={"l3": "file", "hicache_helper_cpus": "inherit"}),
    Case("hicache-l1-all", "hicache", l1="all", extra_config={"l3": "file"}),
    Case("floor", "null", l1="all"),
)


class Scraper(MetricsPoller):
    """Reads ``/metrics`` every ``interval_s`` while entered (a Prometheus scrape's
    load on the server); counts the scrapes that answered."""

    thread_name = "scraper"

    def __init__(self, base_url: str, interval_s: float) -> None:
        super().__init__(base_url, interval_s)
        self.scrapes = 0

    def read(self, response: httpx.Response) -> None:
        response.raise_for_status()
        self.scrapes += 1


def floor_blocks(trace: LoadedTrace, concurrency: int) -> int:
    """L1 blocks that hold every distinct full block of the slice and the running batch."""
    seen: set[int] = set()
    for r in trace.requests:
        chain = 0
        for b in range(len(r.prompt) // BLOCK):
            chain = hash((chain, r.prompt[b * BLOCK:(b + 1) * BLOCK]))
            seen.add(chain)
    longest = max(math.ceil((len(r.prompt) + r.output_tokens) / BLOCK) for r in trace.requests)
    return len(seen) + concurrency * longest + 64


def config(args: argparse.Namespace, l1_blocks: int) -> CompareConfig:
    return CompareConfig(
        name="trace-replay", model="tiny", workload={}, systems=(), seed=0,
        memory_budget_gb=0.0, l1_blocks=l1_blocks, block_size=BLOCK, page_size=BLOCK,
        max_model_len=args.max_model_len, dtype=args.dtype, ready_timeout_s=300.0,
        vllm_args=("--enforce-eager", "--max-num-seqs", str(args.concurrency)),
        env={"VLLM_CPU_KVCACHE_SPACE": "2"})


def hicache_extra(case: Case, args: argparse.Namespace, l1_blocks: int) -> dict[str, Any]:
    """A HiCache case's connector keys: its own, then an L2 of ``--l2-ratio`` x the
    small L1 (``--l1-blocks``) whichever L1 the case has, then ``--extra``."""
    extra = {k: v for k, v in case.extra_config.items() if k != "l3"}
    extra.update({"hicache_ratio": args.l2_ratio * args.l1_blocks / l1_blocks,
                  "hicache_size": 0, **json.loads(args.extra)})
    return extra


def run_case(case: Case, round_: int, args: argparse.Namespace, trace: LoadedTrace,
             out: Path, all_blocks: int) -> dict[str, Any]:
    from hicache.integration.vllm.engine import note_engine_start
    from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

    l1 = args.l1_blocks if case.l1 == "small" else all_blocks
    cfg = config(args, l1)
    tag = f"{case.name}-r{round_}"
    env: dict[str, str] = {}
    if args.profile:
        profile = (out / f"{tag}.profile.jsonl").resolve()
        profile.unlink(missing_ok=True)  # servers append: a rerun into OUT starts afresh
        env["HICACHE_PROFILE"] = str(profile)
    if case.kind == "null":
        spec = SystemSpec(name=case.name, kind="vllm", env=env, extra_args=(
            "--kv-transfer-config", json.dumps(TRANSFER_CONFIG, separators=(",", ":"))))
    else:
        spec = SystemSpec(name=case.name, kind="hicache", l3=case.extra_config.get("l3"),
                          extra_config=hicache_extra(case, args, l1), env=env)
    admin_port = free_port() if case.kind == "hicache" else 0
    lp = plan(cfg, spec, port=free_port(), admin_port=admin_port, workdir=out / "work")
    log = out / f"{tag}.log"
    create_us = settle_s = None
    if spec.l3 == "file":
        cost, settle_s = settled_create_us(out / "work", args.settle_s)
        create_us = round(cost, 1)
        if settle_s:
            print(f"    waited {settle_s:.0f} s for the file system to settle", flush=True)
        if create_us > SLOW_CREATE_US:
            print(f"    warning: a new file costs {create_us:.0f} us in {out / 'work'} (about "
                  "20 us when the file system is settled): files deleted there in the last "
                  "minutes make every L3 page write dearer; this round's HiCache figures "
                  "carry that cost", flush=True)
    note_engine_start(f"{case.name} server")
    with log.open("wb") as f:
        proc = subprocess.Popen(lp.cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=server_env(lp), start_new_session=True)
    try:
        why = wait_ready(proc, lp.base_url, cfg.ready_timeout_s)
        if why is not None:
            return {"case": case.name, "round": round_, "status": f"not run: {why} (see {log})"}
        t0 = time.monotonic()
        scraper = (Scraper(lp.base_url, args.scrape_interval) if args.scrape_interval
                   else contextlib.nullcontext())
        with scraper:
            result = replay_sync(lp.base_url, trace, concurrency=args.concurrency,
                                 admin_url=lp.admin_url,
                                 admin_token=lp.env.get("HICACHE_ADMIN_TOKEN"),
                                 progress=args.progress,
                                 record_path=(out / f"{tag}.trace.jsonl" if args.record
                                              and case.kind == "hicache" else None))
        if lp.admin_url is not None:  # every counter of the run, for what went wrong
            import httpx

            headers = {"Authorization": f"Bearer {lp.env['HICACHE_ADMIN_TOKEN']}"}
            result["admin_stats"] = httpx.get(f"{lp.admin_url}/stats", headers=headers,
                                              timeout=30).json()
        (out / f"{tag}.json").write_text(json.dumps(result) + "\n")
        s = result["summary"]
        return {"case": case.name, "round": round_, "status": "ok", "l1_blocks": l1,
                "seconds": round(time.monotonic() - t0, 1), "errors": s["n_errors"],
                "req_per_s": s["request_throughput"], "ttft_mean_ms": s["ttft_ms"]["mean"],
                "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                "cached_share": s["cached_share"], "fs_create_us": create_us,
                "fs_settle_s": settle_s,
                "tiers": result.get("tiers"),
                "worker": (result.get("admin_stats") or {}).get("worker")}
    finally:
        stop_server(proc)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each case against ``vllm`` and ``floor`` of the same round."""
    ok = [r for r in rows if r["status"] == "ok"]
    for base in ("vllm", "floor"):
        by_round = {r["round"]: r for r in ok if r["case"] == base}
        for r in ok:
            b = by_round.get(r["round"])
            if b is None:
                continue
            r[f"req_x_{base}"] = r["req_per_s"] / b["req_per_s"]
            r[f"ttft_x_{base}"] = r["ttft_mean_ms"] / b["ttft_mean_ms"]
            if r["cached_share"] and b["cached_share"]:
                r[f"cached_x_{base}"] = r["cached_share"] / b["cached_share"]


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("req_per_s", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "cached_share",
            "req_x_vllm", "req_x_floor", "ttft_x_vllm", "ttft_x_floor", "cached_x_floor")
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case and r["status"] == "ok"]
        if not rs:
            continue
        m: dict[str, Any] = {"case": case, "rounds": len(rs)}
        for k in keys:
            vals = [r[k] for r in rs if r.get(k) is not None]
            m[k] = statistics.median(vals) if vals else None
        out.append(m)
    return out


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"{title}",
             "| case | round | req/s | × vllm | × floor | TTFT mean ms | × floor | p50 ms "
             "| p99 ms | cached | × floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['case']} | {r['round']} | {r['status']} |||||||||")
            continue
        lines.append(
            f"| {r['case']} | {r.get('round', r.get('rounds'))} | {_f(r['req_per_s'], '.2f')} "
            f"| {_f(r.get('req_x_vllm'), '.2f')} | {_f(r.get('req_x_floor'), '.2f')} "
            f"| {_f(r['ttft_mean_ms'], ',.0f')} | {_f(r.get('ttft_x_floor'), '.2f')} "
            f"| {_f(r['ttft_p50_ms'], ',.0f')} | {_f(r['ttft_p99_ms'], ',.0f')} "
            f"| {_f(r['cached_share'] and 100 * r['cached_share'], '.1f')}% "
            f"| {_f(r.get('cached_x_floor'), '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--format", default="mooncake")
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-tokens", type=int, default=1,
                   help="answer length for every request (0: the trace's, capped)")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--l1-blocks", type=int, default=400)
    p.add_argument("--l2-ratio", type=float, default=4.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--extra", default="{}", help="more HiCache keys (JSON) for every "
                   "HiCache case")
    p.add_argument("--cases", default="vllm,hicache,floor",
                   help=f"comma-separated, of: {', '.join(c.name for c in CASES)}")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--scrape-interval", type=float, default=0.0,
                   help="read vLLM's /metrics every this many seconds during each replay")
    p.add_argument("--profile", action="store_true",
                   help="HICACHE_PROFILE in every server (one JSON line per step)")
    p.add_argument("--record", action="store_true",
                   help="write each HiCache case's served requests as a trace for "
                        "`hicache simulate` (<case>-r<round>.trace.jsonl)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--settle-s", type=float, default=360.0,
                   help="before a round with a file L3, wait up to this long for a new "
                   "file to cost under 100 us in OUT/work (files deleted there in the "
                   "last minutes make each one dearer); 0: do not wait")
    p.add_argument("--out", default="bench_results/trace-replay")
    args = p.parse_args(argv)
    known = {c.name: c for c in CASES}
    names = pick_cases(p, args.cases, known)
    if not args.trace.exists():
        p.error(f"--trace {args.trace}: no such file (the traces live in ../shared/traces)")
    try:
        json.loads(args.extra)
    except ValueError as e:
        p.error(f"--extra: not JSON: {e}")
    spec = ReplaySpec(block_tokens=args.block_tokens, max_model_len=args.max_model_len,
                      requests=args.requests, max_output_tokens=args.max_output_tokens,
                      output_tokens=args.output_tokens or None)
    trace = load_trace(args.trace, args.format, spec)
    all_blocks = floor_blocks(trace, args.concurrency)
    ideal = ideal_cached_share(trace.requests, BLOCK)
    print(f"{len(trace.requests)} requests ({trace.skipped_too_long} of the first "
          f"{trace.lines_read} skipped: longer than {args.max_model_len}), "
          f"{trace.prompt_tokens:,} prompt tokens, ideal cached share {100 * ideal:.1f}%, "
          f"floor L1 {all_blocks} blocks", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = alternate(names, args.rounds, lambda round_, name: run_case(
            known[name], round_, args, trace, out, all_blocks))
    finally:
        remove_stores(out / "work")
    add_ratios(rows)
    summary = medians(rows)
    (out / "trace_replay.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "ideal_cached_share": ideal,
         "requests": len(trace.requests), "rows": rows, "medians": summary}, indent=2))
    from hicache.integration.bench.report import write_plots

    last = {r["case"]: json.loads((out / f"{r['case']}-r{r['round']}.json").read_text())
            for r in rows if r["status"] == "ok" and r["round"] == args.rounds}
    if last:
        write_plots(last, out)
    print(table(rows, "per round"))
    print(table(summary, "medians over rounds"))


if __name__ == "__main__":
    main()
