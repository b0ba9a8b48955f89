"""Counters of the scheduler half: what the admin ``/stats`` and the metrics report.

Contract: one ``SchedulerStats`` per scheduler, shared by its jobs (lookup,
L2 placement, stores, fetches, flush), each adding to its own fields under
the scheduler lock. Pages are L2 pages; counters only grow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SchedulerStats:
    """Counters of the scheduler half (pages are L2 pages)."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_pages: int = 0
    stored_pages: int = 0
    evicted_pages: int = 0
    store_skipped_pages: int = 0
    # Pages stored without a sliding window's layers (vLLM's null block there):
    # inner pages of a longer hit only (tiers/index/kv_groups.py).
    stored_partial_pages: int = 0
    bad_slots_reported: int = 0
    l3_lookups: int = 0
    l3_hit_pages: int = 0
    l3_fetched_pages: int = 0
    l3_failed_pages: int = 0
    l3_lookup_errors: int = 0
    # Lookups answered "not known yet" (a background probe still running).
    l3_lookups_pending: int = 0
    # Lookups the tree answered alone (every page known in L3: no store call).
    l3_lookups_from_tree: int = 0
    # Prefetches at arrival (tiers/controller/prefetches.py): started, their
    # pages, lookups told to wait for one, requests that stopped waiting
    # (timeout / best_effort), hits not prefetched for lack of room, prefetches
    # dropped because their request ended first.
    prefetches: int = 0
    prefetch_pages: int = 0
    prefetch_waits: int = 0
    prefetch_late: int = 0
    prefetch_skipped: int = 0
    prefetch_cancelled: int = 0
    # Per tier, in pages, counted once per admitted request: a page is a hit
    # in the first tier that held it (L1 = vLLM's own prefix cache) and a miss
    # in every tier asked before.
    l1_hit_pages: int = 0
    l2_hit_pages: int = 0
    l2_miss_pages: int = 0
    l3_miss_pages: int = 0
    flushed_l2_pages: int = 0
    flushed_l3_pages: int = 0
    # Pages L2 held and L3 lacked that the catch-up queued for backup (catch_up.py).
    l3_catch_up_pages: int = 0
    flush_skipped_locked: int = 0
    max_used_slots: int = 0
    # External tokens granted to each live request (dropped when it finishes).
    per_request_hits: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("per_request_hits")
        return d
