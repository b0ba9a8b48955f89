"""The write path: which pages computed in L1 are copied to L2, and when.

Contract:
- Every step, each running request the write policy lets store
  (``policies.py``) stores the pages whose KV is complete by the end of the
  step and whose tokens are known; a finished request stores what is left
  of it (write_back: everything) and asks vLLM to keep its blocks until the
  worker has copied them (``release_after_store``, reported back by the
  worker in ``finished_sending``).
- A request remembers how many of its leading pages are in L2
  (``RequestState.stored_pages``), so a page is planned once; that count is
  only advanced when the store was planned or nothing was missing, so a
  store refused for lack of room is tried again at the next step. Where L2
  cannot take every page now (pins hold their share, loads lock pages), the
  head it can take is stored and the count advances to it: the request's
  prefix reaches L2, hence L3, instead of nothing while the pins last.
- Slots, eviction and publishing belong to ``L2Manager.plan_store``; the
  pages planned here go into the next ``StepPlan``.
- State groups (Mamba, tiers/index/kv_groups.py): a stored page carries its
  checkpoint where the step ends on the page's end ("none" mode: the
  request's state block), or in "align" mode where vLLM handed the page's
  end state off in this step (``handoffs``, only valid until the step's
  stores are done, so such stores wait for their step). A finished
  request's store in "align" mode has no hand-off: its pages go without
  checkpoints.
- Which stored pages the workers back up to L3 is the L3 admission rule's
  (policies.py): a page it does not admit is planned without L3 keys.
- Stores across steps (``async_stores``, tiers/worker/store_queue.py): a store may
  still read a request's blocks after the step that planned it. Each rank
  reports the last plan whose stores are done (``on_stores_done``), so
  ``store_in_flight`` knows whether a request's last store may still run.
  A finished request whose store may still run keeps its blocks until the
  next plan's stores are done (``hold_blocks``), and a step that preempts
  one makes the workers wait for it first (``StepPlan.flush_stores``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

from hicache.tiers.controller.l2_manager import L2Manager
from hicache.tiers.controller.policies import AdmitAll, L3Admission, WritePolicy
from hicache.tiers.controller.requests import RequestState, RequestTable
from hicache.tiers.index.kv_groups import Checkpoints, GroupBlockIds, StateHandoff
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.plans import PagePlan


class StorePlanner:
    """Plans L1 -> L2 copies by the write policy (see the module docstring)."""

    def __init__(self, l2: L2Manager, policy: WritePolicy, *, page_size: int,
                 block_ids_of: Callable[[str], GroupBlockIds], async_stores: bool = False,
                 tp_size: int = 1, l3_admission: L3Admission | None = None) -> None:
        self.l2 = l2
        # Which stored pages go on to L3 (policies.py; the workers back up what a
        # plan gives L3 keys).
        self.l3_admission = l3_admission or AdmitAll()
        self.async_stores = async_stores
        self.tp_size = tp_size
        # rank -> the last plan whose stores that rank has done.
        self._done: dict[int, int] = {}
        self._last_store_seq = 0  # the last plan with stores
        self.policy = policy
        self.page_size = page_size
        # req_id -> the request's vLLM block ids, per KV cache group.
        self._block_ids_of = block_ids_of
        # Stores of finished requests, for the next plan, and those requests.
        self._deferred: list[PagePlan] = []
        self._release_after_store: list[str] = []

    def has_pending(self) -> bool:
        """Stores still to plan, or (across steps) still running on some rank: vLLM
        keeps stepping so that the workers finish and report them."""
        return bool(self._deferred) or (self.async_stores
                                        and self._last_store_seq > self._done_seq())

    def _done_seq(self) -> int:
        return min((self._done.get(r, 0) for r in range(self.tp_size)), default=0)

    def on_stores_done(self, done: Mapping[int, int]) -> None:
        self._done.update(done)

    def store_in_flight(self, state: RequestState) -> bool:
        """Whether some rank may still be copying the request's last store."""
        if not self.async_stores or not state.store_seq:
            return False
        return state.store_seq > self._done_seq()

    def hold_blocks(self, req_id: str) -> None:
        """vLLM keeps a finished request's blocks until the next plan's stores are done
        (the workers finish stores in plan order)."""
        if req_id not in self._release_after_store:
            self._release_after_store.append(req_id)

    def plan_step(self, requests: RequestTable, num_scheduled_tokens: Mapping[str, int],
                  seq: int = 0, handoffs: Mapping[str, StateHandoff] | None = None,
                  ) -> tuple[list[PagePlan], list[str]]:
        """This step's stores (finished requests' first) and the finished requests
        whose blocks wait for them. ``handoffs``: vLLM's "align" boundary states
        of this step, per request."""
        stores, release = self._deferred, self._release_after_store
        self._deferred, self._release_after_store = [], []
        for req_id, n in self.policy.running_requests(num_scheduled_tokens).items():
            state = requests.get(req_id)
            if state is None:
                continue
            request = state.request
            end = request.num_computed_tokens + n
            ready = min(end, len(request.all_token_ids))
            ready_pages = ready // self.page_size
            if ready_pages > state.stored_pages:
                block_ids = self._block_ids_of(req_id)
                planned = self._store(state, ready_pages, block_ids, self._checkpoints(
                    block_ids, end, (handoffs or {}).get(req_id, ())))
                if planned:
                    state.store_seq = seq
                stores.extend(planned)
        if stores:
            self._last_store_seq = seq
        return stores, release

    def plan_finished(self, state: RequestState, block_ids: GroupBlockIds) -> bool:
        """Plan what is left of a finished request; True = vLLM keeps its blocks until
        the next plan's stores are done.

        For write_back this is where every page of the request is copied: its
        blocks are about to become evictable in vLLM's prefix cache. vLLM does
        not tell a connector when it actually evicts a cached block, so this
        approximates "copy on L1 eviction" by "copy when L1 may evict".
        """
        request = state.request
        ready = min(request.num_computed_tokens, len(request.all_token_ids))
        # A state group (Mamba) holds one block per request, not one per page.
        groups = self.l2.groups.groups
        held = min((len(ids) for g, ids in zip(groups, block_ids, strict=True)
                    if g.kind != "state"), default=0)
        ready_pages = min(ready // self.page_size, held // self.l2.blocks_per_page)
        if ready_pages <= state.stored_pages:
            return False
        plans = self._store(state, ready_pages, block_ids,
                            self._checkpoints(block_ids, request.num_computed_tokens, ()))
        if not plans:
            return False
        self._deferred.extend(plans)
        self._release_after_store.append(request.request_id)
        return True

    def _checkpoints(self, block_ids: GroupBlockIds, computed: int,
                     handoff: StateHandoff) -> Checkpoints:
        """The state groups' checkpoints a store of the request may take once
        ``computed`` tokens are computed (see the module docstring)."""
        groups = self.l2.groups
        if groups.aligned:
            return groups.handed_off(handoff, self.page_size)
        return groups.state_blocks(block_ids, computed, self.page_size, self.l2.blocks_per_page)

    def _store(self, state: RequestState, ready_pages: int, block_ids: GroupBlockIds,
               checkpoints: Checkpoints | None = None) -> list[PagePlan]:
        """Copies of the request's pages in [in-L2 prefix, ready_pages) worth storing."""
        if not state.hints.store:  # the client asked for no stores (hints.py)
            state.stored_pages = ready_pages
            return []
        keys = state.page_keys()[:ready_pages]
        worth = self.policy.pages_worth_storing(keys, state.counted_pages)
        state.counted_pages = max(state.counted_pages, len(keys))
        keys = keys[:worth]
        # Where every stored page goes to L3, a span the request's known pages complete
        # is backed up as one object when its last page is stored (l2_manager.py).
        known = state.page_keys() if isinstance(self.l3_admission, AdmitAll) else None
        store = functools.partial(self.l2.plan_store, block_ids=block_ids,
                                  checkpoints=checkpoints, source=state.request,
                                  priority=state.hints.rank, known=known)
        plans, stored = store(keys), ready_pages
        if plans is None:
            # L2 cannot take every page now (pins, pages locked by loads): store the
            # head it can take, so its prefix reaches L2 and L3 at all; the rest waits
            # for a later step (this request's next one, or its end).
            stored = self.l2.storable(keys)
            plans = store(keys[:stored]) if stored else None
            if not plans:
                return []
        state.stored_pages = stored
        admitted = self.l3_admission.admit([PageKey(p.key) for p in plans],
                                           bool(state.hints.retain_s))
        # The rest stay in L2 only: no L3 keys, so no backup (transfers.py l3_keys).
        return plans[:admitted] + [dataclasses.replace(p, l3_keys=(), span=None)
                                   for p in plans[admitted:]]
