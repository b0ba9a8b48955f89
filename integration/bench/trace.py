"""Request traces: what ``hicache bench run --trace`` records and ``hicache simulate`` replays.

A trace is JSONL, one request per line, in arrival order::

    {"id": "c3-t1", "arrival": 12.5, "finish": 13.9, "output_tokens": 32,
     "prompt": [17, 993, ...], "output": [5, 88, ...]}  # token ids, or:
    {"id": "r7", "arrival": 0.4, "output_tokens": 16,
     "page_size": 32, "page_hashes": ["9f1c...", ...]}  # one hash per full page

``arrival`` / ``finish`` are seconds since the run began (``finish`` is
optional: without it the simulator estimates how long a request holds its
L1 blocks; so is ``output``, the generated ids). ``page_hashes`` must form a prefix chain (hash i covers pages
0..i), which is what any prefix-caching engine logs; with them the trace
carries no tokens, so production traces can be shared. Optional
``cache_salt`` separates tenants like vLLM's ``cache_salt``. Optional
``hicache`` holds the request's HiCache hints (``kv_transfer_params.hicache``:
``retain_s``, ``priority``, ...), and ``prefetch_at`` / ``prefetch_tokens`` say
that the client asked the admin's ``POST /prefetch`` for the first
``prefetch_tokens`` tokens of this prompt (its history) at that time, during
the pause before it; the simulator acts on both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the line and the key."""


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace."""

    id: str
    # Seconds since the start of the run when the request was sent.
    arrival: float
    # Tokens generated for it (they occupy L1 blocks and, once full, pages).
    output_tokens: int
    # Prompt token ids; None when the trace carries page hashes instead.
    prompt: tuple[int, ...] | None = None
    # Prefix-chained hash of every full prompt page, and the page size they cover.
    page_hashes: tuple[str, ...] | None = None
    page_size: int | None = None
    # Prompt length in tokens (len(prompt), or given next to page_hashes).
    prompt_tokens: int = 0
    # Seconds since the start of the run when the last token arrived, if known.
    finish: float | None = None
    cache_salt: str | None = None
    # Generated token ids, if recorded: with them the simulator keys the pages
    # that decoding fills (a returning turn's history includes them).
    output: tuple[int, ...] | None = None
    # The request's kv_transfer_params["hicache"] (hints.py), if it had any.
    hints: dict | None = None
    # When the client asked POST /prefetch for this prompt's first prefetch_tokens.
    prefetch_at: float | None = None
    prefetch_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> str:
        d: dict = {"id": self.id, "arrival": round(self.arrival, 6),
                   "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens}
        if self.finish is not None:
            d["finish"] = round(self.finish, 6)
        if self.cache_salt is not None:
            d["cache_salt"] = self.cache_salt
        if self.output is not None:
            d["output"] = list(self.output)
        if self.hints:
            d["hicache"] = dict(self.hints)
        if self.prefetch_at is not None:
            d["prefetch_at"] = round(self.prefetch_at, 6)
            d["prefetch_tokens"] = self.prefetch_tokens
        if self.prompt is not None:
            d["prompt"] = list(self.prompt)
        else:
            d["page_size"] = self.page_size
            d["page_hashes"] = list(self.page_hashes or ())
        d.update(self.extra)
        return json.dumps(d, separators=(",", ":"))


_KNOWN = {"id", "arrival", "finish", "output_tokens", "prompt_tokens", "prompt",
          "page_hashes", "page_size", "cache_salt", "output", "hicache", "prefetch_at",
          "prefetch_tokens"}


def json_object(line: str, where: str) -> dict[str, Any]:
    """One trace line's JSON object; ``TraceError`` naming ``where`` otherwise."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected a JSON object")
    return d


def need(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``d[key]``, a ``kind`` (never a bool); ``TraceError`` naming ``where`` and the key."""
    if key not in d:
        raise TraceError(f"{where}: missing key {key!r}")
    if not isinstance(d[key], kind) or isinstance(d[key], bool):
        raise TraceError(f"{where}: key {key!r} must be {getattr(kind, '__name__', kind)}")
    return d[key]


def parse_record(line: str, where: str = "trace") -> TraceRecord:
    d = json_object(line, where)

    arrival = float(need(d, "arrival", (int, float), where))
    output = cast(int, need(d, "output_tokens", int, where))
    if output < 0 or arrival < 0:
        raise TraceError(f"{where}: 'arrival' and 'output_tokens' must be >= 0")
    finish = d.get("finish")
    if finish is not None and (not isinstance(finish, (int, float)) or finish < arrival):
        raise TraceError(f"{where}: key 'finish' must be a number >= 'arrival'")
    if ("prompt" in d) == ("page_hashes" in d):
        raise TraceError(f"{where}: give exactly one of 'prompt' (token ids) or 'page_hashes'")
    prompt: tuple[int, ...] | None = None
    hashes: tuple[str, ...] | None = None
    page_size: int | None = None
    if "prompt" in d:
        raw = cast("list[object]", need(d, "prompt", list, where))
        tokens = [t for t in raw if isinstance(t, int) and not isinstance(t, bool) and t >= 0]
        if len(tokens) != len(raw):
            raise TraceError(f"{where}: key 'prompt' must be a list of token ids (ints >= 0)")
        prompt = tuple(tokens)
        prompt_tokens = len(prompt)
    else:
        raw = cast("list[object]", need(d, "page_hashes", list, where))
        names = [h for h in raw if isinstance(h, str) and h]
        if len(names) != len(raw):
            raise TraceError(f"{where}: key 'page_hashes' must be a list of non-empty strings")
        hashes = tuple(names)
        page_size = cast(int, need(d, "page_size", int, where))
        if page_size <= 0:
            raise TraceError(f"{where}: key 'page_size' must be > 0")
        prompt_tokens = int(d.get("prompt_tokens", len(hashes) * page_size))
        if prompt_tokens < len(hashes) * page_size:
            raise TraceError(f"{where}: 'prompt_tokens' is shorter than its page_hashes cover")
    generated = d.get("output")
    if generated is not None and not (
        isinstance(generated, list) and all(isinstance(t, int) and t >= 0 for t in generated)
    ):
        raise TraceError(f"{where}: key 'output' must be a list of token ids (ints >= 0)")
    salt = d.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"{where}: key 'cache_salt' must be a string")
    hints = d.get("hicache")
    if hints is not None and not isinstance(hints, dict):
        raise TraceError(f"{where}: key 'hicache' must be an object (the request's "
                         "kv_transfer_params.hicache)")
    prefetch_at = d.get("prefetch_at")
    if prefetch_at is not None and (not isinstance(prefetch_at, (int, float))
                                    or isinstance(prefetch_at, bool)
                                    or not 0 <= prefetch_at <= arrival):
        raise TraceError(f"{where}: key 'prefetch_at' must be a number in [0, 'arrival']")
    prefetch_tokens = d.get("prefetch_tokens", 0)
    if (not isinstance(prefetch_tokens, int) or isinstance(prefetch_tokens, bool)
            or not 0 <= prefetch_tokens <= prompt_tokens):
        raise TraceError(f"{where}: key 'prefetch_tokens' must be an integer in "
                         "[0, prompt_tokens]")
    return TraceRecord(
        id=str(d.get("id", where)), arrival=arrival, output_tokens=output, prompt=prompt,
        page_hashes=hashes, page_size=page_size, prompt_tokens=prompt_tokens,
        finish=None if finish is None else float(finish), cache_salt=salt,
        output=None if generated is None else tuple(generated),
        hints=hints, prefetch_at=None if prefetch_at is None else float(prefetch_at),
        prefetch_tokens=prefetch_tokens,
        extra={k: v for k, v in d.items() if k not in _KNOWN},
    )


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a JSONL trace, sorted by arrival (blank lines are skipped)."""
    records = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                records.append(parse_record(line, f"{path}:{n}"))
    if not records:
        raise TraceError(f"{path}: the trace holds no requests")
    return sorted(records, key=lambda r: r.arrival)


def iter_lines(records: Iterable[TraceRecord]) -> Iterator[str]:
    for r in records:
        yield r.to_json() + "\n"


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.writelines(iter_lines(records))
    return path
