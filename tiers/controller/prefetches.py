"""Prefetch at arrival: L3 -> L2 while a request waits in vLLM's queue.

Contract:
- ``on_arrival(request)`` (vLLM's ``on_new_request``) looks the request up
  past its L2 match in the background (fetches.py ``lookup``, probes.py);
  ``advance()`` (every plan) looks again at the requests whose probe had not
  answered. On a hit the L2 prefix is locked, slots are reserved and a
  prefetch (``RequestFetch.prefetch``, id ``plans.prefetch_id``) goes into
  the next plan: the worker reads the pages from L3 into L2 only, no vLLM
  block is involved, and when every rank has reported the pages enter the
  tree like any fetch's (``L3Fetches.on_report``). At admission the request
  then matches them in L2 and loads them synchronously.
- ``gate(request)`` at a lookup (vLLM's admission attempt) first starts the
  prefetch if the arrival lookup has answered since, so a request seen at
  arrival is always served through L2. While its prefetch is in flight it
  keeps SGLang's policy meanings: ``wait_complete`` answers "wait" (vLLM
  is told None and asks again next step) until it ends; ``timeout`` waits
  until ``policy.timeout_s(tokens)`` seconds after the prefetch started;
  ``best_effort`` never waits. A request that does not wait takes its L2
  match only (the rest is recomputed; the prefetch goes on and its pages
  serve later requests). With no prefetch (none was possible: no room, the
  budget below, or no arrival) the gate is open and the lookup proceeds as
  before: an L3 hit found at admission is fetched asynchronously (fetches.py).
- Tier accounting: the pages a request's prefetch brought into L2 count as
  L3 hits at its admission (``prefetched_pages``), the tier that held them
  when it arrived, as SGLang counts storage hits; ``prefetch_waits`` and
  ``prefetch_late`` say how long requests waited for them.
- What a prefetch brought stays locked in L2 (``settle``, after each
  workers' report) until its request is admitted, its load planned, or it
  ends: a later prefetch or store must not evict it first (SGLang holds
  prefetched host pages for their request the same way).
- Bounded: the pages prefetches hold, in flight or kept for their request,
  never exceed ``max_share`` of L2; a prefetch never evicts a locked page
  (``L2Manager.allocate``). A prefetch takes a request's whole L3 run or
  nothing (the lookup at admission then fetches it).
- ``cancel(req_id)`` (the request finished or was aborted): a prefetch not
  yet handed to the workers is dropped, its slots freed; one already sent
  ends normally and its pages enter the tree.
- Only with background lookups (``L3Fetches.probes``), a store whose lookups
  may run concurrently, and no Mamba state groups (their L3 pages are
  bodies plus checkpoints, fetched at admission only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hicache.tiers.controller.fetches import L3Fetches, can
from hicache.tiers.controller.requests import RequestTable, SchedulerRequest
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.plans import prefetch_id
from hicache.tiers.index.tree_node import TreeNode

# Share of the L2 pool that prefetches may hold, in flight or kept for their request.
MAX_SHARE = 0.5

Gate = Literal["wait", "l2_only", "open"]


@dataclass
class _Prefetch:
    fetch_id: str
    # The request's page keys through the prefetched ones; its L2 match when
    # it started, and the L3 pages after it.
    keys: list[PageKey]
    start: int
    pages: int
    started: float
    # Seconds the request may wait for it (None: until it ends).
    timeout_s: float | None
    # The request stopped waiting for it (counted once).
    late: bool = False
    # Once it ended: the tree node locked over what it brought, until the
    # request is admitted or ends (None: not yet, or nothing to hold).
    held: TreeNode | None = None
    settled: bool = False


class ArrivalPrefetches:
    """Prefetches of requests vLLM has not admitted yet (see the module docstring)."""

    def __init__(self, fetches: L3Fetches, requests: RequestTable, stats: SchedulerStats,
                 *, page_size: int, capacity_pages: int, max_share: float = MAX_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetches = fetches
        self.requests = requests
        self.stats = stats
        self.page_size = page_size
        self.max_pages = max(1, int(capacity_pages * max_share))
        self.clock = clock
        # Arrived, their probe not answered yet.
        self._asking: dict[str, SchedulerRequest] = {}
        self._running: dict[str, _Prefetch] = {}

    def applicable(self) -> bool:
        f = self.fetches
        return (f.probes is not None and f.storage is not None
                and not f.l2.groups.has_state
                and can(f.storage, "concurrent_lookups"))

    def reserved_pages(self) -> int:
        """Pages of L2 that prefetches hold: in flight, or arrived and kept for
        their request until it is admitted."""
        return sum(p.pages for p in self._running.values())

    def on_arrival(self, request: SchedulerRequest) -> None:
        if not self.applicable():
            return
        self._asking[request.request_id] = request
        self._try_start(request, wait=False)

    def advance(self) -> None:
        """Start the prefetches whose lookups answered since the last call."""
        if not self._asking:
            return
        if not self.applicable():
            self._asking.clear()
            return
        for request in list(self._asking.values()):
            self._try_start(request, wait=False)

    def _try_start(self, request: SchedulerRequest, *, wait: bool) -> None:
        req_id = request.request_id
        state = self.requests.state_of(request)
        keys = state.page_keys()
        max_pages = (request.num_tokens - 1) // self.page_size
        l2 = self.fetches.l2
        match = l2.tree.match_prefix(keys[:max_pages])
        # Waited for (once, probes.py) only when vLLM tries to admit the request:
        # vLLM's scheduling thread takes arrivals, whose answer is not wanted yet.
        found = self.fetches.lookup(keys, match.num_pages, max_pages, req_id,
                                    known=match.l3_pages, source=request, wait=wait)
        if found is None:
            return  # the probe is still running: advance() asks again
        del self._asking[req_id]
        if found <= 0:
            return
        pages = found
        if pages > self.max_pages - self.reserved_pages():
            # All of the run or none: a part would leave a tail that may be too
            # short to fetch (prefetch_threshold), so vLLM would recompute it. The
            # lookup at admission fetches the whole run instead.
            self.stats.prefetch_skipped += 1
            return
        # The prefix it extends must survive the eviction that makes room for it
        # (as L2Manager.plan_store and L3Fetches.reserve lock before allocating).
        l2.tree.lock(match.node)
        slots = l2.allocate(pages)
        if not slots:
            l2.tree.unlock(match.node)
            self.stats.prefetch_skipped += 1
            return
        fetch_id = prefetch_id(req_id)
        timeout = self.fetches.policy.timeout_s(pages * self.page_size)
        # The worker stops at the timeout policy's deadline; best_effort's
        # prefetch runs to its end (its request does not wait, later ones may).
        self.fetches.start_prefetch(fetch_id, match, keys, slots, timeout or None,
                                    source=request)
        self._running[req_id] = _Prefetch(fetch_id, list(keys[: match.num_pages + pages]),
                                          match.num_pages, pages, self.clock(), timeout)
        self.stats.prefetches += 1
        self.stats.prefetch_pages += pages

    def gate(self, request: SchedulerRequest) -> Gate:
        """What a lookup of ``request`` does about its prefetch (module docstring);
        an arrival lookup that has answered starts the prefetch first."""
        req_id = request.request_id
        if req_id in self._asking:
            self._try_start(request, wait=True)
        prefetch = self._running.get(req_id)
        if prefetch is None:
            return "open"
        if prefetch.fetch_id not in self.fetches.in_flight:
            return "open"  # it ended: its pages are in the tree
        timeout = prefetch.timeout_s
        if timeout is None or self.clock() - prefetch.started < timeout:
            self.stats.prefetch_waits += 1
            return "wait"
        if not prefetch.late:
            prefetch.late = True
            self.stats.prefetch_late += 1
        return "l2_only"

    def prefetched_pages(self, req_id: str, match_pages: int) -> int:
        """Pages of an L2 match of ``match_pages`` that the request's ended prefetch
        brought from L3 (counted as L3 hits: L3 held them when it arrived)."""
        prefetch = self._running.get(req_id)
        if prefetch is None or prefetch.fetch_id in self.fetches.in_flight:
            return 0
        return max(0, min(match_pages, prefetch.start + prefetch.pages) - prefetch.start)

    def settle(self) -> None:
        """After the workers' report: lock what each ended prefetch brought, so it
        stays in L2 until its request is admitted (eviction would waste the read)."""
        tree = self.fetches.l2.tree
        for prefetch in self._running.values():
            if prefetch.settled or prefetch.fetch_id in self.fetches.in_flight:
                continue
            prefetch.settled = True
            match = tree.match_prefix(prefetch.keys)
            if match.num_pages > prefetch.start:
                tree.lock(match.node)
                prefetch.held = match.node

    def admitted(self, req_id: str) -> None:
        """vLLM admitted the request and its load is planned (it locks its own
        pages): it no longer waits on a prefetch."""
        self._asking.pop(req_id, None)
        self._release(self._running.pop(req_id, None))

    def cancel(self, req_id: str) -> None:
        """The request finished or was aborted (see the module docstring)."""
        self._asking.pop(req_id, None)
        prefetch = self._running.pop(req_id, None)
        if prefetch is not None and self.fetches.cancel_planned(prefetch.fetch_id):
            self.stats.prefetch_cancelled += 1
        self._release(prefetch)

    def _release(self, prefetch: _Prefetch | None) -> None:
        # A locked node is never evicted or removed, so it is still in the tree.
        if prefetch is not None and prefetch.held is not None:
            node, prefetch.held = prefetch.held, None
            self.fetches.l2.tree.unlock(node)
