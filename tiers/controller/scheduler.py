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
  the tree at once (see tiers/index/plans.py for the ordering that makes this safe).
- ``request_finished`` stores what is left of a finished request and asks
  vLLM to keep its blocks until the worker reports the store done.

Pages are keyed from ``request.block_hashes`` (vLLM's prefix-cache hashes,
which cover multimodal features, prompt embeddings, LoRA and cache salt).
A store never includes a page that holds vLLM's null block (a sliding
window's dropped blocks): the store ends at the first such page, keeping L2
prefix-closed.

With an L3 backend (``storage``), the lookup continues past the L2 match:
``batch_exists`` on the scheduler's own view of the store says how many
further pages L3 holds on every rank (``RankShards``: the shortest run over
the ranks' shards; MLA has one shared shard), so no rank is promised pages
it lacks. Such a hit is asynchronous: vLLM
parks the request in WAITING_FOR_REMOTE_KVS, the L2 prefix stays locked, L2
slots are reserved for the L3 pages, and the worker fetches and loads on
its I/O thread. When every rank has reported, the pages that arrived are
inserted into the tree (L2-resident), the rest of the slots are freed.
L3 is not mirrored in the tree: it is asked on demand, as SGLang does
(its ``batch_exists`` before every prefetch).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.tiers.index.page_keys import (
    KeyNamespace,
    PageKey,
    PageKeyChain,
    block_page_keys,
    token_block_hashes,
)
from hicache.tiers.index.plans import (
    NULL_BLOCK_ID,
    PagePlan,
    RequestFetch,
    RequestLoad,
    StepPlan,
    WorkerReport,
)
from hicache.tiers.index.radix_tree import HiRadixTree, MatchResult, TreeNode
from hicache.tiers.index.slot_allocator import SlotAllocator
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageBackend
from hicache.tiers.l3.rank_shards import RankShards

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PrefixHasher = Callable[[Sequence[int], "str | None", "str | None"], list[bytes]]


def _stand_in_hashes(block_size: int, tokens: Sequence[int], cache_salt: str | None,
                     lora_name: str | None) -> list[bytes]:
    return token_block_hashes(tokens, block_size, cache_salt, lora_name)


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
    # L3 pages found after pending_match by the last lookup (async hit when > 0).
    pending_l3_pages: int = 0
    # An L3 fetch for this request is in flight (see _Fetch).
    fetching: bool = False
    # Last lookup, counted per tier when vLLM admits the request:
    # (prompt pages, pages vLLM had, pages in L2, pages found in L3 after them).
    lookup: tuple[int, int, int, int] | None = None
    # Tier hits are counted at the first admission only, like vLLM's
    # cached_tokens: a preempted request that is admitted again is not a new
    # request (its loads still happen and show in the byte counters).
    counted: bool = False
    # External tokens of the last admission that come from L3 pages (for
    # vLLM's per-source cached-token metric).
    l3_tokens: int = 0


@dataclass
class _Fetch:
    """An L3 fetch in flight: the L2 prefix it extends is locked, its slots reserved."""

    node: TreeNode
    prefix_keys: list[PageKey]
    keys: list[PageKey]
    slots: list[int]
    reports: list[int] = field(default_factory=list)


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
    l3_lookups: int = 0
    l3_hit_pages: int = 0
    l3_fetched_pages: int = 0
    l3_failed_pages: int = 0
    l3_lookup_errors: int = 0
    # Per tier, in pages, counted once per admitted request: a page is a hit
    # in the first tier that held it (L1 = vLLM's own prefix cache) and a miss
    # in every tier asked before.
    l1_hit_pages: int = 0
    l2_hit_pages: int = 0
    l2_miss_pages: int = 0
    l3_miss_pages: int = 0
    flushed_l2_pages: int = 0
    flushed_l3_pages: int = 0
    flush_skipped_locked: int = 0
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
        storage: StorageBackend | RankShards | None = None,
        prefetch_policy: str = "timeout",
        prefetch: dict[str, float] | None = None,
        tp_size: int = 1,
        hash_block_size: int | None = None,
        prefix_hasher: PrefixHasher | None = None,
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
        # Pages are keyed from the engine's block hashes (one per hash block).
        self.hash_block_size = hash_block_size or block_size
        if page_size % self.hash_block_size:
            raise ValueError(f"page_size {page_size} is not a multiple of the engine's "
                             f"block-hash size {self.hash_block_size}")
        self.hashes_per_page = page_size // self.hash_block_size
        # (token ids, cache salt, LoRA name) -> the engine's block hashes of a
        # plain-token prompt (admin flush / tree by prefix); engine-free default.
        self._prefix_hasher: PrefixHasher = prefix_hasher or functools.partial(
            _stand_in_hashes, self.hash_block_size)
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
        self.storage = storage
        self.prefetch_policy = prefetch_policy
        self.prefetch = dict(prefetch or {})
        self.tp_size = tp_size
        self._fetches: list[RequestFetch] = []
        self._inflight: dict[str, _Fetch] = {}
        # Held by the connector around vLLM's calls and by the admin endpoint.
        self.lock = threading.RLock()

    # ---- lookup -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens HiCache can provide beyond vLLM's own hit, whether asynchronously)."""
        state = self._state(request)
        state.chain.extend(request.block_hashes)
        keys = state.chain.keys
        # At least one token must be left for the forward pass to produce logits.
        max_pages = (request.num_tokens - 1) // self.page_size
        match = self.tree.match_prefix(keys[:max_pages])
        self.stats.lookups += 1
        l3_pages = self._l3_lookup(keys[match.num_pages : max_pages])
        hit_tokens = (match.num_pages + l3_pages) * self.page_size
        state.lookup = (max_pages, num_computed_tokens // self.page_size, match.num_pages,
                        l3_pages)
        if hit_tokens <= num_computed_tokens or state.fetching:
            state.pending_match, state.pending_l3_pages = None, 0
            return 0, False
        state.pending_match = match
        state.pending_l3_pages = l3_pages
        state.local_tokens = num_computed_tokens
        return hit_tokens - num_computed_tokens, l3_pages > 0

    def l3_tokens_of(self, req_id: str) -> int:
        state = self._requests.get(req_id)
        return state.l3_tokens if state is not None else 0

    def _count_lookup(self, state: _RequestState, granted: bool) -> None:
        if state.lookup is None or state.counted:
            return
        prompt, local, in_l2, in_l3 = state.lookup
        state.lookup, state.counted = None, True
        local = min(local, prompt)
        l2 = max(0, min(in_l2, prompt) - local) if granted else 0
        l3 = max(0, min(in_l2 + in_l3, prompt) - max(local, in_l2)) if granted else 0
        self.stats.l1_hit_pages += local
        self.stats.l2_hit_pages += l2
        self.stats.l2_miss_pages += prompt - local - l2
        if self.storage is not None:
            self.stats.l3_hit_pages += l3
            self.stats.l3_miss_pages += max(0, prompt - local - l2 - l3)

    def _l3_lookup(self, keys: Sequence[PageKey]) -> int:
        """Pages of ``keys`` that L3 holds consecutively and that are worth fetching."""
        if self.storage is None or not keys:
            return 0
        threshold_pages = -(-int(self.prefetch.get("prefetch_threshold", 256)) // self.page_size)
        if len(keys) < max(1, threshold_pages):
            return 0
        self.stats.l3_lookups += 1
        try:
            found = self.storage.batch_exists([k.hex() for k in keys])
        except Exception:  # noqa: BLE001 - a failing L3 is a miss, never an engine error
            logger.exception("HiCache: L3 lookup failed; treating as a miss")
            self.stats.l3_lookup_errors += 1
            return 0
        # The fetched pages need L2 slots: never promise more than L2 can hold now.
        room = self.slots.num_free + self.tree.evictable_pages()
        found = min(found, room)
        return found if found >= max(1, threshold_pages) else 0

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        match, state.pending_match = state.pending_match, None
        l3_pages, state.pending_l3_pages = state.pending_l3_pages, 0
        self._count_lookup(state, num_external_tokens > 0)
        state.l3_tokens = 0
        if num_external_tokens == 0 or match is None:
            return
        keys = state.chain.keys
        # vLLM asked for an async load exactly when L3 pages were offered; it
        # then waits for the request in finished_recving, whatever happens here.
        is_async = l3_pages > 0
        # The admin endpoint may have flushed pages (another thread) since the
        # lookup: match again. What is gone is reported as unloadable below and
        # recomputed; L3 pages no longer extend a resident prefix, so they go too.
        fresh = self.tree.match_prefix(keys[: match.num_pages])
        if fresh.num_pages < match.num_pages:
            logger.warning("HiCache: %d of %d L2 pages of request %s were flushed "
                           "before their load; recomputing them", match.num_pages -
                           fresh.num_pages, match.num_pages, request.request_id)
            l3_pages = 0
        match = fresh
        l3_slots: list[int] = []
        if l3_pages:
            self.tree.lock(match.node)
            l3_slots = self._allocate(l3_pages) or []
            if not l3_slots:
                logger.warning("HiCache: no L2 room for %d L3 pages of request %s; "
                               "recomputing them", l3_pages, request.request_id)
        slots = list(match.host_slots) + l3_slots
        start = state.local_tokens
        end = start + num_external_tokens
        matched_tokens = len(slots) * self.page_size
        first_block = start // self.block_size
        end_block = -(-min(end, matched_tokens) // self.block_size)
        pages = []
        for page in range(start // self.page_size, len(slots)):
            lo = max(first_block, page * self.blocks_per_page)
            hi = min(end_block, (page + 1) * self.blocks_per_page)
            if lo >= hi:
                break
            pages.append(
                PagePlan(
                    slot=slots[page],
                    key=keys[page],
                    first_offset=lo - page * self.blocks_per_page,
                    block_ids=tuple(block_ids[lo:hi]),
                )
            )
        # Tokens vLLM allocated that no page can supply now (pages flushed since
        # the lookup): reported as failed loads, so vLLM recomputes them.
        unloadable = tuple(block_ids[end_block : -(-end // self.block_size)])
        if unloadable:
            logger.warning(
                "HiCache: request %s got %d external tokens after a local hit of %d, but "
                "only %d tokens matched; recomputing the rest",
                request.request_id, num_external_tokens, start, matched_tokens,
            )
        if is_async:
            if not l3_pages:
                self.tree.lock(match.node)
            # Locked above; unlocked when every rank has reported the fetch.
            # Every L3 page after the L2 match is fetched, also those vLLM's own
            # prefix cache covers (no blocks to fill), so what enters the tree
            # stays a contiguous extension of the locked L2 prefix.
            mine = set(l3_slots)
            planned = {p.slot: p for p in pages}
            l3_plans = tuple(
                planned.get(slots[page], PagePlan(slots[page], keys[page], 0, ()))
                for page in range(match.num_pages, len(slots))
            )
            self._fetches.append(RequestFetch(
                request.request_id, tuple(p for p in pages if p.slot not in mine), l3_plans,
                unloadable, self._fetch_timeout(len(l3_slots)),
            ))
            self._inflight[request.request_id] = _Fetch(
                match.node, keys[: match.num_pages],
                keys[match.num_pages : match.num_pages + len(l3_slots)], l3_slots,
            )
            state.fetching = True
            state.l3_tokens = sum(len(p.block_ids) for p in l3_plans) * self.block_size
        else:
            self.tree.lock(match.node)
            self._load_locks.append(match.node)
            self._loads.append(RequestLoad(request.request_id, tuple(pages), unloadable))
        state.stored_pages = max(state.stored_pages, match.num_pages)
        self.stats.hit_tokens += num_external_tokens
        self.stats.loaded_pages += len(pages)
        self.stats.per_request_hits[request.request_id] = num_external_tokens

    # ---- per-step plan ------------------------------------------------------

    def build_connector_meta(self, num_scheduled_tokens: dict[str, int]) -> StepPlan:
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
        meta = StepPlan(
            loads=self._loads, stores=stores, release_after_store=self._release_after_store,
            fetches=self._fetches,
        )
        for node in self._load_locks:
            self.tree.unlock(node)
        self._loads, self._load_locks, self._fetches = [], [], []
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
        if state is None or not block_ids or state.fetching:
            # A request finished (aborted) while its L3 fetch runs: vLLM keeps its
            # blocks until the worker reports the fetch; nothing to store.
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

    def on_worker_report(self, report: WorkerReport) -> None:
        self._bad_slots |= report.bad_slots
        for req_id, counts in report.fetched.items():
            fetch = self._inflight.get(req_id)
            if fetch is None:
                continue
            fetch.reports.extend(counts)
            if len(fetch.reports) >= self.tp_size:
                self._finish_fetch(req_id, min(fetch.reports))

    def _finish_fetch(self, req_id: str, fetched: int) -> None:
        """Every rank has its first ``fetched`` L3 pages in L2: publish them, free the rest."""
        fetch = self._inflight.pop(req_id)
        state = self._requests.get(req_id)
        if state is not None:
            state.fetching = False
        self.stats.l3_fetched_pages += fetched
        self.stats.l3_failed_pages += len(fetch.slots) - fetched
        unused = fetch.slots[fetched:]
        attached = fetch.node is self.tree.root or fetch.node.parent is not None
        if fetched and attached:
            mine = set(fetch.slots)
            inserted = self.tree.insert(fetch.prefix_keys + fetch.keys[:fetched],
                                        self._prefix_slots(fetch) + fetch.slots[:fetched])
            unused += [s for s in inserted.unused_slots if s in mine]
        elif fetched:
            unused = list(fetch.slots)
        self.tree.unlock(fetch.node)
        if unused:
            self.slots.free(sorted(set(unused)))

    def _prefix_slots(self, fetch: _Fetch) -> list[int]:
        """Host slots of the locked L2 prefix a fetch extends (still resident: locked)."""
        match = self.tree.match_prefix(fetch.prefix_keys)
        assert match.num_pages == len(fetch.prefix_keys), "locked prefix left L2"
        return match.host_slots

    def _fetch_timeout(self, pages: int) -> float | None:
        if self.prefetch_policy == "wait_complete":
            return None
        if self.prefetch_policy == "best_effort":
            return 0.0
        tokens = pages * self.page_size
        base = self.prefetch.get("prefetch_timeout_base", 2.0)
        per_ki = self.prefetch.get("prefetch_timeout_per_ki_token", 0.1)
        return min(self.prefetch.get("prefetch_timeout_max", 30.0), base + per_ki * tokens / 1024)

    def has_pending_stores(self) -> bool:
        return bool(self._deferred_stores)

    def reset(self) -> bool:
        """Drop every L2 page (vLLM's reset_prefix_cache); False if pages are in use."""
        if self._load_locks or self._inflight:
            return False
        try:
            freed = self.tree.reset()
        except RuntimeError:
            return False
        self.slots.free(freed)
        for state in self._requests.values():
            state.stored_pages = 0
        return True

    # ---- flush (admin endpoint) -------------------------------------------------

    def flush(self, tiers: set[str], prefix: Sequence[int] | None,
              cache_salt: str | None = None, lora_name: str | None = None,
              ) -> tuple[dict[str, int], tuple | None]:
        """Drop cached pages from L2 and plan their removal from L3: all of them, or
        those below ``prefix``. Returns (L2 counts, the L3 operation or None).

        With a prefix, a page is flushed when its tokens extend the prefix:
        when the prefix ends on a page boundary, its last page and every page
        after it; when it ends mid-page, every page after its last full page
        (page keys hash whole pages, so siblings that share the full pages are
        flushed too). Pages in use by a load stay in L2 (counted as skipped).
        The L3 operation is ``("clear",)`` or ``("delete", [hex keys])``: the
        flushed pages plus, for a page-aligned prefix, its last page (which
        makes every later page unreachable by lookups, even ones this engine
        never saw). The caller runs it outside the scheduler lock, on its own
        storage instance and on every worker (each holds its rank's shard).
        """
        counts = {"l2_pages": 0, "skipped_locked": 0}
        l3_op: tuple | None = None
        if prefix is None:
            if "l2" in tiers:
                slots = [s for n in self.tree.iter_nodes() for s in (n.host_slots or ())]
                freed, kept = self.tree.remove_slots(slots)
                self.slots.free(freed)
                counts["l2_pages"], counts["skipped_locked"] = len(freed), len(kept)
            if "l3" in tiers:
                l3_op = ("clear",)
        else:
            keys = self.prefix_keys(prefix, cache_salt, lora_name)
            aligned = bool(keys) and len(prefix) % self.page_size == 0
            match = self.tree.match_prefix(keys)
            victims: list[int] = []
            if match.num_pages == len(keys):
                if aligned:
                    victims = [match.host_slots[-1]]
                else:
                    victims = [c.host_slots[0] for c in match.node.children.values()
                               if c.host_slots]
            removed_keys = self._keys_below(victims)
            if "l2" in tiers and victims:
                freed, kept = self.tree.remove_slots(victims)
                self.slots.free(freed)
                counts["l2_pages"], counts["skipped_locked"] = len(freed), len(kept)
            if "l3" in tiers:
                doomed = dict.fromkeys(removed_keys + ([keys[-1]] if aligned else []))
                l3_op = ("delete", [k.hex() for k in doomed])
        for state in self._requests.values():
            state.stored_pages = 0
        self.stats.flushed_l2_pages += counts["l2_pages"]
        self.stats.flush_skipped_locked += counts["skipped_locked"]
        return counts, l3_op

    def _keys_below(self, slots: Sequence[int]) -> list[PageKey]:
        """Keys of the pages in ``slots`` and of every page below them in the tree."""
        wanted, keys = set(slots), []
        stack = [(self.tree.root, False)]
        while stack:
            node, inside = stack.pop()
            for i, slot in enumerate(node.host_slots or ()):
                if inside or slot in wanted:
                    inside = True
                    keys.append(node.keys[i])
            stack.extend((child, inside) for child in node.children.values())
        return keys

    # ---- helpers --------------------------------------------------------------

    def prefix_keys(self, prefix: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[PageKey]:
        """Keys of the full pages of a plain-token prompt, as its requests get them."""
        hashes = self._prefix_hasher(list(prefix), cache_salt, lora_name)
        return block_page_keys(self.namespace.seed(), hashes, self.hashes_per_page)

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            chain = PageKeyChain(self.namespace.seed(), self.hashes_per_page)
            state = _RequestState(request, chain)
            self._requests[request.request_id] = state
        return state

    def _plan_store(
        self, state: _RequestState, ready_pages: int, block_ids: Sequence[int]
    ) -> list[PagePlan]:
        """Reserve slots for the request's pages in [in-tree prefix, ready_pages)."""
        state.chain.extend(state.request.block_hashes)
        keys = state.chain.keys[:ready_pages]
        if self.write_policy == "write_through_selective":
            keys = keys[: self._popular_prefix(state, keys)]
        match = self.tree.match_prefix(keys)
        # Only pages whose blocks all hold real KV now: a sliding window puts
        # vLLM's null block where it no longer reaches, and the tree must stay
        # prefix-closed, so the first page that lost a block ends the store.
        for page in range(match.num_pages, len(keys)):
            first = page * self.blocks_per_page
            blocks = block_ids[first : first + self.blocks_per_page]
            if len(blocks) < self.blocks_per_page or NULL_BLOCK_ID in blocks:
                self.stats.store_skipped_pages += len(keys) - page
                keys = keys[:page]
                break
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
