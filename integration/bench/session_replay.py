"""Replay recorded agent sessions against any OpenAI-compatible server:
``hicache bench replay --format claude-code``.

Contract
========

:func:`load_claude_code` reads the WEKA Claude Code corpus in its compact form
(one session per line, optionally gzipped: ``{"id", "block_size": 64,
"requests": [{"t", "in", "out", "think_time", "keep", "add"}, ...]}``; a
request's hash ids are ``previous[:keep] + add``; ``type: "subagent"``
entries carry their own ``requests``, chained the same way from an empty list)
and turns each session into turns a small model can serve:

- every hash id becomes a fixed run of ``block_tokens`` token ids drawn from
  ``[token_low, token_high)`` by a numpy generator seeded with ``(seed,
  session, id)`` (the corpus' ids are comparable only within one session), so
  two turns of a session share exactly the prefix the trace says they share and
  two sessions share nothing;
- a turn's prompt is its blocks in order, ``in`` scaled by ``block_tokens /
  block_size`` (rounded up, at most its full blocks, at least one token); its
  answer ``min(out, max_output_tokens)`` tokens (greedy, ``ignore_eos``), or
  exactly ``output_tokens`` when that is given;
- a sub-agent's requests are turns of its parent's session, in the parent's
  order where the sub-agent entry stands (the parent waits for it, as Claude
  Code's task tool does), each keeping its own recorded think time;
- ``think_s`` is the request's recorded ``think_time``: the client's or the
  tool's gap between the previous answer and this request;
- a turn whose prompt plus answer exceeds ``max_model_len`` is skipped and
  counted, and the session goes on; ``sessions`` sessions are read from the
  start of the file, ``max_turns`` (> 0) keeps each one's first turns.

:func:`replay_sessions` sends them to ``{base_url}/v1/completions``: at most
``concurrency`` sessions at once, started in file order as slots free and
session ``k`` no earlier than ``k * session_gap_s`` seconds after the start
(the corpus records no session start times; the simulator's
``--session-gap`` is the same schedule); within
a session each turn is sent when the previous one has finished and its think
time has passed, ``think_s * time_scale`` capped at ``max_think_s`` (the
first turn of a session waits for nothing). With :class:`AgentHints` the
client behaves as an agent framework that tells the cache what comes back:
every request carries ``kv_transfer_params.hicache`` with the session's id
(and ``retain_s`` when set), ``prefetch_lead_s`` before a later turn (within
its pause) the last prompt sent on the same request list (the session's own or
its sub-agent's: what the agent knows its next request continues) goes to the
admin endpoint's ``POST /prefetch``, and a finished session is closed (``POST
/sessions/{id}/close``); with ``return_in`` each request also says when the
session's next turn comes (``return_in_s``: that turn's pause, known from the
trace: an agent that knows its tool's duration), so the server books the read
back into L2 itself, with no admin call. A refused prefetch or close is
counted, never a failed request. Each request is measured as ``hicache bench replay`` measures
it (TTFT from the first streamed token, ``usage`` for cached tokens), turn
numbers kept, so the returning-turn TTFT of ``hicache bench compare`` reads it.
A failed request ends only its own session.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np

from hicache.integration.bench.client import (
    _admin_get,
    _admin_post,
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
from hicache.integration.bench.replay import TokenSpec
from hicache.integration.bench.report import summarize
from hicache.integration.bench.trace_formats import numbered_lines


@dataclass(frozen=True)
class SessionTurn:
    """One request of a session: where it came from, its recorded pause, what to send."""

    session: str
    # Position in the session's replay order (sub-agents' requests included).
    index: int
    # The request list it was recorded in: the session's id, a sub-agent's "id/agent".
    chain: str
    where: str
    think_s: float
    prompt: tuple[int, ...]
    output_tokens: int


@dataclass(frozen=True)
class SessionSpec(TokenSpec):
    """How a Claude Code trace becomes turns (see the module docstring)."""

    block_tokens: int = 1
    sessions: int = 8
    max_turns: int = 0

    _POSITIVE: ClassVar[tuple[str, ...]] = (*TokenSpec._POSITIVE, "sessions")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0 (0: every turn), got {self.max_turns}")


@dataclass(frozen=True)
class AgentHints:
    """What the replayed agent tells the cache (see the module docstring)."""

    retain_s: float = 0.0
    prefetch_lead_s: float = 0.0
    # Each request says when its session's next turn comes (return_in_s: that turn's
    # scaled think time, as the trace knows it), so the server books the read itself.
    return_in: bool = False
    close: bool = True

    def __post_init__(self) -> None:
        for key in ("retain_s", "prefetch_lead_s"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")


@dataclass
class LoadedSessions:
    """The replayable sessions, and what was skipped on the way."""

    sessions: list[list[SessionTurn]]
    sessions_read: int
    skipped_too_long: int

    @property
    def turns(self) -> int:
        return sum(len(s) for s in self.sessions)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t.prompt) for s in self.sessions for t in s)


def _field(d: dict[str, Any], key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise ValueError(f"{where}: key {key!r} is missing or not a "
                         f"{getattr(kinds, '__name__', 'number')} (a Claude Code compact "
                         f"trace needs id, block_size, requests[t, in, out, keep, add])")
    return v


class _SessionBuilder:
    """One session's turns: its requests (and sub-agents') decoded in order."""

    def __init__(self, spec: SessionSpec, sid: str, block: int, where: str) -> None:
        self.spec, self.sid, self.block, self.where = spec, sid, block, where
        self.scope = zlib.crc32(sid.encode())
        self.turns: list[SessionTurn] = []
        self.skipped = 0
        self._runs: dict[int, np.ndarray] = {}

    def _run(self, hash_id: int) -> np.ndarray:
        run = self._runs.get(hash_id)
        if run is None:
            rng = np.random.default_rng([self.spec.seed, self.scope, hash_id])
            run = rng.integers(self.spec.token_low, self.spec.token_high,
                               self.spec.block_tokens, dtype=np.int64)
            self._runs[hash_id] = run
        return run

    def add(self, requests: Any, where: str, chain: str) -> None:
        if not isinstance(requests, list):
            raise ValueError(f"{where}: key 'requests' must be a list")
        prev: list[int] = []
        for i, r in enumerate(requests):
            at = f"{where} request {i}"
            if not isinstance(r, dict):
                raise ValueError(f"{at}: expected a JSON object")
            if r.get("type") == "subagent":
                self.add(r.get("requests"), f"{at} (sub-agent)",
                         f"{chain}/{r.get('agent_id', i)}")
                continue
            keep = _field(r, "keep", int, at)
            add = _field(r, "add", list, at)
            prev = prev[:keep] + [int(h) for h in add]
            self._turn(prev, _field(r, "in", int, at), _field(r, "out", int, at),
                       float(r.get("think_time") or 0.0), at, chain)

    def _turn(self, ids: list[int], input_tokens: int, output_tokens: int, think_s: float,
              where: str, chain: str) -> None:
        spec = self.spec
        if spec.max_turns and len(self.turns) + self.skipped >= spec.max_turns:
            return
        full = min(len(ids), input_tokens // self.block)
        n_prompt = max(1, min(math.ceil(input_tokens * spec.block_tokens / self.block),
                              full * spec.block_tokens))
        n_out = spec.output_tokens or max(1, min(output_tokens, spec.max_output_tokens))
        if n_prompt + n_out > spec.max_model_len or not ids:
            self.skipped += 1
            return
        need = math.ceil(n_prompt / spec.block_tokens)
        prompt = np.concatenate([self._run(h) for h in ids[:need]])[:n_prompt]
        self.turns.append(SessionTurn(self.sid, len(self.turns), chain, where, max(0.0, think_s),
                                      tuple(int(t) for t in prompt), n_out))


def load_claude_code(lines: Iterable[tuple[str, str]], spec: SessionSpec) -> LoadedSessions:
    """The first ``spec.sessions`` sessions of ``(where, line)`` pairs."""
    sessions: list[list[SessionTurn]] = []
    skipped = read = 0
    for where, text in lines:
        if read >= spec.sessions:
            break
        read += 1
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object (one session per line)")
        builder = _SessionBuilder(spec, str(_field(d, "id", str, where)),
                                  _field(d, "block_size", int, where), where)
        if builder.block < 1:
            raise ValueError(f"{where}: key 'block_size' must be >= 1")
        builder.add(d.get("requests"), where, builder.sid)
        skipped += builder.skipped
        if builder.turns:
            sessions.append(builder.turns)
    return LoadedSessions(sessions, read, skipped)


def load_claude_code_file(path: str | Path, spec: SessionSpec) -> LoadedSessions:
    """:func:`load_claude_code` of a file (``.gz`` read gzipped)."""
    return load_claude_code(numbered_lines(path), spec)


async def replay_sessions(
    base_url: str, trace: LoadedSessions, *, concurrency: int = 4, time_scale: float = 1.0,
    max_think_s: float | None = None, session_gap_s: float = 0.0,
    hints: AgentHints | None = None,
    model: str | None = None, admin_url: str | None = None, admin_token: str | None = None,
    progress: bool = True, request_timeout: float = 600.0,
    record_path: str | Path | None = None,
) -> dict[str, Any]:
    """Send ``trace``'s sessions (see the module docstring); the run's result mapping."""
    if concurrency < 1:
        raise ValueError(f"concurrency (sessions at once) must be >= 1, got {concurrency}")
    if time_scale < 0 or session_gap_s < 0 or (max_think_s is not None and max_think_s < 0):
        raise ValueError("time_scale, session_gap_s and max_think_s must be >= 0")
    if hints is not None and hints.prefetch_lead_s and admin_url is None:
        raise ValueError("prefetch_lead_s needs the admin endpoint (--admin-url): pause-time "
                         "prefetches go to its POST /prefetch")
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 30.0))
    records: list[RequestRecord] = []
    counts = {"prefetch_calls": 0, "prefetch_failed": 0, "closed": 0, "close_failed": 0}
    prefetched: dict[str, tuple[float, int]] = {}
    sent_hints: dict[str, dict[str, Any]] = {}  # request id -> the hints it carried
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        if model is None:
            model = await _first_model(http, base_url)
        before: dict[str, Any] | None = None
        page_size = None
        if admin_url is not None:
            admin_url = admin_url.rstrip("/")
            before = await _admin_get(http, f"{admin_url}/stats", admin_token)
            page_size = _page_size_of(await _admin_get(http, f"{admin_url}/config", admin_token))
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        def pause_of(turn: SessionTurn) -> float:
            pause = turn.think_s * time_scale
            return pause if max_think_s is None else min(pause, max_think_s)

        async def prefetch(rec_id: str, history: tuple[int, ...], prompt: tuple[int, ...],
                           lead: float) -> None:
            started = clock()
            # Recorded as the share of this prompt it covers (trace.py's prefetch_tokens).
            shared = next((i for i, (a, b) in enumerate(zip(history, prompt, strict=False))
                           if a != b), min(len(history), len(prompt)))
            prefetched[rec_id] = (started, shared)
            counts["prefetch_calls"] += 1
            if not await _admin_post(http, f"{admin_url}/prefetch", admin_token,
                                     {"prefix": list(history)}):
                counts["prefetch_failed"] += 1
            await asyncio.sleep(max(0.0, lead - (clock() - started)))

        slots = asyncio.Semaphore(concurrency)
        with _ProgressBar(progress, trace.turns) as advance:

            async def session(k: int, turns: list[SessionTurn]) -> None:
                await asyncio.sleep(max(0.0, k * session_gap_s - clock()))
                async with slots:
                    request_hints = None if hints is None else {
                        "session_id": turns[0].session,
                        **({"retain_s": hints.retain_s} if hints.retain_s else {})}
                    # The last prompt sent on each request list: what the agent knows
                    # of the history its next request there continues.
                    history: dict[str, tuple[int, ...]] = {}
                    for i, turn in enumerate(turns):
                        rec_id = f"{turn.session}#{turn.index}"
                        if turn.index:
                            pause = pause_of(turn)
                            known = history.get(turn.chain)
                            lead = min(hints.prefetch_lead_s if hints and known else 0.0, pause)
                            await asyncio.sleep(pause - lead)
                            if lead and known:
                                await prefetch(rec_id, known, turn.prompt, lead)
                        rec = RequestRecord(id=rec_id, client=k, turn=turn.index,
                                            arrival=clock(), prompt_tokens=len(turn.prompt),
                                            prompt_ids=list(turn.prompt))
                        records.append(rec)
                        sent = request_hints
                        if hints is not None and hints.return_in and i + 1 < len(turns):
                            sent = {**(request_hints or {}),
                                    "return_in_s": round(pause_of(turns[i + 1]), 3)}
                        if sent:
                            sent_hints[rec_id] = sent
                        body = _request_body(model, list(turn.prompt), turn.output_tokens,
                                             sent)
                        try:
                            await asyncio.wait_for(
                                _stream_one(http, f"{base_url}/v1/completions", body, rec,
                                            clock), request_timeout)
                        except (httpx.HTTPError, _RequestFailed, asyncio.TimeoutError) as e:
                            rec.error = _describe(e, request_timeout)
                            rec.finish = clock()
                            advance(len(turns) - turn.index)
                            break
                        advance(1)
                        history[turn.chain] = turn.prompt
                    if hints is not None and hints.close and admin_url is not None:
                        counts["closed"] += 1
                        if not await _admin_post(
                                http, f"{admin_url}/sessions/{turns[0].session}/close",
                                admin_token, {}):
                            counts["close_failed"] += 1

            tasks = [asyncio.ensure_future(session(k, s)) for k, s in enumerate(trace.sessions)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        duration = clock()
        tiers = await tiers_since(http, admin_url, admin_token, before, page_size, records)
    records.sort(key=lambda r: (r.arrival, r.client))
    if record_path is not None:
        write_served(record_path, records, lambda r: sent_hints.get(r.id), prefetched)
    summary = summarize(records, duration)
    if hints is not None:
        summary.update(counts)
    return {"base_url": base_url, "model": model, "duration_s": duration,
            "summary": summary, "tiers": tiers,
            "trace": {"format": "claude-code", "sessions_read": trace.sessions_read,
                      "sessions": len(trace.sessions), "replayed": trace.turns,
                      "skipped_too_long": trace.skipped_too_long,
                      "prompt_tokens": trace.prompt_tokens},
            "hints": None if hints is None else asdict(hints),
            "requests": [r.to_dict() for r in records]}


def replay_sessions_sync(base_url: str, trace: LoadedSessions, **kwargs: Any) -> dict[str, Any]:
    """:func:`replay_sessions` from synchronous code (same keyword arguments)."""
    return asyncio.run(replay_sessions(base_url, trace, **kwargs))


__all__ = ["AgentHints", "LoadedSessions", "SessionSpec", "SessionTurn", "load_claude_code",
           "load_claude_code_file", "replay_sessions", "replay_sessions_sync"]
