"""Replay a recorded production trace against any OpenAI-compatible server:
``hicache bench replay``.

Contract
========

:func:`load_mooncake` reads a Mooncake-format trace (FAST'25 release: one JSON
object per line, ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}``, each id a 512-token prefix-chained block, equal ids
meaning equal blocks) and turns it into token-id prompts a small model can
serve:

- every hash id becomes a fixed run of ``block_tokens`` token ids drawn from
  ``[token_low, token_high)`` by a numpy generator seeded with ``(seed, id)``:
  the same id gives the same tokens in every request, process and machine,
  so two requests share exactly the prefix the trace says they share;
- the prompt is the blocks in order, cut to ``input_length`` scaled by
  ``block_tokens / trace_block_tokens`` (rounded up): the last block is
  partial where the trace's is;
- the answer is ``min(output_length, max_output_tokens)`` tokens (greedy,
  ``ignore_eos``), or exactly ``output_tokens`` when that is given;
- a request whose prompt plus answer exceeds ``max_model_len`` is skipped and
  counted (the model cannot take it); ``requests`` is the number replayed, taken
  from the start of the trace.

:func:`replay` sends them in trace order to ``{base_url}/v1/completions``:

- ``concurrency`` > 0, ``time_scale`` None: a closed loop, at most
  ``concurrency`` requests in flight, the next sent when one finishes;
- ``time_scale`` s: each request is sent at ``timestamp * s`` seconds after
  the start (open loop; 0.5 replays twice as fast), still at most
  ``concurrency`` in flight when ``concurrency`` > 0.

Each request is measured as ``hicache bench run`` measures it (client.py:
TTFT from the first streamed token, ``usage`` for cached tokens; vLLM reports
them with ``--enable-prompt-tokens-details``). With ``admin_url`` (HiCache's
admin endpoint) the run also gets the per-tier page counters' deltas
(``tiers``). A failed request is recorded with its error; the run goes on.
The result is a mapping report.py plots and tabulates like a bench run's.
With ``record_path`` the completed requests are written as a trace.py trace
(prompt and answer token ids, arrival and finish), which ``hicache simulate``
replays with the server's sizes: what the simulator predicts for exactly the
requests the server served, skipped ones left out.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np

from hicache.integration.bench.client import (
    BenchError,
    _admin_get,
    _describe,
    _first_model,
    _page_size_of,
    _ProgressBar,
    _request_body,
    _RequestFailed,
    _stream_one,
    tiers_since,
    write_served,
)
from hicache.integration.bench.records import RequestRecord
from hicache.integration.bench.report import summarize

# What `hicache bench replay --format` reads (claude-code: session_replay.py).
TRACE_FORMATS = ("mooncake", "claude-code")
# Tokens per hash id in Mooncake's FAST'25 traces.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class ReplayRequest:
    """One request of the replay: its trace line, when to send it, what to send."""

    line: int
    # Seconds since the trace's first request.
    at_s: float
    prompt: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class TokenSpec:
    """How a trace's blocks become token ids, what a model can take, how long answers
    are: what every trace format's spec shares (checked when built)."""

    block_tokens: int = 128
    max_model_len: int = 4096
    max_output_tokens: int = 16
    output_tokens: int | None = None
    token_low: int = 10
    token_high: int = 2000
    seed: int = 0

    # Keys that must be >= 1 (a format's spec adds its own).
    _POSITIVE: ClassVar[tuple[str, ...]] = ("block_tokens", "max_model_len",
                                            "max_output_tokens")

    def __post_init__(self) -> None:
        for key in self._POSITIVE:
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1 or unset, got {self.output_tokens}")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"token_low/token_high must satisfy 0 <= low < high, got "
                             f"{self.token_low}/{self.token_high}")


@dataclass(frozen=True)
class ReplaySpec(TokenSpec):
    """How a Mooncake trace becomes requests (see the module docstring)."""

    requests: int = 800

    _POSITIVE: ClassVar[tuple[str, ...]] = (*TokenSpec._POSITIVE, "requests")


@dataclass
class LoadedTrace:
    """The replayable requests, and what was skipped on the way."""

    requests: list[ReplayRequest]
    lines_read: int
    skipped_too_long: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


class _Blocks:
    """Hash id -> its fixed token run, drawn once."""

    def __init__(self, spec: ReplaySpec) -> None:
        self.spec = spec
        self._runs: dict[int, np.ndarray] = {}

    def run(self, hash_id: int) -> np.ndarray:
        run = self._runs.get(hash_id)
        if run is None:
            rng = np.random.default_rng([self.spec.seed, hash_id])
            run = rng.integers(self.spec.token_low, self.spec.token_high,
                               self.spec.block_tokens, dtype=np.int64)
            self._runs[hash_id] = run
        return run


def _mooncake_line(line_no: int, text: str) -> tuple[float, int, int, list[int]]:
    try:
        d = json.loads(text)
        ids = d["hash_ids"]
        out = (float(d["timestamp"]) / 1e3, int(d["input_length"]), int(d["output_length"]),
               [int(h) for h in ids])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"trace line {line_no}: not a Mooncake record (needs timestamp, "
                         f"input_length, output_length, hash_ids): {exc}") from None
    if not out[3] or out[1] < 1:
        raise ValueError(f"trace line {line_no}: hash_ids must be non-empty and input_length "
                         f">= 1")
    return out


def load_mooncake(lines: Iterable[str], spec: ReplaySpec) -> LoadedTrace:
    """The first ``spec.requests`` replayable requests of a Mooncake trace."""
    blocks = _Blocks(spec)
    scale = spec.block_tokens / MOONCAKE_BLOCK_TOKENS
    out: list[ReplayRequest] = []
    skipped = read = 0
    t0: float | None = None
    for line_no, text in enumerate(lines, 1):
        if len(out) >= spec.requests:
            break
        if not text.strip():
            continue
        read += 1
        ts, input_length, output_length, ids = _mooncake_line(line_no, text)
        t0 = ts if t0 is None else t0
        n_prompt = min(math.ceil(input_length * scale), len(ids) * spec.block_tokens)
        n_out = spec.output_tokens or max(1, min(output_length, spec.max_output_tokens))
        if n_prompt + n_out > spec.max_model_len:
            skipped += 1
            continue
        need = math.ceil(n_prompt / spec.block_tokens)
        prompt = np.concatenate([blocks.run(h) for h in ids[:need]])[:n_prompt]
        out.append(ReplayRequest(line_no, ts - t0, tuple(int(t) for t in prompt), n_out))
    return LoadedTrace(out, read, skipped)


def load_trace(path: str | Path, fmt: str, spec: ReplaySpec) -> LoadedTrace:
    """Read ``path`` in format ``fmt`` (``mooncake``; agent sessions: session_replay.py)."""
    if fmt != "mooncake":
        allowed = "mooncake (claude-code: session_replay.load_claude_code_file)"
        raise ValueError(f"--format {fmt!r} is not known here; allowed: {allowed}")
    with Path(path).open() as f:
        return load_mooncake(f, spec)


async def replay(base_url: str, trace: LoadedTrace, *, concurrency: int = 16,
                 time_scale: float | None = None, model: str | None = None,
                 admin_url: str | None = None, admin_token: str | None = None,
                 progress: bool = True, request_timeout: float = 600.0,
                 record_path: str | Path | None = None) -> dict[str, Any]:
    """Send ``trace``'s requests (see the module docstring); the run's result mapping."""
    if concurrency < 0 or (concurrency == 0 and time_scale is None):
        raise ValueError("concurrency must be >= 1 for a closed loop (or give time_scale)")
    if time_scale is not None and time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    base_url = base_url.rstrip("/")
    slots = concurrency or len(trace.requests) or 1
    limits = httpx.Limits(max_connections=slots + 4, max_keepalive_connections=slots + 4)
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 30.0))
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        if model is None:
            model = await _first_model(http, base_url)
        before: dict[str, Any] | None = None
        page_size = None
        if admin_url is not None:
            admin_url = admin_url.rstrip("/")
            before = await _admin_get(http, f"{admin_url}/stats", admin_token)
            page_size = _page_size_of(await _admin_get(http, f"{admin_url}/config", admin_token))
        gate = asyncio.Semaphore(slots)
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        with _ProgressBar(progress, len(trace.requests)) as advance:

            async def one(i: int, req: ReplayRequest) -> None:
                rec = RequestRecord(id=f"line{req.line}", client=i, turn=0, arrival=clock(),
                                    prompt_tokens=len(req.prompt), prompt_ids=list(req.prompt))
                records.append(rec)
                body = _request_body(model, list(req.prompt), req.output_tokens)
                try:
                    await asyncio.wait_for(
                        _stream_one(http, f"{base_url}/v1/completions", body, rec, clock),
                        request_timeout)
                except (httpx.HTTPError, _RequestFailed, asyncio.TimeoutError) as e:
                    rec.error = _describe(e, request_timeout)
                    rec.finish = clock()
                finally:
                    gate.release()
                    advance(1)

            tasks = []
            try:
                for i, req in enumerate(trace.requests):
                    if time_scale is not None:
                        await asyncio.sleep(max(0.0, req.at_s * time_scale - clock()))
                    await gate.acquire()
                    tasks.append(asyncio.ensure_future(one(i, req)))
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        duration = clock()
        tiers = await tiers_since(http, admin_url, admin_token, before, page_size, records)
    records.sort(key=lambda r: r.arrival)
    if record_path is not None:
        write_served(record_path, records)
    return {"base_url": base_url, "model": model, "duration_s": duration,
            "summary": summarize(records, duration), "tiers": tiers,
            "trace": {"lines_read": trace.lines_read, "replayed": len(trace.requests),
                      "skipped_too_long": trace.skipped_too_long,
                      "prompt_tokens": trace.prompt_tokens},
            "requests": [r.to_dict() for r in records]}


def replay_sync(base_url: str, trace: LoadedTrace, **kwargs: Any) -> dict[str, Any]:
    """:func:`replay` from synchronous code (same keyword arguments)."""
    return asyncio.run(replay(base_url, trace, **kwargs))


def ideal_cached_share(requests: Sequence[ReplayRequest], page_tokens: int) -> float:
    """Share of prompt tokens an unbounded cache of ``page_tokens``-token pages could
    serve (full pages of each prompt seen before, leaving one token to compute)."""
    seen: set[int] = set()
    cached = total = 0
    for r in requests:
        total += len(r.prompt)
        limit = (len(r.prompt) - 1) // page_tokens
        chain, hit, hitting = 0, 0, True
        for p in range(len(r.prompt) // page_tokens):
            chain = hash((chain, r.prompt[p * page_tokens:(p + 1) * page_tokens]))
            if hitting and p < limit and chain in seen:
                hit += 1
            else:
                hitting = False
            seen.add(chain)
        cached += hit * page_tokens
    return cached / total if total else 0.0


def spec_dict(spec: ReplaySpec) -> dict[str, Any]:
    return asdict(spec)


__all__ = ["TRACE_FORMATS", "BenchError", "LoadedTrace", "ReplayRequest", "ReplaySpec",
           "ideal_cached_share", "load_mooncake", "load_trace", "replay", "replay_sync",
           "spec_dict"]
