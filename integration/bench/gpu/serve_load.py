"""Serving under load: many clients at once against one vLLM engine with a do-nothing
connector, with HiCache (stores waiting for their step, and stores across steps) and with
vLLM's native CPU offloading on the same host budget, at two L1 sizes. Made for the lent
GPU (the bundle of ``bundle.py`` carries vLLM's engine but not its HTTP server's
dependencies); ``--preset test --device cpu`` runs the same thing on the CPU build.

Contract:
- The client is closed-loop, as ``vllm bench serve --max-concurrency C`` with an
  infinite request rate: ``C`` clients each send their next request when their last one
  finished. It drives vLLM's ``LLMEngine`` (``add_request`` / ``step``) in the case's
  process, with the engine core in its own process, as ``vllm serve`` runs it; prompts
  go as token ids (no tokenizer cost on either side).
- Workloads, the same token ids in every case:
    ``prefix``: vLLM bench's ``prefix_repetition`` shape: ``--num-prefixes`` prefixes of
      ``--prefix-len`` random tokens, each prompt a prefix plus ``--suffix-len`` random
      tokens, ``--num-prompts`` prompts (the same number per prefix) in a seeded
      shuffled order, ``--output-len`` tokens each (EOS ignored);
    ``multiturn``: ``--conversations`` conversations of ``--turns`` turns; turn 1 is
      ``--first-len`` random tokens, each later turn the whole history (prompts and
      answers) plus ``--turn-len`` new tokens. Turns go in rounds (every conversation's
      turn t before any turn t+1), a turn only after its conversation's last answer.
  Each workload starts from an empty L1 (and an empty HiCache L2).
- Cases (``CASES``): ``null`` (connector that never loads: the baseline),
  ``hicache`` (stores waiting for their step), ``hicache-async`` (stores across
  steps), ``offload`` (vLLM's OffloadingConnector), each with an L1 that holds every
  prefix (``--l1-blocks``) and with ``-small``, an L1 of a fifth of the prefixes
  (``--small-l1-blocks``). HiCache and offloading get ``--host-gb`` of host memory.
  Every case runs in its own child process under a time limit; a crash costs that
  case only.
- Start-up: with ``--parallel`` the cases of one L1 size start their engines at the
  same time (each case's KV cache is sized in bytes, so engines do not profile each
  other's memory), warm up, and wait at a gate; the parent then opens the gates one
  case at a time, so the measured runs never overlap. Without it, one case at a time.
- Measured per case and workload: completed requests, wall time from the first
  request to the last answer, request and output-token throughput, TTFT (vLLM's own
  per-request first-token latency, arrival to first token) p50 / p99 / mean, and the
  prompt tokens vLLM reports as cached. Ratios: each case against ``null`` of the same
  L1 size; the small-L1 cases also against ``null`` with the large L1 (the floor:
  a server whose L1 holds everything).
- Outputs in ``--out``: ``results.json`` (written after each case), ``report.md``
  (the tables and the command), ``serve_load.png``.

    python -m hicache.integration.bench.gpu.serve_load run --preset gpu8b --out OUT --parallel
    python -m hicache.integration.bench.gpu.serve_load run --preset test --device cpu \\
        --cases null,hicache --out OUT    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.integration.bench.gpu.e2e import prompt_tokens


@dataclass(frozen=True)
class Case:
    """One engine configuration."""

    kind: str  # "null" | "hicache" | "offload"
    small_l1: bool = False
    hicache_extra: dict[str, Any] = field(default_factory=dict)


def _cases() -> dict[str, Case]:
    base = {"null": Case("null"), "hicache": Case("hicache"),
            "hicache-async": Case("hicache", hicache_extra={"hicache_async_stores": True}),
            "offload": Case("offload")}
    out = dict(base)
    for name, case in base.items():
        out[f"{name}-small"] = Case(case.kind, True, case.hicache_extra)
    return out


CASES: dict[str, Case] = _cases()
DEFAULT_CASES = ("null", "hicache", "hicache-async", "offload", "null-small", "hicache-small",
                 "hicache-async-small", "offload-small")
WORKLOADS = ("prefix", "multiturn")


# ---- workloads -----------------------------------------------------------------


@dataclass
class Job:
    """One request to send: its id, prompt, and (multi-turn) conversation and turn."""

    rid: str
    prompt: list[int]
    conv: int = -1
    turn: int = 0


class PrefixJobs:
    """vLLM bench's prefix_repetition: a fixed, shuffled list of prefix + suffix prompts."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        per_prefix = max(1, args.num_prompts // args.num_prefixes)
        jobs: list[Job] = []
        for p in range(args.num_prefixes):
            prefix = prompt_tokens(args.prefix_len, 7_000_000 + p, vocab)
            for i in range(per_prefix):
                suffix = prompt_tokens(args.suffix_len, 8_000_000 + p * 10_000 + i, vocab)
                jobs.append(Job(f"p{p}-{i}", prefix + suffix))
        random.Random(args.seed).shuffle(jobs)
        self.queue = deque(jobs)
        self.total = len(jobs)

    def next_ready(self) -> Job | None:
        return self.queue.popleft() if self.queue else None

    def finished(self, job: Job, output: list[int]) -> None:
        pass

    def done(self) -> bool:
        return not self.queue


class MultiTurnJobs:
    """Conversations in rounds; a turn is ready once its conversation's last answer came."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.vocab = vocab
        self.turn_len = args.turn_len
        self.turns = args.turns
        self.history = {c: prompt_tokens(args.first_len, 9_000_000 + c, vocab)
                        for c in range(args.conversations)}
        self.next_turn = dict.fromkeys(self.history, 0)
        self.busy: set[int] = set()
        self.total = args.conversations * args.turns

    def next_ready(self) -> Job | None:
        # The conversation furthest behind goes first: rounds, not one conversation's
        # turns back to back.
        ready = [c for c, t in self.next_turn.items() if t < self.turns and c not in self.busy]
        if not ready:
            return None
        c = min(ready, key=lambda k: (self.next_turn[k], k))
        t = self.next_turn[c]
        if t > 0:
            self.history[c] = self.history[c] + prompt_tokens(
                self.turn_len, 9_500_000 + c * 100 + t, self.vocab)
        self.busy.add(c)
        return Job(f"c{c}-t{t}", list(self.history[c]), conv=c, turn=t)

    def finished(self, job: Job, output: list[int]) -> None:
        self.history[job.conv] = self.history[job.conv] + output
        self.next_turn[job.conv] = job.turn + 1
        self.busy.discard(job.conv)

    def done(self) -> bool:
        return all(t >= self.turns for t in self.next_turn.values())


def make_jobs(workload: str, args: argparse.Namespace, vocab: int) -> PrefixJobs | MultiTurnJobs:
    if workload == "prefix":
        return PrefixJobs(args, vocab)
    if workload == "multiturn":
        return MultiTurnJobs(args, vocab)
    raise ValueError(f"unknown workload {workload!r}; allowed: {', '.join(WORKLOADS)}")


def workload_tokens(args: argparse.Namespace) -> dict[str, int]:
    """Distinct prompt + output tokens each workload leaves in the cache when L1 keeps all."""
    prefix = args.num_prefixes * args.prefix_len + (
        max(1, args.num_prompts // args.num_prefixes) * args.num_prefixes
        * (args.suffix_len + args.output_len))
    multiturn = args.conversations * (args.first_len + args.turns * args.output_len
                                      + (args.turns - 1) * args.turn_len)
    return {"prefix": prefix, "multiturn": multiturn}


def longest_request(args: argparse.Namespace) -> int:
    """Tokens of the longest sequence (prompt + output) any workload sends."""
    return max(args.prefix_len + args.suffix_len + args.output_len,
               args.first_len + args.turns * args.output_len + (args.turns - 1) * args.turn_len)


def max_model_len(args: argparse.Namespace) -> int:
    """``--max-model-len``, or the longest request rounded up to a whole block."""
    if args.max_model_len:
        return int(args.max_model_len)
    return math.ceil(longest_request(args) / args.block_size) * args.block_size


def l1_blocks(args: argparse.Namespace) -> tuple[int, int]:
    """(large, small) L1 sizes in blocks: ``--l1-blocks`` / ``--small-l1-blocks``, or
    derived: large holds every workload's tokens with 25% to spare; small holds a fifth
    of the prefixes, and never less than two of the longest requests (vLLM refuses an
    L1 that cannot hold one sequence of ``max_model_len``)."""
    need = max(workload_tokens(args).values())
    large = args.l1_blocks or math.ceil(1.25 * need / args.block_size)
    floor = max(2 * math.ceil(longest_request(args) / args.block_size),
                math.ceil(max_model_len(args) / args.block_size))
    small = args.small_l1_blocks or max(
        floor, math.ceil(args.num_prefixes * args.prefix_len / 5 / args.block_size))
    return large, small


# ---- the closed-loop client ------------------------------------------------------


def drive(engine: Any, jobs: PrefixJobs | MultiTurnJobs, concurrency: int,
          params: Any) -> dict[str, Any]:
    """Run every job with at most ``concurrency`` in flight; per-request records."""
    inflight: dict[str, tuple[Job, list[int]]] = {}
    alias: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    while True:
        while len(inflight) < concurrency:
            job = jobs.next_ready()
            if job is None:
                break
            internal = engine.add_request(job.rid, {"prompt_token_ids": job.prompt}, params)
            inflight[job.rid] = (job, [])
            # vLLM may make the id unique; its outputs carry one or the other.
            alias[str(internal)] = job.rid
        if not inflight:
            if jobs.done():
                break
            raise RuntimeError("no request in flight and none ready: the workload is stuck")
        for out in engine.step():
            rid = out.request_id if out.request_id in inflight else alias.get(out.request_id)
            if rid is None or rid not in inflight:
                continue
            job, tokens = inflight[rid]
            tokens.extend(out.outputs[0].token_ids)
            if not out.finished:
                continue
            del inflight[rid]
            metrics = getattr(out, "metrics", None)
            ttft = getattr(metrics, "first_token_latency", None) or None
            records.append({"rid": job.rid, "prompt_len": len(job.prompt),
                            "output_len": len(tokens), "cached": out.num_cached_tokens or 0,
                            "ttft": ttft, "done_s": time.perf_counter() - t0})
            jobs.finished(job, tokens)
    return summarize(records, time.perf_counter() - t0)


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [r["ttft"] * 1000 for r in records if r["ttft"] is not None]
    return {
        "completed": len(records), "wall_s": wall,
        "req_per_s": len(records) / wall if wall else 0.0,
        "out_tok_per_s": sum(r["output_len"] for r in records) / wall if wall else 0.0,
        "ttft_p50_ms": _percentile(ttfts, 50), "ttft_p99_ms": _percentile(ttfts, 99),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else float("nan"),
        "ttft_measured": len(ttfts),
        "prompt_tokens": sum(r["prompt_len"] for r in records),
        "cached_tokens": sum(r["cached"] for r in records),
    }


# ---- one case, in its own process ------------------------------------------------


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def engine_spec(case: Case, args: argparse.Namespace, name: str) -> Any:
    from hicache.integration.vllm.engine import EngineSpec

    large, small = l1_blocks(args)
    blocks = small if case.small_l1 else large
    gpu = args.device == "cuda"
    extra: dict[str, Any] = {"disable_log_stats": False,
                             "max_num_batched_tokens": args.max_num_batched_tokens}
    if gpu:
        # Sized in bytes: vLLM then skips memory profiling, so engines starting side
        # by side on one GPU do not count each other's allocations as their own.
        # The utilization only gates the free memory each engine finds at start.
        kv_bytes = blocks * args.block_size * kv_bytes_per_token(args.model)
        extra.update(kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=args.gpu_util)
    kv_transfer: dict[str, Any] | None = None
    hicache: dict[str, Any] | None = None
    if case.kind == "null":
        from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

        kv_transfer = dict(TRANSFER_CONFIG)
    elif case.kind == "hicache":
        hicache = {"hicache_size": args.host_gb, "hicache_admin_port": 0,
                   "hicache_io_backend": args.io if gpu else "direct", **case.hicache_extra}
    else:
        extra.update(kv_offloading_size=args.host_gb, kv_offloading_backend="native")
    return EngineSpec(model=args.model, hicache=hicache, kv_transfer=kv_transfer,
                      block_size=args.block_size, num_blocks=blocks,
                      max_model_len=max_model_len(args), max_num_seqs=args.concurrency,
                      dtype=args.dtype, in_process=False, extra_args=extra)


def _reset(llm: Any, kind: str, params_for: Any) -> None:
    """Empty L1 (and HiCache's L2), stepping a tiny request while blocks are held."""
    for _ in range(200):
        if llm.reset_prefix_cache(reset_connector=(kind == "hicache")):
            return
        llm.generate([{"prompt_token_ids": [11, 12, 13]}], params_for(1), use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError("reset_prefix_cache kept failing")


def _warm_up(llm: Any, kind: str, args: argparse.Namespace, vocab: int,
             params_for: Any) -> None:
    """First launches compile kernels: a prompt, then the same prompt from the connector."""
    warm = prompt_tokens(args.warmup, 123, vocab)
    for _ in range(2):
        llm.generate([{"prompt_token_ids": warm}], params_for(4), use_tqdm=False)
        _wait_settled(llm, params_for)
        llm.reset_prefix_cache(reset_connector=False)
    _reset(llm, kind, params_for)


def _wait_settled(llm: Any, params_for: Any) -> None:
    """A few idle steps so stores that finish across steps land before the next reset."""
    for _ in range(3):
        llm.generate([{"prompt_token_ids": [11, 12, 13]}], params_for(1), use_tqdm=False)


def _wait_gate(gate: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not gate.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from hicache.integration.vllm.engine import (
        close_llm,
        greedy_params,
        open_llm,
        streaming_greedy_params,
    )

    case = CASES[name]
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    spec = engine_spec(case, args, name)
    started = time.perf_counter()
    llm = open_llm(spec)
    start_seconds = time.perf_counter() - started
    out: dict[str, Any] = {"case": name, "kind": case.kind, "small_l1": case.small_l1,
                           "l1_blocks": spec.num_blocks, "start_seconds": start_seconds,
                           "hicache_extra": case.hicache_extra, "workloads": {}}
    try:
        _warm_up(llm, case.kind, args, vocab, greedy_params)
        if args.ready:
            Path(args.ready).write_text(json.dumps({"start_seconds": start_seconds}))
            if not _wait_gate(Path(args.gate), args.gate_timeout):
                out["status"] = "gate never opened"
                return out
        params = streaming_greedy_params(args.output_len)
        engine = llm.llm_engine
        for workload in args.workloads:
            _reset(llm, case.kind, greedy_params)
            jobs = make_jobs(workload, args, vocab)
            out["workloads"][workload] = drive(engine, jobs, args.concurrency, params)
            _wait_settled(llm, greedy_params)
    finally:
        close_llm(llm)
    return out


# ---- the parent: cases in children (waves of one L1 size), then the report -------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    result: Path
    ready: Path
    gate: Path
    log: Path
    t0: float


def _spawn(name: str, args: argparse.Namespace, model: str, out: Path) -> Child:
    result = out / f"case-{name}.json"
    ready = out / f"case-{name}.ready"
    gate = out / f"case-{name}.go"
    for p in (result, ready, gate):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "hicache.integration.bench.gpu.serve_load", "case", name,
           "--model", model, "--result", str(result), "--ready", str(ready),
           "--gate", str(gate), *_shared_argv(args)]
    log = out / f"case-{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Child(name, proc, result, ready, gate, log, time.perf_counter())


def _finish(child: Child, timeout: float) -> dict[str, Any]:
    try:
        rc: int | None = child.proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        _kill(child.proc)
        rc = None
    seconds = time.perf_counter() - child.t0
    case = CASES[child.name]
    if child.result.exists():
        data: dict[str, Any] = json.loads(child.result.read_text())
        data.setdefault("status", "ok")
        data["seconds"] = seconds
        return data
    tail = child.log.read_text(errors="replace").splitlines()[-40:]
    return {"case": child.name, "kind": case.kind, "small_l1": case.small_l1,
            "status": "timeout" if rc is None else f"failed rc={rc}", "seconds": seconds,
            "log_tail": tail}


def _kill(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _wait_ready(children: list[Child], deadline: float) -> None:
    """Until every child is at its gate, has exited, or the deadline passed."""
    while time.monotonic() < deadline:
        if all(c.ready.exists() or c.proc.poll() is not None for c in children):
            return
        time.sleep(0.2)


def waves(names: list[str], parallel: bool) -> Iterator[list[str]]:
    """Cases to start together: one L1 size at a time with ``parallel``, else one case."""
    if not parallel:
        yield from ([n] for n in names)
        return
    for small in (False, True):
        wave = [n for n in names if CASES[n].small_l1 is small]
        if wave:
            yield wave


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from hicache.integration.models.tiny_model import ensure_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(ensure_tiny_model(args.preset))
    args.model = model
    large, small = l1_blocks(args)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "preset": args.preset,
                               "device": args.device, "l1_blocks": large,
                               "small_l1_blocks": small, "workload_tokens":
                               workload_tokens(args), "cases": {}}
    print(f"model {args.preset}: {model}; L1 {large} / {small} blocks", flush=True)
    deadline = time.monotonic() + args.deadline
    bar = tqdm(total=len(args.cases), desc="serve cases")
    for wave in waves(args.cases, args.parallel):
        if deadline - time.monotonic() < 30:
            for name in wave:
                results["cases"][name] = {"case": name, "status": "skipped: out of time"}
            continue
        children = [_spawn(name, args, model, out) for name in wave]
        _wait_ready(children, min(deadline, time.monotonic() + args.case_timeout))
        for child in children:
            child.gate.touch()
            left = deadline - time.monotonic()
            results["cases"][child.name] = _finish(child, min(left, args.case_timeout))
            print(f"{child.name}: {results['cases'][child.name].get('status')}", flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            bar.update(1)
    bar.close()
    results["table"] = ratios(results["cases"])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    try:
        plot(results["table"], out / "serve_load.png")
    except Exception as exc:  # noqa: BLE001 - the tables matter more than the picture
        print(f"plot failed: {exc!r}")
    print(report(results), flush=True)
    return results


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--dtype", args.dtype, "--block-size", str(args.block_size),
            "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--workloads", ",".join(args.workloads), "--concurrency", str(args.concurrency),
            "--num-prefixes", str(args.num_prefixes), "--prefix-len", str(args.prefix_len),
            "--suffix-len", str(args.suffix_len), "--num-prompts", str(args.num_prompts),
            "--output-len", str(args.output_len), "--conversations", str(args.conversations),
            "--turns", str(args.turns), "--first-len", str(args.first_len),
            "--turn-len", str(args.turn_len), "--l1-blocks", str(args.l1_blocks),
            "--small-l1-blocks", str(args.small_l1_blocks), "--host-gb", str(args.host_gb),
            "--gpu-util", str(args.gpu_util), "--io", args.io, "--warmup", str(args.warmup),
            "--seed", str(args.seed), "--gate-timeout", str(args.gate_timeout)]


METRICS = ("req_per_s", "ttft_p50_ms", "ttft_p99_ms")


def ratios(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, case): its figures, × null of the same L1, × the floor."""
    ok = {n: c for n, c in cases.items() if c.get("status") == "ok"}
    rows: list[dict[str, Any]] = []
    for name, case in cases.items():
        for workload, w in case.get("workloads", {}).items():
            row: dict[str, Any] = {"workload": workload, "case": name,
                                   "small_l1": case.get("small_l1", False),
                                   "l1_blocks": case.get("l1_blocks"), **w}
            base = ok.get("null-small" if case.get("small_l1") else "null")
            floor = ok.get("null")
            for label, ref in (("x_null", base), ("x_floor", floor)):
                ref_w = (ref or {}).get("workloads", {}).get(workload)
                if ref_w:
                    row[label] = {m: w[m] / ref_w[m] if ref_w[m] else float("nan")
                                  for m in METRICS}
            rows.append(row)
        if case.get("status") != "ok":
            rows.append({"workload": "-", "case": name, "status": case.get("status")})
    return rows


def report(results: dict[str, Any]) -> str:
    lines = [f"# Serving under load ({results['preset']}, {results['device']})", "",
             f"`{results['command']}`", "",
             f"L1: {results['l1_blocks']} blocks (holds every prefix), small "
             f"{results['small_l1_blocks']} blocks. Distinct tokens per workload: "
             f"{results['workload_tokens']}.", "",
             "| case | status | engine start s | case s |", "|---|---|---:|---:|"]
    for name, case in results["cases"].items():
        lines.append(f"| {name} | {case.get('status')} | {case.get('start_seconds', 0):.1f} | "
                     f"{case.get('seconds', 0):.0f} |")
    head = ("| workload | case | L1 blocks | req/s | × null | TTFT p50 ms | × null | "
            "TTFT p99 ms | × null | × floor (req/s, p99) | cached / prompt tokens |")
    lines += ["", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results.get("table", []):
        if "req_per_s" not in r:
            lines.append(f"| {r['workload']} | {r['case']} | {r.get('status')} |" + " |" * 8)
            continue
        xn = r.get("x_null", {})
        xf = r.get("x_floor", {})
        floor = (f"{xf['req_per_s']:.2f}, {xf['ttft_p99_ms']:.2f}"
                 if xf and r["small_l1"] else "")
        lines.append(
            f"| {r['workload']} | {r['case']} | {r['l1_blocks']} | {r['req_per_s']:.2f} | "
            f"{xn.get('req_per_s', float('nan')):.3f} | {r['ttft_p50_ms']:.1f} | "
            f"{xn.get('ttft_p50_ms', float('nan')):.3f} | {r['ttft_p99_ms']:.1f} | "
            f"{xn.get('ttft_p99_ms', float('nan')):.3f} | {floor} | "
            f"{r['cached_tokens']} / {r['prompt_tokens']} |")
    for name, case in results["cases"].items():
        if case.get("log_tail"):
            lines += ["", f"### {name} log tail", "", "```", *case["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if "req_per_s" in r]
    workloads = sorted({r["workload"] for r in rows})
    if not rows:
        return
    fig, axes = plt.subplots(len(workloads), 2, figsize=(10, 3.2 * len(workloads)),
                             squeeze=False)
    for i, workload in enumerate(workloads):
        sel = [r for r in rows if r["workload"] == workload]
        names = [r["case"] for r in sel]
        axes[i][0].barh(names, [r["req_per_s"] for r in sel])
        axes[i][0].set_xlabel("requests / s")
        axes[i][1].barh(names, [r["ttft_p99_ms"] for r in sel], color="tab:orange")
        axes[i][1].set_xlabel("TTFT p99, ms")
        axes[i][0].set_title(f"{workload}: throughput")
        axes[i][1].set_title(f"{workload}: p99 TTFT")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _add_shared(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=0,
                   help="0: the longest request, rounded up to a block")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prefixes", type=int, default=40)
    p.add_argument("--prefix-len", type=int, default=8192)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=320)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=4096)
    p.add_argument("--turn-len", type=int, default=256)
    p.add_argument("--l1-blocks", type=int, default=0, help="0: derived from the workloads")
    p.add_argument("--small-l1-blocks", type=int, default=0, help="0: a fifth of the prefixes")
    p.add_argument("--host-gb", type=float, default=16.0)
    p.add_argument("--gpu-util", type=float, default=0.2,
                   help="free share of the GPU each engine must find at start")
    p.add_argument("--io", default="kernel", choices=["kernel", "direct"])
    p.add_argument("--warmup", type=int, default=1024, help="warm-up prompt tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate-timeout", type=float, default=900.0)


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", action="store_true",
                   help="start the engines of one L1 size together, measure one at a time")


def _add_case(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ready", default="")
    p.add_argument("--gate", default="")


def _check(args: argparse.Namespace, error: Any) -> None:
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        error(f"unknown workloads {bad}; allowed: {', '.join(WORKLOADS)}")


def main(argv: list[str] | None = None) -> None:
    from hicache.integration.bench.gpu.case_cli import main_for

    main_for(argv, description=__doc__.split("\n\n")[0], cases=CASES,
             default_cases=DEFAULT_CASES, out_default="bench_results/gpu-serve",
             add_shared=_add_shared, run=run, run_case=run_case, add_run=_add_run,
             add_case=_add_case, check=_check)


if __name__ == "__main__":
    main()
