"""Scheduler half of the connector: the placement decisions vLLM's scheduler asks for.

``HiCacheScheduler`` is the facade the connector (``connector/connector.py``),
the admin view (``admin.py``) and the simulator call; each job lives in a
module of its own, which states its contract:

  requests.py    per-request state: page keys from block hashes, tier accounting
  l2_manager.py  the HiRadixTree and L2 slots: allocation, eviction, bad slots,
                 publishing stored pages
  stores.py      the write path (write policy): which pages are copied to L2
  loads.py       the read path: which blocks of a hit come from which L2 slot
  fetches.py     L3: the lookup past the L2 match and the fetches in flight
  prefetches.py  L3 -> L2 prefetch of requests waiting in vLLM's queue
  sessions.py    requests grouped by session_id: carried hints, close (and forget)
  catch_up.py    L2 pages L3 lacks (after an L3 flush, attach, failed backup),
                 backed up in the background
  events.py      L2's and L3's KV events (pages stored / removed) for vLLM's publisher
  flush.py       the admin's flush and prefix keys
  policies.py    write / prefetch / eviction policies, chosen by name

Contract with vLLM's scheduler (see DESIGN.md "Flow of one request"):
- ``get_num_new_matched_tokens`` claims only full pages that are in L2 now,
  beyond vLLM's own prefix hit, leaving at least one prompt token to compute
  (L2 loads are synchronous), plus the pages after them that L3 holds
  (asynchronous: ``load_async`` is True). With windowed KV-cache groups the
  hit ends where every group can supply its part (tiers/index/kv_groups.py).
  With several groups (vLLM's hybrid manager) every hit is asynchronous:
  vLLM can only take a failed load back per request there
  (``failed_recving``), which it offers for asynchronous loads only.
- ``update_state_after_alloc`` locks the matched tree prefix and queues the
  load (released once the plan is emitted) or, for an L3 hit, the fetch
  (released when every rank has reported it).
- ``build_connector_meta`` returns the step's plain ``StepPlan``: loads,
  fetches, and the stores the write policy asks for (pages published in the
  tree at once; see tiers/index/plans.py for the ordering that makes this safe).
- ``request_finished`` stores what is left of a finished request and asks
  vLLM to keep its blocks until the worker reports the store done.
- ``on_worker_report`` takes the workers' merged ``WorkerReport``: bad slots,
  per-rank fetch results and L3 backups (a page enters the tree's L3 index
  once every writing rank stored it).

Nothing here imports vLLM or torch. Every call runs under ``lock``, which the
connector holds around vLLM's calls and the admin endpoint around its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hicache.tiers.controller.catch_up import L3CatchUp
from hicache.tiers.controller.events import PageEvent, PageEvents
from hicache.tiers.controller.fetches import L3Fetches, L3Store, can
from hicache.tiers.controller.flush import Flusher, PrefixHasher, StandInPrefixHasher
from hicache.tiers.controller.hints import HINTS_KEY
from hicache.tiers.controller.l2_manager import L2Manager
from hicache.tiers.controller.loads import StepLoads, hit_pages
from hicache.tiers.controller.pins import PinRefused, Pins
from hicache.tiers.controller.policies import (
    EvictionPolicy,
    make_eviction_policy,
    make_l3_admission,
    make_prefetch_policy,
    make_write_policy,
)
from hicache.tiers.controller.prefetches import ArrivalPrefetches
from hicache.tiers.controller.probes import L3Probes
from hicache.tiers.controller.requests import (
    CachedTokens,
    RequestState,
    RequestTable,
    SchedulerRequest,
    request_hints,
)
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.controller.sessions import CLOSED_PRIORITY, Sessions
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.controller.stores import StorePlanner
from hicache.tiers.index.commands import (
    L3_CHANGES,
    DeletePages,
    L3Removal,
    RetainPages,
    StorageCommand,
)
from hicache.tiers.index.kv_groups import GroupBlockIds, KVGroups, StateHandoff
from hicache.tiers.index.page_keys import KeyNamespace, PageKey
from hicache.tiers.index.plans import RequestLoad, StepPlan, WorkerReport, prefetch_id
from hicache.tiers.index.spans import SpanLayout, pages_per_object
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.metrics import WorkerGauge as G

if TYPE_CHECKING:
    from hicache.tiers.config import HiCacheConfig
    from hicache.tiers.engine_shape import EngineShape


class NoRoom(RuntimeError):
    """L2 cannot take the pages asked for now."""


__all__ = ["HiCacheScheduler", "NoRoom", "PrefixHasher", "SchedulerRequest", "SchedulerStats"]

logger = logging.getLogger(__name__)

# Pages backed up by some ranks but not yet all, remembered (oldest forgotten).
MAX_BACKUP_VOTES = 1 << 16
# L3 changes remembered for reports that predate them (older reports count for nothing).
MAX_L3_CHANGE_LOG = 64


DEFAULT_POLICY = SchedulerPolicy()


class HiCacheScheduler:
    """Placement logic: which pages hit L2 or L3, which slots they use, what to store."""

    def __init__(
        self,
        *,
        geometry: PoolGeometry,
        namespace: KeyNamespace,
        page_size: int,
        block_size: int,
        block_ids_of: Callable[[str], GroupBlockIds],
        policy: SchedulerPolicy = DEFAULT_POLICY,
        storage: L3Store | None = None,
        tp_size: int = 1,
        hash_block_size: int | None = None,
        prefix_hasher: PrefixHasher | None = None,
        groups: KVGroups | None = None,
        l3_writers: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        """The engine's shape (geometry, namespace, page and block sizes, KV groups,
        TP size, the hash block), how it behaves (``policy``:
        tiers/controller/scheduler_policy.py) and what it is handed: vLLM's block ids
        per request, its L3 view, the prefix hasher, a clock (``clock`` times the
        timeout policy's wait, pins and sessions). ``l3_writers``: ranks that back
        pages up to L3 (default ``tp_size``; 1 for MLA, whose ranks share one shard):
        a page is in L3 once all reported it. ``eviction``: what makes room in L2
        (default the configured LRU; the simulator's oracle replaces it)."""
        self.policy = policy
        self.geometry = geometry
        self.groups = groups or KVGroups.single(geometry.num_layers)
        self.namespace = namespace
        self.page_size = page_size
        self.block_size = block_size
        self.blocks_per_page = page_size // block_size
        # Pages are keyed from the engine's block hashes (one per hash block).
        self.hash_block_size = hash_block_size or block_size
        if page_size % self.hash_block_size:
            raise ValueError(f"page_size {page_size} is not a multiple of the engine's "
                             f"block-hash size {self.hash_block_size}")
        self.hashes_per_page = page_size // self.hash_block_size
        self.write_policy = policy.write_policy
        self.write_threshold = policy.write_threshold
        self.prefetch_policy = policy.prefetch_policy
        self.tp_size = tp_size
        self.l3_writers = l3_writers or tp_size
        # L3 key -> the ranks that reported its backup, until every writer has.
        self._backup_votes: OrderedDict[bytes, set[int]] = OrderedDict()
        # Held by the connector around vLLM's calls and by the admin endpoint.
        self.lock = threading.RLock()

        self.stats = SchedulerStats()
        self.events = PageEvents(page_size=page_size, hashes_per_page=self.hashes_per_page,
                                 enabled=policy.kv_events)
        self.l2 = L2Manager(geometry.num_slots, self.blocks_per_page, self.stats,
                            eviction or make_eviction_policy(), self.groups, self.events)
        # The jobs share these; they are never rebound.
        self.tree = self.l2.tree
        self.slots = self.l2.slots
        seed = namespace.seed()
        self.sessions = Sessions(clock=clock)
        self.requests = RequestTable(seed, self.hashes_per_page, self.stats,
                                     hints_for=self.sessions.hints_for)
        self.loads = StepLoads(self.tree)
        self.stores = StorePlanner(
            self.l2, make_write_policy(policy.write_policy, threshold=policy.write_threshold,
                                       l2_pages=geometry.num_slots),
            page_size=page_size, block_ids_of=block_ids_of,
            async_stores=policy.async_stores, tp_size=tp_size,
            l3_admission=make_l3_admission(policy.l3_admission,
                                           l2_pages=geometry.num_slots))
        self._seq = 0  # StepPlan.seq of the last plan
        settings = dict(policy.prefetch)
        self.pins = Pins(self.tree, geometry.num_slots, max_share=policy.retain_max_share,
                         clock=clock)
        self.fetches = L3Fetches(
            self.l2, self.stats, storage=storage,
            policy=make_prefetch_policy(policy.prefetch_policy, settings), settings=settings,
            page_size=page_size, tp_size=tp_size,
            probes=L3Probes() if policy.background_lookups else None, yielding=self.pins)
        # Pages per L3 object where the store keeps spans (tiers/index/spans.py); the
        # ``object_mib`` storage setting, fixed for the scheduler's life.
        self._span_pages = 1 if self.groups.has_state else pages_per_object(
            float(settings.get("object_mib", 0)), geometry.page_bytes)
        self.storage = storage
        self.prefetches = ArrivalPrefetches(
            self.fetches, self.requests, self.stats, page_size=page_size,
            capacity_pages=geometry.num_slots, clock=clock)
        self.prefetch_at_arrival = policy.prefetch_at_arrival
        self.catch_up = L3CatchUp(self.l2, self.stores.l3_admission, self.stats,
                                  max_in_flight=policy.catch_up_pages, clock=clock)
        # rank -> pages waiting in its L3 backup queue, as it last reported.
        self._backup_queues: dict[int, float] = {}
        # Commands for every worker (retention, cancelled fetches, the admin's L3
        # changes), with the next plan (tiers/index/commands.py).
        self._commands: list[StorageCommand] = []
        # L3 changes (flush, forget, attach, detach) the tree has seen, and those
        # queued for the workers: a rank's backup report counts only once it has
        # applied every one (WorkerReport.l3_changes).
        self._l3_changes = 0
        self._l3_changes_queued = 0
        # The latest L3 changes, the last one last: the L3 keys each removed (None:
        # everything: a flush of all L3, an attach, a detach). A report that predates
        # some keeps the keys none of them removed.
        self._l3_change_log: deque[frozenset[bytes] | None] = deque(maxlen=MAX_L3_CHANGE_LOG)
        # Finished requests' retain_s outcome (pages pinned, or why not), for the
        # connector to put in their responses (take_retained).
        self._retained: dict[str, int | str] = {}
        # Books a finished request's return_in_s prefetch and names it (returns.py,
        # set by the admin view, which starts it when due); the ids for responses.
        self.returning: Callable[[str, Sequence[PageKey], float], str] | None = None
        self._booked: dict[str, str] = {}
        self.flusher = Flusher(
            self.l2, self.requests, self.stats, seed=seed, page_size=page_size,
            hashes_per_page=self.hashes_per_page,
            prefix_hasher=prefix_hasher or StandInPrefixHasher(self.hash_block_size))

    @classmethod
    def for_engine(cls, shape: EngineShape, config: HiCacheConfig, *,
                   storage: L3Store | None, block_ids_of: Callable[[str], GroupBlockIds],
                   prefix_hasher: PrefixHasher, hash_block_size: int,
                   kv_events: bool) -> HiCacheScheduler:
        """The scheduler of a serving engine: its shape (tiers/engine_shape.py) and
        settings (tiers/config.py), L3 lookups on probe threads."""
        logger.info("HiCache scheduler: page_size=%d tokens, L2 = %d pages (%.2f GiB per "
                    "rank), KV-cache groups %s, config %s", shape.page_size,
                    shape.geometry.num_slots, shape.geometry.buffer_bytes / 2**30,
                    shape.groups.describe(), config.to_dict())
        if shape.groups.windowed and config.hicache_write_policy == "write_back":
            logger.warning(
                "HiCache: write_back on a sliding-window model stores the window's layers "
                "only for the pages still inside the window when a request finishes (vLLM "
                "has replaced the others with its null block): its history returns whole, "
                "branches from its head do not; use write_through to cache every point of "
                "a history")
        return cls(
            geometry=shape.geometry, namespace=shape.namespace, page_size=shape.page_size,
            block_size=shape.block_size, block_ids_of=block_ids_of,
            policy=SchedulerPolicy.for_engine(config, kv_events=kv_events,
                                              async_stores=shape.async_stores),
            storage=storage, tp_size=shape.tp_size, hash_block_size=hash_block_size,
            prefix_hasher=prefix_hasher, groups=shape.groups,
            l3_writers=1 if shape.is_mla else shape.tp_size,
            eviction=make_eviction_policy(
                config.hicache_eviction_policy,
                tail_pages=max(1, config.hicache_tlru_tail_tokens // shape.page_size)))

    def close(self) -> None:
        """Stop the L3 probe threads and close the scheduler's L3 view."""
        if self.fetches.probes is not None:
            self.fetches.probes.close()
        if self.storage is not None:
            self.storage.close()

    # ---- what the admin endpoint and tests reach ---------------------------------

    @property
    def storage(self) -> L3Store | None:
        """The scheduler's L3 view (None: no L3); the admin attaches and detaches it."""
        return self.fetches.storage

    @storage.setter
    def storage(self, storage: L3Store | None) -> None:
        self.fetches.storage = storage
        spans = can(storage, "spans")
        self.l2.spans = SpanLayout(self._span_pages if spans else 1)

    @property
    def prefetch(self) -> dict[str, float]:
        """The hicache storage settings; ``prefetch_threshold`` may change live."""
        return self.fetches.settings

    # ---- lookup -------------------------------------------------------------------

    def on_new_request(self, request: SchedulerRequest) -> None:
        """vLLM queued a new request: prefetch its L3 pages into L2 (prefetches.py)."""
        if self.prefetch_at_arrival and request_hints(request).reads_l3:
            self.prefetches.on_arrival(request)

    def get_num_new_matched_tokens(
        self, request: SchedulerRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens HiCache can provide beyond vLLM's own hit, whether asynchronously);
        (None, False) while the L3 lookup runs in the background (fetches.py)."""
        gate = self.prefetches.gate(request)
        if gate == "wait":
            return None, False  # its prefetch runs: vLLM asks again next step
        state = self.requests.state_of(request)
        state.local_tokens_seen = num_computed_tokens
        hints = state.hints
        if not hints.loads:  # the client asked for no HiCache loads
            state.pending_match, state.pending_l3_pages, state.lookup = None, 0, None
            return 0, False
        # At least one token must be left for the forward pass to produce logits.
        max_pages = (request.num_tokens - 1) // self.page_size
        if hints.max_load_tokens is not None:
            max_pages = min(max_pages,
                            (num_computed_tokens + hints.max_load_tokens) // self.page_size)
        if max_pages * self.page_size <= num_computed_tokens:
            # vLLM's own prefix cache holds all a hit could cover: nothing to look up,
            # and no L3 answer to wait for (admission as without HiCache).
            self.stats.lookups += 1
            state.pending_match, state.pending_l3_pages = None, 0
            state.lookup = (max_pages, num_computed_tokens // self.page_size, 0, 0)
            return 0, False
        keys = state.page_keys()
        match = self.tree.match_prefix(keys[:max_pages])
        self.stats.lookups += 1
        if self.storage is not None and match.num_pages:
            # A later request reached these pages in L2: back them up now if the
            # L3 admission rule waited for that (policies.py ``reused``).
            self.l2.back_up([(keys[i], match.host_slots[i]) for i in
                             self.stores.l3_admission.reused(keys[:match.num_pages])])
        l3_pages = 0
        if (gate == "open" and hints.reads_l3
                and request.request_id not in self.fetches.came_short):
            found = self.fetches.lookup(keys, match.num_pages, max_pages, request.request_id,
                                        known=match.l3_pages, source=request)
            if found is None:
                return None, False  # the L3 lookup runs in the background: vLLM asks again
            l3_pages = found
        if self.groups.windowed:
            masks = [self.l2.missing_of(slot) for slot in match.host_slots]
            if l3_pages:
                # L3 pages are complete; with state groups, bodies but the last.
                masks += [self.groups.state_mask] * (l3_pages - 1) + [0]
            usable = self.groups.usable_pages(masks, num_computed_tokens, self.page_size)
            if usable < match.num_pages:
                match, l3_pages = self.tree.match_prefix(keys[:usable]), 0
            l3_pages = min(l3_pages, usable - match.num_pages)
        hit_tokens = (match.num_pages + l3_pages) * self.page_size
        # Pages the request's prefetch brought count as L3 hits (prefetches.py).
        prefetched = self.prefetches.prefetched_pages(request.request_id, match.num_pages)
        state.prefetched_tokens = prefetched * self.page_size
        state.lookup = (max_pages, num_computed_tokens // self.page_size,
                        match.num_pages - prefetched, l3_pages + prefetched)
        if hit_tokens <= num_computed_tokens or self.fetches.is_fetching(request.request_id):
            state.pending_match, state.pending_l3_pages = None, 0
            return 0, False
        state.pending_match = match
        state.pending_l3_pages = l3_pages
        state.local_tokens = num_computed_tokens
        return hit_tokens - num_computed_tokens, l3_pages > 0 or self.groups.hybrid

    def l3_tokens_of(self, req_id: str) -> int:
        """External tokens of the request's last admission that come from L3."""
        state = self.requests.get(req_id)
        return state.l3_tokens if state is not None else 0

    def update_state_after_alloc(
        self, request: SchedulerRequest, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """vLLM allocated the request's blocks (``block_ids``: per KV-cache group):
        plan the load (or fetch) of its hit."""
        try:
            self._plan_admission(request, block_ids, num_external_tokens)
        finally:
            # Its load (or fetch) now locks what it needs: release the prefetch's hold.
            self.prefetches.admitted(request.request_id)
        state = self.requests.get(request.request_id)
        if state is not None and state.cached_tokens is None:  # its first admission
            l3 = min(state.l3_tokens, num_external_tokens)
            state.cached_tokens = CachedTokens(state.local_tokens_seen,
                                               num_external_tokens - l3, l3)

    def hint_error_of(self, req_id: str) -> str | None:
        """Why the live request's cache hints were ignored (hints.py), or None."""
        state = self.requests.get(req_id)
        return state.hint_error if state is not None else None

    def cached_tokens_of(self, req_id: str) -> CachedTokens | None:
        """Prompt tokens each tier served the live request ``req_id`` at its first
        admission (None before it, or for a request the scheduler never saw)."""
        state = self.requests.get(req_id)
        return state.cached_tokens if state is not None else None

    def _plan_admission(self, request: SchedulerRequest, block_ids: GroupBlockIds,
                        num_external_tokens: int) -> None:
        state = self.requests.get(request.request_id)
        if self.fetches.probes is not None:
            self.fetches.probes.forget(request.request_id)  # admitted: its answer is used
        if state is None:
            return
        match, state.pending_match = state.pending_match, None
        l3_pages, state.pending_l3_pages = state.pending_l3_pages, 0
        self.requests.count_admission(state, num_external_tokens > 0, self.storage is not None)
        state.l3_tokens = 0
        if num_external_tokens == 0 or match is None:
            return
        req_id = request.request_id
        keys = state.chain.keys
        # vLLM asked for an async load exactly when L3 pages were offered (or
        # always, with several groups); it then waits for the request in
        # finished_recving, whatever happens here.
        is_async = l3_pages > 0 or self.groups.hybrid
        # The admin endpoint may have flushed pages (another thread) since the
        # lookup: match again. What is gone is reported as unloadable below and
        # recomputed; L3 pages no longer extend a resident prefix, so they go too.
        fresh = self.tree.match_prefix(keys[: match.num_pages])
        if fresh.num_pages < match.num_pages:
            logger.warning("HiCache: %d of %d L2 pages of request %s were flushed "
                           "before their load; recomputing them", match.num_pages -
                           fresh.num_pages, match.num_pages, req_id)
            l3_pages = 0
        match = fresh
        l3_slots = self.fetches.reserve(req_id, match.node, l3_pages) if is_async else []
        start = state.local_tokens
        pages, unloadable = hit_pages(keys, list(match.host_slots) + l3_slots, start,
                                      start + num_external_tokens, block_ids,
                                      self.page_size, self.block_size, self.groups)
        if unloadable:
            # Tokens vLLM allocated that no page can supply now (pages flushed
            # since the lookup): failed loads, so vLLM recomputes them.
            logger.warning(
                "HiCache: request %s got %d external tokens after a local hit of %d, but "
                "only %d tokens matched; recomputing the rest", req_id, num_external_tokens,
                start, (match.num_pages + len(l3_slots)) * self.page_size,
            )
        # Tokens of the hit that the request's prefetch brought from L3: the last
        # prefetched_tokens of the L2 match.
        end = match.num_pages * self.page_size
        state.l3_tokens = max(0, min(start + num_external_tokens, end)
                              - max(start, end - state.prefetched_tokens))
        if is_async:
            fetch = self.fetches.start(req_id, match, keys, l3_slots, pages, unloadable,
                                       source=request)
            state.l3_tokens += self.block_size * sum(
                len(p.block_ids) // len(self.groups) for p in fetch.l3_pages)
        else:
            self.loads.add(match.node, RequestLoad(req_id, tuple(pages), unloadable))
        state.stored_pages = max(state.stored_pages, match.num_pages)
        self.stats.hit_tokens += num_external_tokens
        self.stats.loaded_pages += len(pages)
        self.stats.per_request_hits[req_id] = num_external_tokens

    # ---- per-step plan ------------------------------------------------------------

    def build_connector_meta(self, num_scheduled_tokens: Mapping[str, int],
                             preempted: Iterable[str] = (),
                             handoffs: Mapping[str, StateHandoff] | None = None) -> StepPlan:
        """The step's plan; after it, the loads' pages may be evicted again.
        ``preempted``: requests vLLM preempted in this step (their blocks may be
        reused by its forward pass); ``handoffs``: the step's Mamba "align"
        boundary states (stores.py)."""
        if self.l2.drop_bad_slots():
            self.requests.forget_stored()
        self.pins.expire()  # before this plan evicts anything
        self.prefetches.advance()
        self._seq += 1
        flush = any(state is not None and self.stores.store_in_flight(state)
                    for state in map(self.requests.get, preempted))
        stores, release = self.stores.plan_step(self.requests, num_scheduled_tokens, self._seq,
                                              handoffs)
        backups = self.l2.take_backups()
        self.catch_up.note_planned(stores)
        self.catch_up.note_planned(backups)
        if self.storage is not None:  # L2 pages L3 lacks, while its I/O is idle
            self.l2.back_up(self.catch_up.plan(io_idle=not self.fetches.in_flight and not any(
                self._backup_queues.values()) and self._l3_changes == self._l3_changes_queued))
            backups += self.l2.take_backups()
        # Loads are taken (and their prefixes unlocked) after the stores are
        # planned: the eviction that makes room for a store must spare them.
        plan = StepPlan(loads=self.loads.take(), stores=stores, release_after_store=release,
                        fetches=self.fetches.take(), seq=self._seq, flush_stores=flush,
                        storage_commands=self._commands, backups=backups)
        self._commands = []
        self.l2.release_planned_stores()  # their copies are in this plan
        return plan

    def request_finished(self, request: SchedulerRequest, block_ids: GroupBlockIds) -> bool:
        """Plan the request's remaining stores (``block_ids``: per KV-cache group);
        True = keep its blocks until done."""
        self.prefetches.cancel(request.request_id)
        state = self.requests.pop(request.request_id)
        self.fetches.came_short.discard(request.request_id)
        if self.fetches.probes is not None:
            self.fetches.probes.forget(request.request_id)
        if state is None or not any(block_ids) or self.fetches.is_fetching(request.request_id):
            # A request finished (aborted) while its L3 fetch runs: vLLM keeps its
            # blocks until the worker reports the fetch; nothing to store.
            return False
        stored = self.stores.plan_finished(state, block_ids)
        # Its class for every page of it L2 or L3 holds, those it hit included.
        self.tree.raise_priority(state.page_keys(), state.hints.rank)
        if state.hints.retain_s:
            self._retain(state)
        if state.hints.session_id is not None:
            self.sessions.finished(state.hints.session_id, state.page_keys())
        if (state.hints.return_in_s is not None and self.returning is not None
                and self.storage is not None):
            self._booked[request.request_id] = self.returning(
                request.request_id, state.page_keys(), state.hints.return_in_s)
        if stored:
            return True
        if self.stores.store_in_flight(state):
            # Its last store may still read its blocks on some rank.
            self.stores.hold_blocks(request.request_id)
            return True
        return False

    def prefetch_prefix(self, keys: Sequence[PageKey], in_l3: int) -> int:
        """Start reading the pages of ``keys[:in_l3]`` (L3 holds them) that L2 lacks
        into L2, with the next plan (the admin's ``POST /prefetch``: a session due
        back after a tool call). Returns the pages planned (0: L2 has them already, or
        the same prefetch runs); raises ``NoRoom`` when L2 cannot take them now."""
        return self.plan_prefetch(keys, in_l3)[0]

    def plan_prefetch(self, keys: Sequence[PageKey], in_l3: int,
                      timeout_s: float | None = None) -> tuple[int, str]:
        """``prefetch_prefix``, with the read's id (the same for every prefetch of
        this prompt) and its ``timeout_s`` on the workers (None: none): (pages
        planned, fetch id)."""
        fetch_id = prefetch_id(f"admin:{keys[in_l3 - 1].hex()}") if in_l3 else ""
        match = self.tree.match_prefix(keys[:in_l3])
        pages = in_l3 - match.num_pages
        if pages <= 0 or fetch_id in self.fetches.in_flight:
            return 0, fetch_id
        # The prefix it extends must survive the eviction that makes room for it; the
        # fetch holds the lock until every rank has reported (fetches.py on_report).
        self.tree.lock(match.node)
        slots = self.l2.allocate(pages)
        if not slots:
            self.tree.unlock(match.node)
            raise NoRoom(f"L2 cannot take {pages} more pages now (locked or pinned)")
        self.fetches.start_prefetch(fetch_id, match, keys, slots, timeout_s)
        self.stats.prefetches += 1
        self.stats.prefetch_pages += pages
        return pages, fetch_id

    def close_session(self, session_id: str, forget: bool = False,
                      ) -> tuple[dict[str, int], L3Removal | None]:
        """Close a session (sessions.py): end its pins, then rank its own pages (those
        after what other cached prefixes share) below every open session's or, with
        ``forget``, remove them from L2 and plan their removal from L3 (flush.py).
        Returns (counts, the L3 removal or None); ``KeyError`` for an unknown id."""
        session = self.sessions.close(session_id)
        released = demoted = 0
        for path in session.paths:
            released += bool(self.pins.unpin(path))
            # Its own pages: after the deepest fork another cached prefix makes.
            own = self.tree.subtree_at(path, self.tree.shared_depth(path))
            if own is not None:
                released += self.pins.release_under([own])
                if not forget:  # here: a later path's lookup may split this subtree
                    demoted += self.tree.demote(own, CLOSED_PRIORITY)
        counts = {"released_pins": released}
        if not forget:
            counts["demoted_pages"] = demoted
            return counts, None
        doomed: list[PageKey] = []
        for path in session.paths:
            forgotten, l3_op = self.flusher.forget_keys(path, release=self.pins.release_under)
            for name, n in forgotten.items():
                counts[name] = counts.get(name, 0) + n
            if l3_op is not None:
                doomed.extend(l3_op.keys)
        session.paths = []
        if not doomed:
            return counts, None
        removal = DeletePages(tuple(dict.fromkeys(doomed)))
        self._l3_changing(removal)
        return counts, removal

    def queue_command(self, command: StorageCommand) -> None:
        """A command for every worker, with the next plan. An L3-changing one
        (``L3_CHANGES``) must follow the ``l3_changed``/``flush``/``forget``/
        ``close_session`` call whose tree change it stands for, once."""
        self._commands.append(command)
        if isinstance(command, L3_CHANGES):
            self._l3_changes_queued += 1

    def l3_change_dropped(self) -> None:
        """The L3 removal of the last ``flush``/``forget``/``close_session`` will not
        be queued (the store refused it): the workers' L3 did not change."""
        self._l3_changes -= 1
        self._l3_change_log.pop()

    def _l3_changing(self, removal: L3Removal | None) -> None:
        """The tree's L3 marks change before the workers' L3 does: from now on, the
        keys a rank reports backed up from before it applied the matching command
        count only if no later change removed them (tiers/index/commands.py).
        ``removal``: the pages removed (None or ``ClearStore``: everything; the
        catch-up then starts over, else it looks at those pages again)."""
        removed = (frozenset(removal.keys) if isinstance(removal, DeletePages) else None)
        self._l3_changes += 1
        self._l3_change_log.append(removed)
        if removed is None:
            self._backup_votes.clear()
            self.catch_up.reset()
            return
        for key in removed:
            self._backup_votes.pop(key, None)
        self.catch_up.forget(map(PageKey, removed))

    def _removed_since(self, applied: int) -> set[bytes] | None:
        """The L3 keys the changes after the ``applied``-th removed; None: everything
        (a change removed all, or more changes than remembered)."""
        log = self._l3_change_log
        behind = self._l3_changes - applied
        if behind > len(log):
            return None
        gone: set[bytes] = set()
        for removed in list(log)[len(log) - behind:]:
            if removed is None:
                return None
            gone |= removed
        return gone

    def _current(self, report: WorkerReport) -> dict[int, list[bytes]]:
        """The keys of ``report.l3_stored`` L3 still holds: each rank's, less those an
        L3 change it had not applied when it took them removed."""
        out: dict[int, list[bytes]] = {}
        for rank, keys in report.l3_stored.items():
            gone = self._removed_since(report.l3_changes.get(rank, 0))
            kept = [] if gone is None else [k for k in keys if k not in gone]
            if kept:
                out[rank] = kept
        return out

    def _retain(self, state: RequestState) -> None:
        """Pin what L2 holds of a finished request's pages for its ``retain_s``, and
        ask every worker's L3 to keep them as long (where the backend can)."""
        req_id = state.request.request_id
        keys, ttl_s = state.page_keys(), float(state.hints.retain_s or 0)
        if self.storage is not None:
            self.retain_in_l3(keys, ttl_s)
        try:
            self._retained[req_id] = self.pins.pin(keys, ttl_s)
        except PinRefused as exc:
            self._retained[req_id] = f"kv_transfer_params.hicache.retain_s not applied: {exc}"

    def retain_in_l3(self, keys: Sequence[PageKey], ttl_s: float) -> None:
        """Queue, for the next plan, the L3 retention of ``keys`` for ``ttl_s`` seconds
        (0: end it now); each worker's backend keeps what it can (base.py ``retain``)."""
        until = time.time() + ttl_s if ttl_s > 0 else 0.0
        objects = [*self.groups.l3_page_keys(keys),
                   *map(PageKey, self.l2.spans.object_keys(keys))]
        self.queue_command(RetainPages(tuple(objects), until))

    def finish_request(self, request: SchedulerRequest, block_ids: GroupBlockIds
                       ) -> tuple[bool, dict[str, Any] | None, dict[str, list[float]]]:
        """``request_finished``, plus what the request's response carries in its
        ``kv_transfer_params`` (the tokens each tier served, pages retained, the
        prefetch its ``return_in_s`` booked, why its hints were ignored; None:
        nothing) and its observations for the metrics (``request_cached_tokens_<tier>``)."""
        req_id = request.request_id
        cached, error = self.cached_tokens_of(req_id), self.hint_error_of(req_id)
        done = self.request_finished(request, block_ids)
        retained = self.take_retained(req_id)
        booked = self.take_booked(req_id)
        reply: dict[str, Any] = {}
        if booked is not None:
            reply["prefetch_id"] = booked
        observations: dict[str, list[float]] = {}
        if cached is not None:
            reply["cached_tokens"] = tiers = cached.as_dict()
            observations = {f"request_cached_tokens_{t}": [float(n)] for t, n in tiers.items()}
        if isinstance(retained, int):
            reply["retained_pages"] = retained
        elif retained is not None:
            error = retained if error is None else f"{error}; {retained}"
        if error is not None:
            reply["error"] = error
        return done, ({HINTS_KEY: reply} if reply else None), observations

    def take_booked(self, req_id: str) -> str | None:
        """A finished request's booked ``return_in_s`` read (its prefetch id), or None."""
        return self._booked.pop(req_id, None)

    def take_retained(self, req_id: str) -> int | str | None:
        """A finished request's retain_s outcome: pages pinned, why none, or None."""
        return self._retained.pop(req_id, None)

    def on_worker_report(self, report: WorkerReport) -> None:
        self.l2.report_bad_slots(report.bad_slots)
        if report.l3_stored:
            self._count_backups(self._current(report))
        for rank, gauges in report.gauges.items():
            if G.L3_BACKUP_QUEUE_PAGES in gauges:
                self._backup_queues[rank] = gauges[G.L3_BACKUP_QUEUE_PAGES]
        self.stores.on_stores_done(report.stores_done)
        self.fetches.on_report(report.fetched)
        self.prefetches.settle()

    def _count_backups(self, stored: Mapping[int, list[bytes]]) -> None:
        """Mark the pages every writing rank has backed up as in L3 (the tree)."""
        if self.l3_writers == 1:
            every = [PageKey(k) for ks in stored.values() for k in ks]
            self.l2.backed_up(every)
            self.catch_up.backed_up(every)
            return
        votes, done = self._backup_votes, []
        for rank, keys in stored.items():
            for key in keys:
                ranks = votes.setdefault(key, set())
                ranks.add(rank)
                if len(ranks) >= self.l3_writers:
                    del votes[key]
                    done.append(PageKey(key))
        while len(votes) > MAX_BACKUP_VOTES:  # a rank whose backup failed never votes
            votes.popitem(last=False)
        self.l2.backed_up(done)
        self.catch_up.backed_up(done)

    def take_events(self) -> list[PageEvent]:
        """L2's and L3's KV events since the last call (events.py; [] unless enabled)."""
        return self.events.take()

    def has_pending_stores(self) -> bool:
        return self.stores.has_pending()

    def has_worker_work(self) -> bool:
        """Work the workers have yet to receive or report: stores, fetches (admin
        prefetches too) and L3 commands. The connector keeps vLLM stepping meanwhile."""
        return (self.stores.has_pending() or bool(self.fetches.in_flight or self._commands)
                or (self.storage is not None and self.catch_up.has_work()))

    def l3_changed(self) -> None:
        """Another L3 store was attached, or none: what the tree knew of L3 is
        forgotten, and the catch-up backs L2 up to the new one (catch_up.py)."""
        self.l2.forget_l3()
        self._l3_changing(None)

    def reset(self) -> bool:
        """Drop every L2 page (vLLM's reset_prefix_cache); False if pages are in use."""
        if self.loads.pending() or self.fetches.in_flight:
            return False
        self.pins.release_all()
        if not self.l2.reset():
            return False
        self.requests.forget_stored()
        return True

    # ---- flush (admin endpoint) -----------------------------------------------------

    def flush(self, tiers: set[str], prefix: Sequence[int] | None,
              cache_salt: str | None = None, lora_name: str | None = None,
              ) -> tuple[dict[str, int], L3Removal | None]:
        """Drop cached pages from L2 and plan their removal from L3: all of them, or
        those below ``prefix``. Returns (L2 counts, the L3 operation or None);
        see flush.py for which pages. The caller applies the operation to its own
        L3 instance, then queues it for the workers (``queue_command``), always:
        until then backups reported are dropped and the catch-up waits."""
        counts, l3_op = self.flusher.flush(tiers, prefix, cache_salt, lora_name,
                                           release=self.pins.release_under)
        if l3_op is not None:  # the workers drop the queued backups of those pages
            self._l3_changing(l3_op)
        return counts, l3_op

    def forget(self, prefix: Sequence[int], cache_salt: str | None = None,
               lora_name: str | None = None, keep_tokens: int = 0,
               ) -> tuple[dict[str, int], L3Removal | None]:
        """A conversation's own pages out of L2, and their L3 removal (flush.py),
        which the caller queues (``queue_command``) as ``flush``'s."""
        counts, l3_op = self.flusher.forget(prefix, cache_salt, lora_name, keep_tokens,
                                            release=self.pins.release_under)
        if l3_op is not None:
            self._l3_changing(l3_op)
        return counts, l3_op

    def prefix_keys(self, prefix: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[PageKey]:
        """Keys of the full pages of a plain-token prompt, as its requests get them."""
        return self.flusher.prefix_keys(prefix, cache_salt, lora_name)
