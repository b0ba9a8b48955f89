"""Public KV-reuse traces as simulator records (trace.py ``TraceRecord``: page hashes, no tokens).

Contract
========

``load_trace(path, fmt, ...)`` reads one of:

- ``hicache``: this project's own JSONL (trace.py ``read_trace``);
- ``mooncake``: Mooncake's FAST'25 release (one JSON object per line,
  ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
  [...]}``, each id a 512-token block, equal ids meaning equal blocks);
- ``claude-code``: the WEKA Claude Code corpus in its compact form (one
  session per line, optionally gzipped: ``{"id", "block_size": 64,
  "requests": [{"t", "in", "out", "think_time", "keep", "add"}, ...]}``, a
  request's hash ids being ``previous[:keep] + add``; ``type: "subagent"``
  entries carry their own ``requests``, chained the same way from an empty
  list, their ``t`` counted from the sub-agent's own start).

Every trace block becomes one simulator page of ``page_size`` tokens (so a
100k-token prompt of 64-token blocks is 1,563 pages, whatever the page size:
sizes are in pages, hit rates in pages). A request's page hashes are its
full blocks (``input_length // block``), chained: hash ``i`` is a digest of
hash ``i - 1`` and id ``i``, seeded by the session for ``claude-code`` (its
ids are comparable only within one session) and by nothing for ``mooncake``
(its ids are global). The prompt is ``ceil(input_length * page_size /
block)`` tokens (its partial last block unique to the request), the answer
``output_length`` tokens scaled the same way.

Arrivals: ``mooncake``: ``timestamp * time_scale`` seconds. ``claude-code``:
session ``k`` (in file order) starts at ``k * session_gap_s``, and each of
its requests at ``start + t * time_scale`` (a sub-agent's at its parent's
``t`` plus its own); ``think_time`` is the recorded client or tool gap
before a request, what retention and prefetch have to bridge, and is kept in
``extra``. ``limit`` keeps the first requests (mooncake) or sessions
(claude-code). Records come out sorted by arrival. A malformed line raises
``TraceError`` naming the line and the key.
"""

from __future__ import annotations

import gzip
import hashlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hicache.integration.bench.trace import (
    TraceError,
    TraceRecord,
    json_object,
    need,
    read_trace,
)

FORMATS = ("hicache", "mooncake", "claude-code")
MOONCAKE_BLOCK = 512


def load_trace(path: str | Path, fmt: str = "hicache", *, page_size: int = 32,
               limit: int | None = None, time_scale: float = 1.0,
               session_gap_s: float = 60.0) -> list[TraceRecord]:
    """The records of ``path`` read as ``fmt`` (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed values {', '.join(FORMATS)}")
    if page_size <= 0 or time_scale < 0 or session_gap_s < 0:
        raise ValueError("page_size must be positive, time_scale and session_gap_s >= 0")
    if fmt == "hicache":
        records = read_trace(path)
        return records[:limit] if limit is not None else records
    if fmt == "mooncake":
        return _mooncake(path, page_size, limit, time_scale)
    return _claude_code(path, page_size, limit, time_scale, session_gap_s)


def numbered_lines(path: str | Path) -> Iterator[tuple[str, str]]:
    """The non-empty lines of a trace file (``.gz`` read gzipped), each with where it
    is (``name:line``) for error messages."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield f"{p.name}:{n}", line


def _chain(seed: str, ids: Sequence[object]) -> tuple[str, ...]:
    """Prefix-chained page hashes of block ids."""
    out, prev = [], seed.encode()
    for block in ids:
        prev = hashlib.blake2b(prev + b"/" + str(block).encode(), digest_size=12).digest()
        out.append(prev.hex())
    return tuple(out)


def _record(rid: str, arrival: float, ids: Sequence[object], seed: str, input_tokens: int,
            output_tokens: int, block: int, page_size: int, extra: dict[str, Any]) -> TraceRecord:
    full = min(len(ids), input_tokens // block)
    scale = page_size / block
    return TraceRecord(
        id=rid, arrival=arrival, output_tokens=math.ceil(output_tokens * scale),
        page_hashes=_chain(seed, ids[:full]), page_size=page_size,
        prompt_tokens=max(math.ceil(input_tokens * scale), full * page_size, 1), extra=extra)


def _mooncake(path: str | Path, page_size: int, limit: int | None,
              time_scale: float) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    for where, line in numbered_lines(path):
        if limit is not None and len(out) >= limit:
            break
        d = json_object(line, where)
        ids = need(d, "hash_ids", list, where)
        out.append(_record(
            f"m{len(out)}", need(d, "timestamp", (int, float), where) / 1000 * time_scale,
            ids, "", need(d, "input_length", int, where),
            need(d, "output_length", int, where), MOONCAKE_BLOCK, page_size, {}))
    return sorted(out, key=lambda r: r.arrival)


def _claude_code(path: str | Path, page_size: int, limit: int | None, time_scale: float,
                 session_gap_s: float) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    for k, (where, line) in enumerate(numbered_lines(path)):
        if limit is not None and k >= limit:
            break
        d = json_object(line, where)
        sid = str(need(d, "id", str, where))
        block = need(d, "block_size", int, where)
        requests = need(d, "requests", list, where)
        out += _session(requests, sid, k * session_gap_s, block, page_size, time_scale,
                        where)
    return sorted(out, key=lambda r: (r.arrival, r.id))


def _session(requests: list[Any], sid: str, start: float, block: int, page_size: int,
             time_scale: float, where: str) -> list[TraceRecord]:
    """One session's (or sub-agent's) requests, its hash ids decoded along the list."""
    out: list[TraceRecord] = []
    prev: list[object] = []
    for i, r in enumerate(requests):
        at = f"{where} {sid} request {i}"
        if not isinstance(r, dict):
            raise TraceError(f"{at}: expected a JSON object")
        t = start + need(r, "t", (int, float), at) * time_scale
        if r.get("type") == "subagent":
            agent = f"{sid}/{r.get('agent_id', i)}"
            out += _session(need(r, "requests", list, at), agent, t, block, page_size,
                            time_scale, where)
            continue
        keep, add = need(r, "keep", int, at), need(r, "add", list, at)
        prev = prev[:keep] + add
        out.append(_record(
            f"{sid}#{i}", t, prev, sid, need(r, "in", int, at), need(r, "out", int, at),
            block, page_size, {"session": sid,
                               "think_time": float(r.get("think_time") or 0.0)}))
    return out
