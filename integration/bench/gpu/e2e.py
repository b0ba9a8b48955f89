"""End-to-end run on a real vLLM: token identity and returning-turn TTFT of HiCache against
vLLM without a cache, vLLM's own prefix cache (the floor) and vLLM's native CPU
offloading, in one process tree. Made for the lent GPU; ``--preset test`` runs it on
the CPU build too (a smoke run, and what the tests use).

Contract:
- Every case (``CASES``) runs in its own child process (a crash or hang costs that
  case only; GPU memory is returned between cases) under a time limit, with a
  vLLM engine kept in that process (in-process engine core) so HiCache's L3 backup
  queue can be waited for. Results are appended to ``results.json`` after each
  case, so a run cut short keeps what finished.
- Workload, the same token ids in every case: for each history length H, a few
  conversations of H random prompt tokens; turn 1 decodes ``--gen`` tokens greedily;
  then branches ``history + turn-1 output + a new 64-token question`` are sent,
  each after the case's preparation:
    null (a connector that never loads): ``floor`` (vLLM's L1 still holds the
      history), ``floor3`` (same, another question) and ``recompute`` (L1 reset);
    hicache (L2 + file L3, io backend ``kernel`` unless the case says): ``l2``
      (L1 reset: the history comes from L2) and ``l3`` (L1 and L2 reset, L3 backups
      waited for: the history comes from L3);
    offload (vLLM's OffloadingConnector with the same host budget): ``offload``
      (L1 reset).
  A first conversation of ``--warmup`` tokens runs through every branch and is not
  reported (first launches compile kernels).
- Token identity: every branch's tokens equal the oracle's for the same prompt,
  where the oracle is the null case of the same execution mode (eager / CUDA
  graphs / model runner) with its L1 holding the history: ``l2`` and ``offload``
  against ``floor``, ``l3`` against ``floor3``, turn 1 against turn 1. Same cached
  prefix, same suffix computation, so the bytes loaded are all that differs.
  A ``repeat_of`` case is the same engine started again and is compared branch
  by branch with its original: whether the mode reproduces itself at all (CUDA
  graphs compile with Inductor's kernel benchmarking off for that reason).
- TTFT is vLLM's own per-request first-token latency (``RequestOutput.metrics``,
  arrival to first token), median over conversations; ratios are to ``recompute``
  of the same mode. ``num_cached_tokens`` is recorded to show where hits came from.
- Outputs in ``--out``: ``results.json`` (every case: status, start seconds, rows),
  ``report.md`` (identity and TTFT tables, the command), ``ttft.png``.

    python -m hicache.integration.bench.gpu.e2e run --preset gpu8b --out OUT
    python -m hicache.integration.bench.gpu.e2e run --preset test --device cpu \\
        --histories 512,1024 --cases null-eager,hicache-eager --out OUT   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUESTION_TOKENS = 64


@dataclass(frozen=True)
class Case:
    """One engine configuration."""

    kind: str  # "null" | "hicache" | "offload"
    graphs: bool = False  # CUDA graphs (vLLM's torch.compile, piecewise with HiCache)
    io: str = "kernel"  # HiCache io backend on a GPU
    env: dict[str, str] = field(default_factory=dict)  # extra environment (model runner)
    # A second start of another case: compared with it branch by branch, to show
    # whether that mode reproduces its own tokens across engine starts.
    repeat_of: str | None = None
    # HiCache only: more kv_connector_extra_config, and the TTFT column suffix
    # that keeps its figures apart from the plain HiCache case of its mode.
    hicache_extra: dict[str, Any] = field(default_factory=dict)
    tag: str = ""
    # vLLM's --kv-cache-dtype ("" = auto, the model's dtype).
    kv_dtype: str = ""

    @property
    def mode(self) -> str:
        """The execution mode; a case's oracle is the null case of the same mode."""
        runner = self.env.get("VLLM_USE_V2_MODEL_RUNNER")
        return ("graphs" if self.graphs else "eager") + (
            "" if runner is None else f"-runner{'2' if runner == '1' else '1'}") + (
            f"-{self.kv_dtype}" if self.kv_dtype else "")


CASES: dict[str, Case] = {
    "null-eager": Case("null"),
    "hicache-eager": Case("hicache"),
    "offload-eager": Case("offload"),
    "null-graphs": Case("null", graphs=True),
    "null-graphs-repeat": Case("null", graphs=True, repeat_of="null-graphs"),
    "hicache-graphs": Case("hicache", graphs=True),
    "null-runner1": Case("null", env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "hicache-runner1": Case("hicache", env={"VLLM_USE_V2_MODEL_RUNNER": "0"}),
    "hicache-direct": Case("hicache", io="direct"),
    "hicache-async-stores": Case("hicache", hicache_extra={"hicache_async_stores": True},
                                 tag="+async"),
    "null-fp8": Case("null", kv_dtype="fp8"),
    "hicache-fp8": Case("hicache", kv_dtype="fp8"),
}
DEFAULT_CASES = ("null-eager", "hicache-eager", "offload-eager", "null-graphs",
                 "hicache-graphs", "null-graphs-repeat", "null-runner1", "hicache-runner1",
                 "hicache-direct", "hicache-async-stores")

# branch name -> (question index, preparation), per case kind
BRANCHES: dict[str, list[tuple[str, int, str]]] = {
    "null": [("floor", 1, "none"), ("floor3", 3, "none"), ("recompute", 2, "reset_l1")],
    "hicache": [("l2", 1, "reset_l1"), ("l3", 3, "reset_l1_l2")],
    "offload": [("offload", 1, "reset_l1")],
}
# branch -> the null branch with the same prompt and cached prefix
ORACLE_BRANCH = {"l2": "floor", "l3": "floor3", "offload": "floor", "turn1": "turn1"}


def prompt_tokens(length: int, seed: int, vocab: int) -> list[int]:
    """``length`` token ids drawn from the vocabulary (special ids 0-9 left out)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, vocab, size=length)]


# ---- one case, in its own process ----------------------------------------------


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from hicache.integration.vllm.engine import EngineSpec, close_llm, greedy_params, open_llm

    case = CASES[name]
    if args.switch_interval:
        # The GIL hand-off interval of this engine process (Python's default: 5 ms).
        sys.setswitchinterval(args.switch_interval)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    gpu = args.device == "cuda"
    extra: dict[str, Any] = {"disable_log_stats": False}
    if gpu:
        extra.update(enforce_eager=not case.graphs, gpu_memory_utilization=args.gpu_util)
        if case.graphs:
            # vLLM picks Inductor's combo kernels by benchmarking them unless told
            # otherwise, so two engine starts may compile different kernels (and
            # round differently): the first H100 run's null oracle reproduced 4 of
            # 20 sequences. No benchmarking: one compiled graph per input.
            extra["compilation_config"] = {
                "cudagraph_mode": "PIECEWISE",
                "inductor_compile_config": {"combo_kernels": True,
                                            "benchmark_combo_kernel": False}}
    if case.kv_dtype:
        extra["kv_cache_dtype"] = case.kv_dtype
    hicache = None
    kv_transfer: dict[str, Any] | None = None
    if case.kind == "null":
        from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

        kv_transfer = dict(TRANSFER_CONFIG)
    elif case.kind == "hicache":
        l3 = Path(args.l3_dir) / name
        l3.mkdir(parents=True, exist_ok=True)
        hicache = {"hicache_size": args.host_gb, "hicache_io_backend": case.io if gpu
                   else "direct", "hicache_storage_backend": "file",
                   "hicache_storage_backend_extra_config": {"path": str(l3)},
                   **case.hicache_extra}
    else:
        extra.update(kv_offloading_size=args.host_gb, kv_offloading_backend="native")
    spec = EngineSpec(model=args.model, hicache=hicache, kv_transfer=kv_transfer,
                      block_size=args.block_size, max_model_len=args.max_model_len,
                      max_num_seqs=4, dtype=args.dtype, in_process=True, extra_args=extra)
    started = time.perf_counter()
    llm = open_llm(spec)
    start_seconds = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    try:
        for history, conv in _conversations(args):
            seed = history * 1000 + conv
            p1 = prompt_tokens(history, seed, vocab)
            first = _generate(llm, p1, args.gen, greedy_params)
            out1 = first["tokens"]
            rows.append(dict(first, history=history, conv=conv, branch="turn1"))
            for branch, question, prep in BRANCHES[case.kind]:
                _prepare(llm, prep, case.kind, args.gen, greedy_params)
                q = prompt_tokens(QUESTION_TOKENS, seed * 10 + question, vocab)
                row = _generate(llm, p1 + out1 + q, args.gen, greedy_params)
                rows.append(dict(row, history=history, conv=conv, branch=branch))
    finally:
        stats = _hicache_counters(llm) if case.kind == "hicache" else {}
        close_llm(llm)
    return {"case": name, "mode": case.mode, "kind": case.kind + case.tag, "io": case.io,
            "repeat_of": case.repeat_of,
            "start_seconds": start_seconds, "rows": rows, "hicache_counters": stats}


def _conversations(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(history, conversation) pairs; the warm-up one first (conversation -1)."""
    out = [(args.warmup, -1)] if args.warmup else []
    return out + [(h, c) for h in args.histories for c in range(args.conversations)]


def _generate(llm: Any, prompt: list[int], gen: int, greedy_params: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy_params(gen), use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = getattr(out, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    return {"tokens": list(out.outputs[0].token_ids), "prompt_len": len(prompt),
            "cached": out.num_cached_tokens or 0, "ttft": ttft or None, "wall": wall}


def _prepare(llm: Any, prep: str, kind: str, gen: int, greedy_params: Any) -> None:
    """Bring the caches to the branch's starting state."""
    if prep == "none":
        return
    if kind == "hicache":
        _wait_l3_backups()
    for _ in range(200):
        if llm.reset_prefix_cache(reset_connector=(prep == "reset_l1_l2")):
            return
        # Blocks still held by an in-flight store (native offloading): let the
        # engine step with a tiny request, then try again.
        llm.generate([{"prompt_token_ids": [11, 12, 13]}], greedy_params(1), use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError(f"reset_prefix_cache ({prep}) kept failing")


def _wait_l3_backups(timeout: float = 120.0) -> None:
    """Until HiCache's L3 backup queue is empty (in-process engine)."""
    from hicache.integration.vllm.engine import worker_connector

    io = worker_connector().hicache_worker.storage_io
    deadline = time.monotonic() + timeout
    while io is not None and any(io.queue_depths()) and time.monotonic() < deadline:
        time.sleep(0.01)


def _hicache_counters(llm: Any) -> dict[str, float]:
    from hicache.integration.vllm.engine import worker_connector

    try:
        return dict(worker_connector().hicache_worker.counters())
    except Exception as exc:  # noqa: BLE001 - a report, not a check
        return {"error": repr(exc)}  # type: ignore[dict-item]


# ---- the parent: cases in children, then the report --------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from hicache.integration.models.tiny_model import ensure_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = str(ensure_tiny_model(args.preset))
    print(f"model {args.preset}: {model} ({time.perf_counter() - t0:.1f} s)", flush=True)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "preset": args.preset,
                               "device": args.device, "cases": {}}
    deadline = time.monotonic() + args.deadline
    for name in tqdm(args.cases, desc="e2e cases"):
        left = deadline - time.monotonic()
        if left < 30:
            results["cases"][name] = {"case": name, "status": "skipped: out of time"}
            continue
        results["cases"][name] = _run_child(name, args, model, out, min(left, args.case_timeout))
        (out / "results.json").write_text(json.dumps(results, indent=1))
        status = results["cases"][name].get("status")
        print(f"{name}: {status}", flush=True)
    results["identity"] = identity(results["cases"])
    results["ttft"] = ttft_table(results["cases"])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    try:
        plot(results["ttft"], out / "ttft.png")
    except Exception as exc:  # noqa: BLE001 - the tables matter more than the picture
        print(f"plot failed: {exc!r}")
    print(report(results), flush=True)
    return results


def _run_child(name: str, args: argparse.Namespace, model: str, out: Path,
               timeout: float) -> dict[str, Any]:
    result_file = out / f"case-{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "hicache.integration.bench.gpu.e2e", "case", name,
           "--model", model, "--result", str(result_file), *_shared_argv(args)]
    env = dict(os.environ, **CASES[name].env)
    log = out / f"case-{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - t0
    if result_file.exists():
        data: dict[str, Any] = json.loads(result_file.read_text())
        data.update(status="ok", seconds=seconds)
        return data
    tail = log.read_text(errors="replace").splitlines()[-40:]
    return {"case": name, "mode": CASES[name].mode, "kind": CASES[name].kind + CASES[name].tag,
            "status": "timeout" if rc is None else f"failed rc={rc}", "seconds": seconds,
            "log_tail": tail}


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--dtype", args.dtype,
            "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
            "--histories", ",".join(map(str, args.histories)),
            "--conversations", str(args.conversations), "--gen", str(args.gen),
            "--warmup", str(args.warmup), "--host-gb", str(args.host_gb),
            "--gpu-util", str(args.gpu_util), "--l3-dir", args.l3_dir,
            "--switch-interval", str(args.switch_interval)]


def _rows_by(case: dict[str, Any]) -> dict[tuple[int, int, str], dict[str, Any]]:
    return {(r["history"], r["conv"], r["branch"]): r for r in case.get("rows", [])}


def identity(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Per non-null case: sequences compared with its mode's null oracle, identical count."""
    oracles = {c["mode"]: c for c in cases.values() if c.get("kind") == "null"
               and c.get("status") == "ok" and not c.get("repeat_of")}
    table: list[dict[str, Any]] = []
    for name, case in cases.items():
        repeat_of = case.get("repeat_of")
        if (case.get("kind") == "null" and not repeat_of) or case.get("status") != "ok":
            continue
        oracle = cases.get(repeat_of) if repeat_of else oracles.get(case["mode"])
        if oracle is not None and oracle.get("status") != "ok":
            oracle = None
        if oracle is None:
            table.append({"case": name, "oracle": None, "compared": 0, "identical": 0})
            continue
        ref = _rows_by(oracle)
        compared = identical = 0
        mismatches: list[dict[str, Any]] = []
        for (h, c, branch), row in _rows_by(case).items():
            if c < 0:
                continue
            want = ref.get((h, c, branch if repeat_of else ORACLE_BRANCH.get(branch, "")))
            if want is None:
                continue
            compared += 1
            if want["tokens"] == row["tokens"]:
                identical += 1
            else:
                at = next(i for i, (a, b) in enumerate(
                    zip(want["tokens"], row["tokens"], strict=False)) if a != b) \
                    if len(want["tokens"]) == len(row["tokens"]) else -1
                mismatches.append({"history": h, "conv": c, "branch": branch,
                                   "first_diff": at, "cached": row["cached"],
                                   "oracle_cached": want["cached"]})
        table.append({"case": name, "oracle": oracle["case"], "compared": compared,
                      "identical": identical, "mismatches": mismatches})
    return table


TTFT_COLUMNS = [("recompute", "null", "recompute"), ("hicache L2", "hicache", "l2"),
                ("hicache L2, stores across steps", "hicache+async", "l2"),
                ("hicache L3 (file)", "hicache", "l3"), ("vLLM offloading", "offload", "offload"),
                ("floor (L1 hit)", "null", "floor")]


def ttft_table(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Median TTFT per (mode, history) and column, with the ratio to recompute."""
    by_mode: dict[str, dict[str, dict[str, Any]]] = {}
    for case in cases.values():
        if case.get("status") == "ok" and not case.get("repeat_of"):
            by_mode.setdefault(case["mode"], {})[case["kind"]] = case
    table = []
    for mode, kinds in by_mode.items():
        histories = sorted({r["history"] for c in kinds.values() for r in c["rows"]
                            if r["conv"] >= 0})
        for h in histories:
            row: dict[str, Any] = {"mode": mode, "history": h}
            for label, kind, branch in TTFT_COLUMNS:
                rows = [r for r in kinds.get(kind, {}).get("rows", [])
                        if r["history"] == h and r["conv"] >= 0 and r["branch"] == branch
                        and r["ttft"] is not None]
                if rows:
                    row[label] = {"ttft_ms": 1000 * statistics.median(r["ttft"] for r in rows),
                                  "cached": statistics.median(r["cached"] for r in rows),
                                  "n": len(rows)}
            base = row.get("recompute", {}).get("ttft_ms")
            for label, _, _ in TTFT_COLUMNS:
                if base and label in row:
                    row[label]["vs_recompute"] = row[label]["ttft_ms"] / base
            table.append(row)
    return table


def report(results: dict[str, Any]) -> str:
    lines = [f"# HiCache end-to-end ({results['preset']}, {results['device']})", "",
             f"`{results['command']}`", "", "## Cases", "",
             "| case | mode | status | engine start s | case s |", "|---|---|---|---|---|"]
    for name, case in results["cases"].items():
        lines.append(f"| {name} | {case.get('mode', '')} | {case.get('status')} | "
                     f"{case.get('start_seconds', 0):.1f} | {case.get('seconds', 0):.0f} |")
    lines += ["", "## Token identity (vs the null connector of the same mode, L1 holding "
              "the history)", "", "| case | oracle | identical / compared | mismatches |",
              "|---|---|---|---|"]
    for row in results.get("identity", []):
        lines.append(f"| {row['case']} | {row['oracle']} | {row['identical']} / "
                     f"{row['compared']} | {row.get('mismatches', [])[:3]} |")
    labels = [label for label, _, _ in TTFT_COLUMNS]
    lines += ["", "## Returning-turn TTFT, median ms (x recompute) [cached tokens]", "",
              "| mode | history | " + " | ".join(labels) + " |",
              "|---|---|" + "---|" * len(labels)]
    for row in results.get("ttft", []):
        cells = []
        for label in labels:
            cell = row.get(label)
            ratio = f" ({cell['vs_recompute']:.2f}x)" if cell and "vs_recompute" in cell else ""
            cells.append("" if cell is None else
                         f"{cell['ttft_ms']:.1f}{ratio} [{cell['cached']:.0f}]")
        lines.append(f"| {row['mode']} | {row['history']} | " + " | ".join(cells) + " |")
    for name, case in results["cases"].items():
        if case.get("hicache_counters"):
            lines += ["", f"{name} counters: {case['hicache_counters']}"]
        if case.get("log_tail"):
            lines += ["", f"### {name} log tail", "", "```", *case["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r["mode"] == "eager"] or table
    if not rows:
        return
    labels = [label for label, _, _ in TTFT_COLUMNS]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs = [j + i * width for j in range(len(rows))]
        ys = [r.get(label, {}).get("ttft_ms", 0) for r in rows]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['history']} tokens" for r in rows])
    ax.set_ylabel("TTFT of the returning turn, ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"Returning-turn TTFT ({rows[0]['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _add_shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=34816)
    p.add_argument("--histories", type=_ints, default=[8192, 32768])
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2048)
    p.add_argument("--host-gb", type=float, default=16.0)
    p.add_argument("--gpu-util", type=float, default=0.85)
    p.add_argument("--l3-dir", default="/tmp/hicache-e2e-l3")
    p.add_argument("--switch-interval", type=float, default=0.0,
                   help="sys.setswitchinterval in each engine process (0: Python's 5 ms)")


def main(argv: list[str] | None = None) -> None:
    from hicache.integration.bench.gpu.case_cli import main_for

    main_for(argv, description=__doc__.split("\n\n")[0], cases=CASES,
             default_cases=DEFAULT_CASES, out_default="bench_results/gpu-e2e",
             add_shared=_add_shared, run=run, run_case=run_case)


if __name__ == "__main__":
    main()
