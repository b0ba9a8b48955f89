"""``hicache bench compare CONFIG.yaml``: every system in turn, same workload, one table.

For each system of the config (see systems.py) the runner starts the
server, waits for ``/health``, runs the workload client with the config's
seed (the same prompts for everyone; the trace of each run is recorded),
stops the server (SIGTERM to its process group, SIGKILL after 60 s) and
moves on. A system that cannot start here — its interpreter or package is
missing, it needs a GPU, or its server exits or never becomes ready — is a
row saying ``not run: <reason>`` (the last error line of its log), never a
missing row.

Outputs under ``out``: ``compare.json`` (every row, every summary),
``compare.md`` (the table as Markdown, for the docs), the client's plots
for the systems that ran, one ``<system>.json`` result and
``<system>.trace.jsonl`` per run, and ``<system>.log`` with each server's
output. The headline column is the **returning-turn TTFT** (requests after a
client's first turn: the ones a KV cache can serve) as a ratio to the first
system that ran (the ``vllm`` baseline in the shipped presets).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.bench.systems import (
    CompareConfig,
    ConfigError,
    LaunchPlan,
    SystemSpec,
    plan,
    remove_stores,
    server_env,
)
from hicache.integration.vllm.engine import note_engine_start

# "ValueError: ...", and a bare "Exception: ..." (vLLM's engine core raises one for a
# platform it does not support; which line reaches the log first depends on timing).
_ERROR_LINE = re.compile(r"(\b\w*(Error|Exception)): (.+)")


def failure_reason(log: Path, fallback: str) -> str:
    """The most specific error line of a server log (the root cause, not the wrapper)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return fallback
    for line in reversed(lines):  # vLLM wraps a worker's error; the quoted part is the cause
        worker = re.search(r"Worker failed with error '(.+?)'", line)
        if worker:
            return worker.group(1)
    # vLLM's WARNING lines quote errors that may happen (its ulimit hint names
    # "OSError: [Errno 24] Too many open files"): never a cause.
    hits = [m for m in (_ERROR_LINE.search(line) for line in lines if " WARNING " not in line)
            if m]
    generic = ("Engine core initialization failed", "please check the stack trace")
    specific = [m for m in hits if not any(g in m.group(0) for g in generic)]
    picks = specific or hits
    return picks[-1].group(0)[:300] if picks else fallback


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group; SIGKILL after 60 s. A server that exited
    by itself gets ``grace_s`` for the rest of its group (vLLM's workers) to write
    their errors to the log and exit."""
    if proc.poll() is not None:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> str | None:
    """None once ``/health`` answers 200; otherwise why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"server exited during start (code {proc.returncode})"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return f"not ready after {timeout_s:.0f} s"


def returning_ttfts(requests: list[dict[str, Any]]) -> list[float]:
    """TTFT (s) of the requests after each client's first turn."""
    return [r["ttft"] for r in requests
            if r.get("turn", 0) > 0 and r.get("ttft") is not None and not r.get("error")]


def returning_ttft_ms(requests: list[dict[str, Any]], q: float = 0.5) -> float | None:
    """The ``q`` quantile (default the median) of the returning turns' TTFT, ms."""
    vals = sorted(returning_ttfts(requests))
    if not vals:
        return None
    if q == 0.5:
        return 1e3 * statistics.median(vals)
    return 1e3 * vals[min(len(vals) - 1, int(q * len(vals)))]


def run_system(cfg: CompareConfig, spec: SystemSpec, out: Path,
               progress: bool = True) -> dict[str, Any]:
    """Launch, measure and stop one system; the row of the comparison table."""
    from hicache.integration.bench.client import run_bench_sync
    from hicache.integration.bench.trace_workload import TraceWorkload, is_trace_workload
    from hicache.integration.bench.workloads import WorkloadSpec

    row: dict[str, Any] = {"system": spec.name, "kind": spec.kind}
    workdir = out / "work"
    lp: LaunchPlan = plan(cfg, spec, port=free_port(), admin_port=free_port(), workdir=workdir)
    row["command"] = lp.cmd
    if lp.not_run is not None:
        return {**row, "status": "not run", "reason": lp.not_run}
    log = out / f"{spec.name}.log"
    t0 = time.monotonic()
    note_engine_start(f"{spec.kind} server")
    with log.open("wb") as f:
        proc = subprocess.Popen(lp.cmd, stdout=f, stderr=subprocess.STDOUT, env=server_env(lp),
                                start_new_session=True)
    try:
        why = wait_ready(proc, lp.base_url, cfg.ready_timeout_s)
        if why is not None:
            stop_server(proc)
            return {**row, "status": "not run", "reason": failure_reason(log, why)}
        row["start_s"] = round(time.monotonic() - t0, 1)
        workload = {"seed": cfg.seed, **cfg.workload, **spec.workload}
        admin = {"admin_url": lp.admin_url, "admin_token": lp.env.get("HICACHE_ADMIN_TOKEN")}
        if is_trace_workload(workload):
            data = TraceWorkload.from_dict(workload).run(
                lp.base_url, max_model_len=cfg.max_model_len, progress=progress,
                record_path=out / f"{spec.name}.trace.jsonl", **admin)
            (out / f"{spec.name}.json").write_text(json.dumps(data, indent=1) + "\n")
        else:
            result = run_bench_sync(
                lp.base_url, WorkloadSpec.from_dict(workload), progress=progress,
                trace_path=out / f"{spec.name}.trace.jsonl", **admin)
            result.to_json(out / f"{spec.name}.json")
            data = result.to_dict()
        errors = data["summary"].get("n_errors", 0)
        row.update(status="ok" if not errors else "errors", summary=data["summary"],
                   tiers=data.get("tiers"),
                   returning_ttft_ms_p50=returning_ttft_ms(data["requests"]),
                   returning_ttft_ms_p99=returning_ttft_ms(data["requests"], 0.99))
        if errors:
            first = next(r["error"] for r in data["requests"] if r.get("error"))
            row["reason"] = f"{errors} failed requests, first: {first}"
        return row
    finally:
        stop_server(proc)


def run_compare(cfg: CompareConfig, *, out: Path | None = None,
                progress: bool = True) -> dict[str, Any]:
    from rich.console import Console

    console = Console()
    console.width = max(console.width, 180)  # the table has 11 columns
    missing = trace_missing(cfg)
    if missing:
        raise ConfigError(f"{cfg.name}: {missing}")
    out = Path(out or cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for i, spec in enumerate(cfg.systems, 1):
            console.rule(f"[{i}/{len(cfg.systems)}] {spec.name} ({spec.kind})")
            row = run_system(cfg, spec, out, progress)
            if row["status"] == "not run":
                console.print(f"[yellow]not run:[/] {row['reason']}")
            rows.append(row)
    finally:
        remove_stores(out / "work")
    add_ratios(rows)
    report = {"config": _jsonable(asdict(cfg)), "rows": rows,
              "load_average": os.getloadavg()}
    (out / "compare.json").write_text(json.dumps(report, indent=2))
    (out / "compare.md").write_text(markdown_table(cfg, rows))
    ran = {r["system"]: out / f"{r['system']}.json" for r in rows if r["status"] != "not run"}
    if ran:
        from hicache.integration.bench.report import write_plots

        write_plots({name: json.loads(p.read_text()) for name, p in ran.items()}, out)
    console.print(render_table(cfg, rows))
    return report


def trace_missing(cfg: CompareConfig) -> str | None:
    """Why the config's recorded trace cannot be read (None: it can, or it has none)."""
    from hicache.integration.bench.trace_workload import TraceWorkload, is_trace_workload

    if not is_trace_workload(cfg.workload):
        return None
    return TraceWorkload.from_dict(cfg.workload).missing()


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Returning-turn TTFT of each system over that of the first system that ran."""
    base = next((r["returning_ttft_ms_p50"] for r in rows
                 if r.get("returning_ttft_ms_p50")), None)
    for r in rows:
        v = r.get("returning_ttft_ms_p50")
        r["returning_ttft_ratio"] = round(v / base, 3) if v and base else None


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


COLUMNS = ("system", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "returning-turn TTFT p50 ms",
           "vs baseline", "ITL p50 ms", "req/s", "output tok/s", "cached share",
           "L1 / L2 / L3 hits")


def _cells(cfg: CompareConfig, r: dict[str, Any]) -> list[str]:
    if r["status"] == "not run":
        return [r["system"], f"not run: {r['reason']}"] + [""] * (len(COLUMNS) - 2)
    s = r["summary"]

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    share = s.get("cached_share")
    tiers = r.get("tiers") or {}
    hits = "-"
    if tiers and s.get("prompt_tokens"):
        page = tiers.get("page_size") or cfg.page_size
        hits = " / ".join(
            f"{100 * tiers[t]['hits'] * page / s['prompt_tokens']:.0f}%" if t in tiers else "-"
            for t in ("l1", "l2", "l3"))
    ratio = r.get("returning_ttft_ratio")
    name = r["system"] + (f" ({r['reason']})" if r.get("reason") else "")
    return [name, ms(s["ttft_ms"]["p50"]), ms(s["ttft_ms"]["p90"]), ms(s["ttft_ms"]["p99"]),
            ms(r.get("returning_ttft_ms_p50")), "-" if ratio is None else f"{ratio:.2f}x",
            ms(s["itl_ms"]["p50"]), f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.0f}", "-" if share is None else f"{100 * share:.0f}%",
            hits]


def markdown_table(cfg: CompareConfig, rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(cfg, r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_table(cfg: CompareConfig, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title=f"hicache bench compare: {cfg.name}")
    for c in COLUMNS:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*_cells(cfg, r))
    return table
