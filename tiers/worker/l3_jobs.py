"""What the worker's L3 I/O thread (l3_io.py) is handed and hands back.

Contract: ``FetchResult`` (a finished fetch: the L3 pages that arrived, a
prefix, and the blocks vLLM must recompute), ``StorageIOStats`` (the
thread's counters), and the queue entries ``Backup``, ``Retention`` and
``Job`` (a submitted fetch with its cancel flag and result). Plain data.

``split_backup(batch, limit)``: the first ``limit`` pages of a queued backup
and the rest, never parting the pages of one span object (the head takes
every page of a span it starts), so each part still stores whole spans.
``whole_spans(pages)``: the pages of every span all of whose pages are there,
each span in order (what is written as span objects).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.tiers.index.plans import RequestFetch
from hicache.tiers.index.spans import SpanRef


@dataclass
class FetchResult:
    req_id: str
    fetched_pages: int
    error_block_ids: set[int]
    seconds: float
    # A prefetch at arrival: L3 -> L2 only, nothing for vLLM.
    prefetch: bool = False


@dataclass
class StorageIOStats:
    fetches: int = 0
    fetched_pages: int = 0
    # Pages a read did not return, and pages never read (deadline passed, cancelled).
    fetch_failed_pages: int = 0
    fetch_late_pages: int = 0
    fetch_deadline_misses: int = 0
    backup_pages: int = 0
    backup_failed_pages: int = 0
    backups_dropped: int = 0
    deleted_pages: int = 0
    retained_pages: int = 0


# A queued backup: (page key, slot, L3 key, its span object or None).
Backup = tuple[bytes, int, bytes, SpanRef | None]


def split_backup(batch: list[Backup], limit: int) -> tuple[list[Backup], list[Backup]]:
    """(head, rest): see the module docstring."""
    if len(batch) <= limit:
        return batch, []
    head: list[Backup] = []
    rest: list[Backup] = []
    head_spans: set[bytes] = set()
    for page in batch:
        span = page[3]
        if span is not None and span.key in head_spans:
            head.append(page)
        elif len(head) < limit:
            head.append(page)
            if span is not None:
                head_spans.add(span.key)
        else:
            rest.append(page)
    return head, rest


def whole_spans(pages: list[Backup]) -> list[Backup]:
    """See the module docstring."""
    by_key: dict[bytes, dict[int, Backup]] = {}
    for b in pages:
        if b[3] is not None:
            by_key.setdefault(b[3].key, {})[b[3].index] = b
    out: list[Backup] = []
    for members in by_key.values():
        count = next(iter(members.values()))[3].count  # type: ignore[union-attr]
        if len(members) == count:
            out.extend(members[i] for i in range(count))
    return out


@dataclass(frozen=True)
class Retention:
    keys: list[bytes]
    until: float


@dataclass
class Job:
    fetch: RequestFetch
    submitted: float
    polls: int = 0
    cancel: bool = False
    result: FetchResult | None = None
    slots: set[int] = field(default_factory=set)
