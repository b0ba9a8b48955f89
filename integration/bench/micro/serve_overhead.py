"""What HiCache costs a vLLM server that does not need it, and what it gives one that does,
measured with vLLM's own ``vllm bench serve``.

Each case is a ``vllm serve`` of the tiny model (bf16, CPU, block 32) driven by
``vllm bench serve --dataset-name prefix_repetition``: ``--num-prefixes`` shared
prefixes of ``--prefix-len`` tokens, ``--num-prompts`` prompts, ``--concurrency``
clients. The baseline is vLLM with a do-nothing KV connector (integration/vllm/null_connector.py):
vLLM's CPU path computes differently as soon as any connector is configured, so
"no connector" would not isolate HiCache's cost.

- ``--l1-blocks`` large enough for every prefix (default 640; the 8 prefixes take
  384 blocks of 32 tokens): L1 serves every
  hit, HiCache has nothing to add, and its cost is what is left. Cases: null
  connector; HiCache with its defaults (each step waits for its stores); HiCache
  with ``hicache_async_stores`` false spelled out (``hicache-sync-stores``);
  with it true (``hicache-async``: stores on the copy thread, on the cores vLLM
  leaves beside its forward pass).
- ``--small-l1-blocks`` (default 136): the prefixes do not fit L1; the null
  connector recomputes what L1 lost, HiCache loads it from L2 (inline, the
  CPU default, or with ``hicache_async_stores`` on a copy thread beside the
  forward pass, layer by layer: ``hicache-async-small-l1``).

Prints request throughput and median / p99 TTFT per case, with ratios to the null
connector of the same L1, and with ``--sample-load`` the server's mean running
and waiting requests during the run (vLLM's own ``num_requests_running`` /
``num_requests_waiting`` gauges, sampled from its ``/metrics`` every 0.2 s: how
many requests L1 let run at once; off by default, because that polling stalls a
HiCache server, see docs/benchmarks.md), and writes ``serve_overhead.json``.
Each case's ``<case>.json`` is vLLM bench's detailed result (every request's
TTFT, in order).

    python -m hicache.integration.bench.micro.serve_overhead [--num-prompts 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.integration.bench.compare import stop_server, wait_ready
from hicache.integration.bench.metrics_poll import MetricsPoller
from hicache.integration.bench.micro.rounds import alternate, pick_cases
from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.bench.systems import (
    CompareConfig,
    SystemSpec,
    _vllm_cli,
    plan,
    resolve_model,
    server_env,
)

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "null" | "hicache"
    small_l1: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)


CASES = (
    Case("null", "null"),
    Case("hicache", "hicache"),
    Case("hicache-sync-stores", "hicache", extra_config={"hicache_async_stores": False}),
    # Stores on the copy thread, on the cores vLLM leaves beside the forward pass.
    Case("hicache-async", "hicache", extra_config={"hicache_async_stores": True}),
    Case("null-small-l1", "null", small_l1=True),
    Case("hicache-small-l1", "hicache", small_l1=True),
    # Copies on a thread beside the forward pass (loads layer by layer), not inline.
    Case("hicache-async-small-l1", "hicache", small_l1=True,
         extra_config={"hicache_async_stores": True}),
)


def config(args: argparse.Namespace, l1_blocks: int) -> CompareConfig:
    return CompareConfig(
        name="serve-overhead", model="tiny", workload={}, systems=(), seed=0,
        memory_budget_gb=args.host_gb, l1_blocks=l1_blocks, block_size=32, page_size=32,
        max_model_len=2048, dtype="bfloat16", ready_timeout_s=300.0,
        vllm_args=("--enforce-eager", "--max-num-seqs", str(args.concurrency)),
        env={"VLLM_CPU_KVCACHE_SPACE": "1"})


def bench_command(args: argparse.Namespace, base_url: str, model: str, result: Path) -> list[str]:
    python = _vllm_cli(sys.executable)
    return [*python, "bench", "serve", "--backend", "vllm", "--base-url", base_url,
            "--model", model, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", str(args.num_prefixes),
            "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name]


class LoadSampler(MetricsPoller):
    """vLLM's running / waiting request gauges, sampled from the server's /metrics on
    a thread until stopped; ``means()`` over the samples."""

    GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    timeout_s = 5.0
    thread_name = "load-sampler"

    def __init__(self, base_url: str, interval_s: float = 0.2) -> None:
        super().__init__(base_url, interval_s)
        self.samples: dict[str, list[float]] = {v: [] for v in self.GAUGES.values()}

    def read(self, response: httpx.Response) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                key = self.GAUGES.get(sample.name)
                if key is not None:
                    self.samples[key].append(sample.value)

    def means(self) -> dict[str, float | None]:
        return {f"mean_{k}": round(statistics.fmean(v), 2) if v else None
                for k, v in self.samples.items()}


def run_case(case: Case, round_: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from hicache.integration.vllm.engine import note_engine_start
    from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

    cfg = config(args, args.small_l1_blocks if case.small_l1 else args.l1_blocks)
    env: dict[str, str] = {}
    if args.profile:
        profile = (out / f"{case.name}-r{round_}.profile.jsonl").resolve()
        profile.unlink(missing_ok=True)  # servers append: a rerun into OUT starts afresh
        env["HICACHE_PROFILE"] = str(profile)
    if case.kind == "null":
        spec = SystemSpec(name=case.name, kind="vllm", env=env, extra_args=(
            "--kv-transfer-config", json.dumps(TRANSFER_CONFIG, separators=(",", ":"))))
    else:
        spec = SystemSpec(name=case.name, kind="hicache", env=env,
                          extra_config={"hicache_admin_port": 0, **case.extra_config})
    lp = plan(cfg, spec, port=free_port(), admin_port=0, workdir=out / "work")
    log = out / f"{case.name}.log"
    note_engine_start(f"{case.name} server")
    with log.open("wb") as f:
        proc = subprocess.Popen(lp.cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=server_env(lp), start_new_session=True)
    try:
        why = wait_ready(proc, lp.base_url, cfg.ready_timeout_s)
        if why is not None:
            return {"case": case.name, "status": f"not run: {why} (see {log})"}
        result = out / f"{case.name}.json"
        result.unlink(missing_ok=True)
        t0 = time.monotonic()
        load = LoadSampler(lp.base_url, args.sample_interval) if args.sample_load else None
        with load or contextlib.nullcontext():
            done = subprocess.run(
                bench_command(args, lp.base_url, resolve_model(cfg.model), result),
                capture_output=True, text=True, env=server_env(lp))
        (out / f"{case.name}.bench.log").write_text(done.stdout + done.stderr)
        if done.returncode or not result.exists():
            return {"case": case.name, "status": f"bench failed (see {case.name}.bench.log)"}
        data = json.loads(result.read_text())
        return {"case": case.name, "status": "ok", "l1_blocks": cfg.l1_blocks,
                "seconds": round(time.monotonic() - t0, 1),
                "completed": data.get("completed"), "failed": data.get("failed", 0),
                "req_per_s": data["request_throughput"],
                "ttft_p50_ms": data["p50_ttft_ms"], "ttft_p99_ms": data["p99_ttft_ms"],
                **waves(data.get("ttfts") or [], args.concurrency),
                **(load.means() if load else {})}
    finally:
        stop_server(proc)


def waves(ttfts: list[float], concurrency: int) -> dict[str, float | None]:
    """From vLLM bench's per-request TTFTs (in the order the requests were sent): the
    first burst's slowest (the first ``concurrency`` requests, a fresh server's
    first wave) and the steady p99 (every request after the first four waves)."""
    import numpy as np

    first = ttfts[:concurrency]
    steady = ttfts[4 * concurrency:]
    return {"first_burst_max_ms": round(1e3 * max(first), 1) if first else None,
            "steady_p99_ms": round(1e3 * float(np.percentile(steady, 99)), 1)
            if steady else None}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each case against the null connector of the same L1 and round."""
    base = {(r["round"], r["l1_blocks"]): r for r in rows if r["status"] == "ok" and
            r["case"].startswith("null")}
    for r in rows:
        b = base.get((r["round"], r.get("l1_blocks")))
        if r["status"] == "ok" and b is not None:
            r["throughput_x"] = r["req_per_s"] / b["req_per_s"]
            r["ttft_p50_x"] = r["ttft_p50_ms"] / b["ttft_p50_ms"]
            r["ttft_p99_x"] = r["ttft_p99_ms"] / b["ttft_p99_ms"]
            for key in ("steady_p99", "first_burst_max"):
                if r.get(f"{key}_ms") and b.get(f"{key}_ms"):
                    r[f"{key}_x"] = r[f"{key}_ms"] / b[f"{key}_ms"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| round | case | L1 blocks | req/s | × null | TTFT p50 ms | × null | TTFT p99 ms "
             "| × null | steady p99 ms | × null | first burst max ms | × null "
             "| running | waiting |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['round']} | {r['case']} | {r['status']} |" + " |" * 12)
            continue
        lines.append(
            f"| {r['round']} | {r['case']} | {r['l1_blocks']} | {r['req_per_s']:.2f} | "
            f"{r.get('throughput_x', 1):.3f} | {r['ttft_p50_ms']:.0f} | "
            f"{r.get('ttft_p50_x', 1):.3f} | {r['ttft_p99_ms']:.0f} | {r.get('ttft_p99_x', 1):.3f} "
            f"| {f(r.get('steady_p99_ms'), '.0f')} | {f(r.get('steady_p99_x', 1), '.3f')} "
            f"| {f(r.get('first_burst_max_ms'), '.0f')} | {f(r.get('first_burst_max_x', 1), '.3f')} "
            f"| {r.get('mean_running')} | {r.get('mean_waiting')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1536)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--l1-blocks", type=int, default=640)
    p.add_argument("--small-l1-blocks", type=int, default=136)
    p.add_argument("--host-gb", type=float, default=0.1)
    p.add_argument("--cases", default=",".join(c.name for c in CASES),
                   help=f"comma-separated, of: {', '.join(c.name for c in CASES)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the cases this many times, in turn (machine noise)")
    p.add_argument("--sample-load", action="store_true",
                   help="poll vLLM's /metrics every 0.2 s for its running / waiting "
                        "requests (perturbs a HiCache server: docs/benchmarks.md)")
    p.add_argument("--sample-interval", type=float, default=0.2,
                   help="seconds between two --sample-load reads of /metrics")
    p.add_argument("--profile", action="store_true",
                   help="HICACHE_PROFILE in every server (one JSON line per step; "
                        "`hicache profile summary` reads them)")
    p.add_argument("--out", default="bench_results/serve-overhead")
    args = p.parse_args(argv)
    known = {c.name: c for c in CASES}
    names = pick_cases(p, args.cases, known)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = alternate(names, args.rounds, lambda round_, name: {
        "round": round_, **run_case(known[name], round_, args, out)})
    add_ratios(rows)
    (out / "serve_overhead.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                        indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
