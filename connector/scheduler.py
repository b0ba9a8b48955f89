"""Scheduler half of the connector: owns the HiRadixTree and every placement decision.

Contract with vLLM's scheduler (see DESIGN.md "Data flow of one request"):
- ``get_num_new_matched_tokens`` claims only full pages that are in L2 now,
  beyond vLLM's own prefix hit, leaving at least one prompt token to compute
  (L2 loads are synchronous: they finish before the step's forward pass).
- ``update_state_after_alloc`` locks the matched tree node and queues the
  load; the lock is released once the plan has been emitted (the worker runs
  steps in order, so no later step can overwrite those slots first).
- ``build_connector_meta`` plans write-through stores for every page whose KV
  is complete by the end of the step and whose tokens are known, allocating
  L2 slots (evicting leaf-first LRU when full) and publishing the pages in
  the tree at once (see metadata.py for the ordering that makes this safe).
- ``request_finished`` stores what is left of a finished request and asks
  vLLM to keep its blocks until the worker reports the store done.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.connector.metadata import (
    HiCacheStepMetadata,
    HiCacheWorkerReport,
    PagePlan,
    RequestLoad,
)
from hicache.tiers.host_pool import PoolGeometry
from hicache.tiers.page_keys import KeyNamespace, PageKey, PageKeyChain
from hicache.tiers.radix_tree import HiRadixTree, MatchResult, TreeNode
from hicache.tiers.slot_allocator import SlotAllocator

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    """What the scheduler half remembers about one live request."""

    request: Request
    chain: PageKeyChain
    # Leading pages of this request known to be in L2 (planned or matched).
    stored_pages: int = 0
    # Leading pages this request has counted towards write_through_selective.
    counted_pages: int = 0
    # Match found by the last get_num_new_matched_tokens, for the allocation
    # that follows it, with the local (vLLM prefix cache) hit it was measured against.
    pending_match: MatchResult | None = None
    local_tokens: int = 0


@dataclass
class SchedulerStats:
    """Counters of the scheduler half (pages are L2 pages)."""

    lookups: int = 0
    hit_tokens: int = 0
    loaded_pages: int = 0
    stored_pages: int = 0
    evicted_pages: int = 0
    store_skipped_pages: int = 0
    bad_slots_reported: int = 0
    max_used_slots: int = 0
    per_request_hits: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("per_request_hits")
        return d


class HiCacheScheduler:
    """Placement logic: which pages hit L2, which slots they use, what to store."""

    def __init__(
        self,
        *,
        geometry: PoolGeometry,
        namespace: KeyNamespace,
        page_size: int,
        block_size: int,
        block_ids_of: Any,
        write_policy: str = "write_through",
        write_threshold: int = 2,
    ) -> None:
        self.geometry = geometry
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        # write_through_selective: requests that computed each page (bounded LRU).
        self._page_hits: OrderedDict[PageKey, int] = OrderedDict()
        self._page_hits_cap = max(4096, 8 * geometry.num_slots)
        self.namespace = namespace
        self.page_size = page_size
        self.block_size = block_size
        self.blocks_per_page = page_size // block_size
        # Callable req_id -> list of the request's vLLM block ids (group 0).
        self._block_ids_of = block_ids_of
        self.tree = HiRadixTree()
        self.slots = SlotAllocator(geometry.num_slots)
        self.stats = SchedulerStats()
        self._requests: dict[str, _RequestState] = {}
        self._loads: list[RequestLoad] = []
        self._load_locks: list[TreeNode] = []
        self._deferred_stores: list[PagePlan] = []
        self._release_after_store: list[str] = []
        self._bad_slots: set[int] = set()

    # ---- lookup -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        state = self._state(request)
        state.chain.extend(request.all_token_ids)
        keys = state.chain.keys
        # At least one token must be left for the forward pass to produce logits.
        max_pages = (request.num_tokens - 1) // self.page_size
        match = self.tree.match_prefix(keys[:max_pages])
        self.stats.lookups += 1
        hit_tokens = match.num_pages * self.page_size
        if hit_tokens <= num_computed_tokens:
            state.pending_match = None
            return 0
        state.pending_match = match
        state.local_tokens = num_computed_tokens
        return hit_tokens - num_computed_tokens

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        match, state.pending_match = state.pending_match, None
        if num_external_tokens == 0 or match is None:
            return
        start = state.local_tokens
        end = start + num_external_tokens
        matched_tokens = match.num_pages * self.page_size
        first_block = start // self.block_size
        end_block = -(-min(end, matched_tokens) // self.block_size)
        pages = []
        keys = state.chain.keys
        for page in range(start // self.page_size, match.num_pages):
            lo = max(first_block, page * self.blocks_per_page)
            hi = min(end_block, (page + 1) * self.blocks_per_page)
            if lo >= hi:
                break
            pages.append(
                PagePlan(
                    slot=match.host_slots[page],
                    key=keys[page],
                    first_offset=lo - page * self.blocks_per_page,
                    block_ids=tuple(block_ids[lo:hi]),
                )
            )
        # vLLM allocated more external tokens than were offered (never seen):
        # those blocks are reported as failed loads, so vLLM recomputes them.
        unloadable = tuple(block_ids[end_block : -(-end // self.block_size)])
        if unloadable:
            logger.error(
                "HiCache: request %s got %d external tokens after a local hit of %d, but "
                "only %d tokens matched; recomputing the rest",
                request.request_id, num_external_tokens, start, matched_tokens,
            )
        self.tree.lock(match.node)
        self._load_locks.append(match.node)
        self._loads.append(RequestLoad(request.request_id, tuple(pages), unloadable))
        state.stored_pages = max(state.stored_pages, match.num_pages)
        self.stats.hit_tokens += num_external_tokens
        self.stats.loaded_pages += len(pages)
        self.stats.per_request_hits[request.request_id] = num_external_tokens

    # ---- per-step plan ------------------------------------------------------

    def build_connector_meta(self, num_scheduled_tokens: dict[str, int]) -> HiCacheStepMetadata:
        self._drop_bad_slots()
        stores = self._deferred_stores
        # write_back copies nothing while a request runs (see request_finished).
        scheduled = {} if self.write_policy == "write_back" else num_scheduled_tokens
        for req_id, n in scheduled.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            request = state.request
            ready = min(request.num_computed_tokens + n, len(request.all_token_ids))
            ready_pages = ready // self.page_size
            if ready_pages > state.stored_pages:
                stores.extend(self._plan_store(state, ready_pages, self._block_ids_of(req_id)))
        meta = HiCacheStepMetadata(
            loads=self._loads, stores=stores, release_after_store=self._release_after_store
        )
        for node in self._load_locks:
            self.tree.unlock(node)
        self._loads, self._load_locks = [], []
        self._deferred_stores, self._release_after_store = [], []
        return meta

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Plan the request's remaining stores; True = keep its blocks until done.

        For write_back this is where every page of the request is copied: its
        blocks are about to become evictable in vLLM's prefix cache. vLLM does
        not tell a connector when it actually evicts a cached block, so this
        approximates "copy on L1 eviction" by "copy when L1 may evict".
        """
        state = self._requests.pop(request.request_id, None)
        self.stats.per_request_hits.pop(request.request_id, None)
        if state is None or not block_ids:
            return False
        ready = min(request.num_computed_tokens, len(request.all_token_ids))
        ready_pages = min(ready // self.page_size, len(block_ids) // self.blocks_per_page)
        if ready_pages <= state.stored_pages:
            return False
        plans = self._plan_store(state, ready_pages, block_ids)
        if not plans:
            return False
        self._deferred_stores.extend(plans)
        self._release_after_store.append(request.request_id)
        return True

    def on_worker_report(self, report: HiCacheWorkerReport) -> None:
        self._bad_slots |= report.bad_slots

    def has_pending_stores(self) -> bool:
        return bool(self._deferred_stores)

    def reset(self) -> bool:
        """Drop every L2 page (vLLM's reset_prefix_cache); False if pages are in use."""
        if self._load_locks:
            return False
        try:
            freed = self.tree.reset()
        except RuntimeError:
            return False
        self.slots.free(freed)
        for state in self._requests.values():
            state.stored_pages = 0
        return True

    # ---- helpers --------------------------------------------------------------

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            seed = self.namespace.seed(
                cache_salt=getattr(request, "cache_salt", None),
                lora_name=request.lora_request.lora_name if request.lora_request else None,
            )
            state = _RequestState(request, PageKeyChain(seed, self.page_size))
            self._requests[request.request_id] = state
        return state

    def _plan_store(
        self, state: _RequestState, ready_pages: int, block_ids: Sequence[int]
    ) -> list[PagePlan]:
        """Reserve slots for the request's pages in [in-tree prefix, ready_pages)."""
        state.chain.extend(state.request.all_token_ids)
        keys = state.chain.keys[:ready_pages]
        if self.write_policy == "write_through_selective":
            keys = keys[: self._popular_prefix(state, keys)]
        match = self.tree.match_prefix(keys)
        if match.num_pages >= len(keys):
            state.stored_pages = ready_pages
            return []
        need = len(keys) - match.num_pages
        # The prefix we extend must survive the eviction that makes room for it.
        self.tree.lock(match.node)
        try:
            slots = self._allocate(need)
        finally:
            self.tree.unlock(match.node)
        if slots is None:
            self.stats.store_skipped_pages += need
            return []
        inserted = self.tree.insert(keys, list(match.host_slots) + slots)
        leftover = set(inserted.unused_slots) & set(slots)
        if leftover:  # cannot happen single-threaded; keep the allocator exact anyway
            self.slots.free(sorted(leftover))
        plans = []
        for i, slot in enumerate(slots):
            if slot in leftover:
                continue
            page = match.num_pages + i
            first = page * self.blocks_per_page
            plans.append(
                PagePlan(slot, keys[page], 0, tuple(block_ids[first : first + self.blocks_per_page]))
            )
        state.stored_pages = ready_pages
        self.stats.stored_pages += len(plans)
        self.stats.max_used_slots = max(self.stats.max_used_slots, self.slots.num_used)
        return plans

    def _popular_prefix(self, state: _RequestState, keys: list[PageKey]) -> int:
        """Count this request's new pages; how many leading pages reached the threshold.

        Every request that computes page i also computed pages < i, so counts
        never grow along a prefix chain and the cut keeps L2 prefix-closed.
        """
        hits = self._page_hits
        for key in keys[state.counted_pages :]:
            hits[key] = hits.get(key, 0) + 1
            hits.move_to_end(key)
        state.counted_pages = max(state.counted_pages, len(keys))
        while len(hits) > self._page_hits_cap:
            hits.popitem(last=False)
        for i, key in enumerate(keys):
            if hits.get(key, 0) < self.write_threshold:
                return i
        return len(keys)

    def _allocate(self, n: int) -> list[int] | None:
        short = n - self.slots.num_free
        if short > 0:
            freed = self.tree.evict(short)
            self.slots.free(freed)
            self.stats.evicted_pages += len(freed)
        return self.slots.alloc(n)

    def _drop_bad_slots(self) -> None:
        """Forget pages whose slots a worker could not use, so they are not hit again."""
        if not self._bad_slots:
            return
        bad = self._bad_slots
        freed, self._bad_slots = self.tree.remove_slots(bad)  # locked ones: next step
        self.slots.free(freed)
        self.stats.bad_slots_reported += len(bad - self._bad_slots)
        for state in self._requests.values():
            state.stored_pages = 0
