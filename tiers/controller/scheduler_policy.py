"""How the scheduler half behaves, as one record: ``SchedulerPolicy``.

Contract: a frozen record of the scheduler's behaviour, apart from the engine's
shape and the objects it is handed (tiers/controller/scheduler.py
``HiCacheScheduler(..., policy=...)``): the write policy and its threshold, L3
admission, the prefetch policy and its settings (``prefetch``: the storage
settings of tiers/config.py ``prefetch_settings``, copied; ``prefetch_threshold``
may change live on the scheduler), whether L3 lookups run on probe threads and
arrivals are prefetched, KV events, stores that finish across steps, the share
of L2 pins may hold, and how many L2 pages L3 lacks may be queued for backup at
once. The defaults are a test's: every lookup inline, no background work.
``for_engine(config, ...)`` is a serving engine's, read from its config. Plain
data: no torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hicache.tiers.controller.catch_up import DEFAULT_MAX_IN_FLIGHT
from hicache.tiers.controller.pins import MAX_SHARE as PIN_MAX_SHARE

if TYPE_CHECKING:
    from hicache.tiers.config import HiCacheConfig


@dataclass(frozen=True)
class SchedulerPolicy:
    """See the module docstring; each field as the ``hicache_*`` key that sets it."""

    write_policy: str = "write_through"
    write_threshold: int = 2
    l3_admission: str = "all"
    prefetch_policy: str = "timeout"
    prefetch: Mapping[str, float] = field(default_factory=dict)
    # L3 lookups of stores that allow it on probe threads (fetches.py); False asks
    # every store inline
    background_lookups: bool = False
    # an arriving request's L3 pages prefetched into L2 while it waits (prefetches.py)
    prefetch_at_arrival: bool = False
    # record L2's KV events (events.py)
    kv_events: bool = False
    # the workers finish stores across steps (stores.py)
    async_stores: bool = False
    # share of L2 that pins (retain_s, admin pins) may hold (pins.py)
    retain_max_share: float = PIN_MAX_SHARE
    # L2 pages L3 lacks that may be queued for backup at once (catch_up.py; 0 = none)
    catch_up_pages: int = DEFAULT_MAX_IN_FLIGHT

    @classmethod
    def for_engine(cls, config: HiCacheConfig, *, kv_events: bool,
                   async_stores: bool) -> SchedulerPolicy:
        """A serving engine's: its settings, L3 lookups on probe threads."""
        return cls(
            write_policy=config.hicache_write_policy,
            write_threshold=config.hicache_write_through_threshold,
            l3_admission=config.hicache_l3_admission,
            prefetch_policy=config.hicache_storage_prefetch_policy,
            prefetch=config.prefetch_settings(), background_lookups=True,
            prefetch_at_arrival=config.hicache_prefetch_at_arrival, kv_events=kv_events,
            async_stores=async_stores, retain_max_share=config.hicache_retain_max_share,
            catch_up_pages=config.hicache_l3_catch_up_pages)
