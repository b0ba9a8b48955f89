"""L3 hits: the lookup past the L2 match, and the life of each fetch from L3 into L2.

Contract:
- The lookup walks the HiRadixTree first: the pages after the L2 match that
  the tree knows L3 holds (backed up, fetched or found before; see
  l2_manager.py) need no store round trip, except where the store keeps span
  objects: a page inside one is readable only by requests sharing that whole
  span, which the tree, indexed page by page, cannot tell, so the store is
  asked for the whole run. Only the pages after those are
  asked of the store (its ``exists_prefix``, as SGLang asks before every
  prefetch), and what it finds enters the tree. With ``probes`` (the
  connector's setting) and a store whose lookups may run concurrently, the
  question runs in the background (tiers/controller/probes.py) and
  ``lookup`` answers None until it is known; models with Mamba state groups
  (no L3 index) and other stores are asked inline. The lookup asks the
  scheduler's own view of the store (``L3Store``: one backend, or
  ``RankShards``, the shortest run over every rank's shard; MLA has one
  shared shard), so no rank is promised pages it lacks. Runs shorter than
  ``prefetch_threshold`` tokens are not worth a fetch, and no more pages are
  promised than L2 could hold now. A failing store is a miss, never an
  engine error.
- Such a hit is asynchronous: vLLM parks the request in
  WAITING_FOR_REMOTE_KVS; the L2 prefix it extends stays locked and L2
  slots are reserved for the L3 pages (``reserve``), and the worker fetches
  and loads on its I/O thread within the prefetch policy's timeout
  (``policies.py``).
- Models with Mamba state groups: L3 holds every page's body (every group
  but the state ones, ``page_keys.body_key``) and the pages with a state
  checkpoint whole; a run is looked up over bodies and ends on the last
  page of it (at most ``CHECKPOINT_PROBES`` from its end) held whole. Its
  pages are read from their bodies, the last one whole, and enter the tree
  without their state but the last.
- Every L3 page after the L2 match is fetched, also those vLLM's own prefix
  cache covers (no blocks to fill), so what enters the tree is a contiguous
  extension of the locked prefix.
- When every TP rank has reported the fetch, the pages all of them got (the
  minimum) enter the tree, L2-resident; the other reserved slots are freed
  and the prefix unlocked (``L2Manager.publish_fetched``). A request whose
  fetch came short is remembered (``came_short``): with several KV-cache
  groups vLLM recomputes it from its first token and looks it up again, and
  that lookup does not ask L3 a second time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hicache.tiers.controller.events import EventRequest
from hicache.tiers.controller.l2_manager import L2Manager
from hicache.tiers.controller.policies import PrefetchPolicy, PrefetchSettings
from hicache.tiers.controller.probes import L3Probes
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.page_keys import PageKey, body_key
from hicache.tiers.index.plans import PagePlan, RequestFetch
from hicache.tiers.index.spans import SpanLayout
from hicache.tiers.index.tree_node import MatchResult, TreeNode

logger = logging.getLogger(__name__)

# How far back from the end of an L3 run of bodies a lookup asks for a page
# held whole (a Mamba checkpoint): one exists_prefix call each.
CHECKPOINT_PROBES = 4
# Ended prefetches whose page counts are kept (L3Fetches.ended).
ENDED_KEPT = 4096


class L3Store(Protocol):
    """The scheduler's view of L3 (a ``StorageBackend`` or ``RankShards``). The
    scheduler only looks pages up; the admin flushes and swaps it."""

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` (hex page keys) the store holds."""
        ...

    def delete(self, keys: Sequence[str]) -> int: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


def can(storage: object, capability: str) -> bool:
    """Whether ``storage`` (an ``L3Store``, or None) has ``capability``, a field of
    tiers/l3/base.py ``Capabilities`` (read by name: the planner imports no torch)."""
    return bool(getattr(getattr(storage, "capabilities", None), capability, False))


@dataclass
class InflightFetch:
    """The scheduler's side of a ``RequestFetch`` until every rank reported it."""

    # End of the locked L2 prefix the fetch extends (root: none).
    node: TreeNode
    prefix_keys: list[PageKey]
    # The L3 pages, in order, and the L2 slots reserved for them.
    keys: list[PageKey]
    slots: list[int]
    # Pages fetched, one entry per rank that reported.
    reports: list[int] = field(default_factory=list)
    # Residency of the L3 pages once in L2 (empty: complete).
    masks: list[int] = field(default_factory=list)
    # A prefetch at arrival (no request waits on it in vLLM).
    prefetch: bool = False
    # The request whose pages these are (KV events; tiers/controller/events.py).
    source: EventRequest | None = None


class RoomYielder(Protocol):
    """L2 pages held back from eviction that give way to a fetch (pins.py)."""

    @property
    def pinned_pages(self) -> int: ...

    def yield_to(self, pages: int, room: Callable[[], int]) -> int: ...


class L3Fetches:
    """L3 lookups and the fetches in flight (see the module docstring)."""

    def __init__(self, l2: L2Manager, stats: SchedulerStats, *, storage: L3Store | None,
                 policy: PrefetchPolicy, settings: dict[str, float], page_size: int,
                 tp_size: int, probes: L3Probes | None = None,
                 yielding: RoomYielder | None = None) -> None:
        self.l2 = l2
        # What gives way to a fetch short of L2 room (the scheduler's pins).
        self.yielding = yielding
        # None = no L3; the admin may attach or detach one at any time.
        self.storage = storage
        self.policy = policy
        # hicache storage settings; ``prefetch_threshold`` (tokens) is read at
        # every lookup, so it may be changed on a live scheduler.
        self.settings = settings
        self.page_size = page_size
        self.tp_size = tp_size
        self.in_flight: dict[str, InflightFetch] = {}
        # Requests whose last fetch got fewer L3 pages than planned.
        self.came_short: set[str] = set()
        self._stats = stats
        self._planned: list[RequestFetch] = []
        # Prefetches that ended, newest last: fetch id -> pages that reached L2 (the
        # admin's prefetch operations read them, prefetch_ops.py).
        self.ended: OrderedDict[str, int] = OrderedDict()
        # Background lookups (None: every lookup inline).
        self.probes = probes

    def is_fetching(self, req_id: str) -> bool:
        return req_id in self.in_flight

    def lookup(self, keys: Sequence[PageKey], start: int, end: int, req_id: str = "",
               known: int = 0, source: EventRequest | None = None,
               wait: bool = True) -> int | None:
        """Pages of ``keys[start:end]`` (after the L2 match ``keys[:start]``) that L3
        holds consecutively and that are worth fetching; None while a background
        lookup for ``req_id`` is not finished. ``known``: how many of them the tree
        already knows L3 holds (``MatchResult.l3_pages``); only the rest is asked
        of the store, and what it finds is recorded in the tree."""
        run = list(keys[start:end])
        if self.storage is None or not run:
            return 0
        tokens = self.settings.get("prefetch_threshold",
                                   PrefetchSettings.default("prefetch_threshold"))
        threshold = max(1, -(-int(tokens) // self.page_size))
        if len(run) < threshold:
            return 0
        checkpoints = self.l2.groups.has_state
        # The tree indexes L3 page by page, but a page stored inside a span object is
        # readable only by requests that share that whole span (its key is its last
        # page's): where the store keeps spans, the store itself says what this
        # request can read (spans.py run_in_store), never the tree.
        trusted = self.l2.l3_index and not self.l2.spans.enabled
        known = min(known, len(run)) if trusted else 0
        if known == len(run):
            self._stats.l3_lookups_from_tree += 1
            found = known
        elif (self.probes is not None and not checkpoints
                and can(self.storage, "concurrent_lookups")):
            started = self.probes.started
            answer = self.probes.result(req_id, run[known:], self.storage,
                                        self._span_count(keys, start + known, end), wait)
            self._stats.l3_lookups += self.probes.started - started
            if answer is None:
                self._stats.l3_lookups_pending += 1
                return None
            more, failed = answer
            if failed:
                self._stats.l3_lookup_errors += 1
            found = known + more
        else:
            found = known + self._ask(run[known:], checkpoints,
                                      self._span_count(keys, start + known, end))
        if found > known:
            self.l2.found_in_l3(keys[: start + found], start + known, source)
        # The fetched pages need L2 slots: never promise more than L2 can hold now
        # (pins included: they give way in ``reserve``).
        found = min(found, self._room())
        return found if found >= threshold else 0

    def _span_count(self, keys: Sequence[PageKey], start: int, end: int,
                    ) -> Callable[[], int] | None:
        """How to count the run ``keys[start:end]`` through span objects as well as
        page objects (tiers/index/spans.py); None where L3 objects are single pages."""
        storage, spans = self.storage, self.l2.spans
        if storage is None or not spans.enabled or self.l2.groups.has_state:
            return None
        return lambda: spans.run_in_store(storage.exists_prefix, keys, start, end)

    def _ask(self, run: Sequence[PageKey], checkpoints: bool,
             count: Callable[[], int] | None = None) -> int:
        """How many leading pages of ``run`` the store holds, asked inline (0 on error);
        ``count``: the span-aware question for the same run (``_span_count``)."""
        self._stats.l3_lookups += 1
        try:
            if count is not None:
                return count()
            wanted = [body_key(k) if checkpoints else k for k in run]
            assert self.storage is not None
            found = self.storage.exists_prefix([k.hex() for k in wanted])
            if checkpoints:
                found = self._last_checkpoint(run, min(found, self._room()))
            return int(found)
        except Exception:  # noqa: BLE001 - a failing L3 is a miss, never an engine error
            logger.exception("HiCache: L3 lookup failed; treating as a miss")
            self._stats.l3_lookup_errors += 1
            return 0

    def _last_checkpoint(self, keys: Sequence[PageKey], found: int) -> int:
        """The longest run of the first ``found`` pages whose last page L3 holds whole."""
        assert self.storage is not None
        for end in range(found, max(found - CHECKPOINT_PROBES, 0), -1):
            if self.storage.exists_prefix([keys[end - 1].hex()]):
                return end
        return 0

    def _room(self) -> int:
        """L2 pages a fetch could get now, counting what pins would give up."""
        return self.l2.room() + (self.yielding.pinned_pages if self.yielding else 0)

    def reserve(self, req_id: str, node: TreeNode, pages: int) -> list[int]:
        """Lock the L2 prefix ending at ``node`` (until the fetch ends) and reserve
        slots for ``pages`` L3 pages after it; [] when L2 has no room now. When L2
        is short, pins give way first (``yielding``, pins.py)."""
        self.l2.tree.lock(node)
        if not pages:
            return []
        if self.yielding is not None and self.l2.room() < pages:
            self.yielding.yield_to(pages, self.l2.room)
        slots = self.l2.allocate(pages) or []
        if not slots:
            logger.warning("HiCache: no L2 room for %d L3 pages of request %s; "
                           "recomputing them", pages, req_id)
        return slots

    def start(self, req_id: str, match: MatchResult, keys: Sequence[PageKey],
              l3_slots: list[int], pages: Sequence[PagePlan],
              unloadable: tuple[int, ...], source: EventRequest | None = None,
              ) -> RequestFetch:
        """Plan the fetch of the L3 pages reserved by ``reserve`` after ``match``:
        ``pages`` are the copies of the hit into the request's blocks (L2 pages
        first, then L3 pages), ``keys`` the request's page keys."""
        slots = list(match.host_slots) + l3_slots
        mine = set(l3_slots)
        planned = {p.slot: p for p in pages}
        l3_plans = tuple(
            planned.get(slots[page], PagePlan(slots[page], keys[page], 0, ()))
            for page in range(match.num_pages, len(slots))
        )
        if self.l2.spans.enabled:
            refs = self.l2.spans.refs(keys, match.num_pages, len(slots))
            l3_plans = tuple(dataclasses.replace(p, span=ref)
                             for p, ref in zip(l3_plans, refs, strict=True))
        masks: list[int] = []
        if self.l2.groups.has_state and l3_plans:
            # Bodies, and the run's last page whole (see the module docstring).
            l3_plans = tuple(dataclasses.replace(p, l3_key=body_key(p.key))
                             for p in l3_plans[:-1]) + l3_plans[-1:]
            masks = [self.l2.groups.state_mask] * (len(l3_plans) - 1) + [0]
        fetch = RequestFetch(
            req_id, tuple(p for p in pages if p.slot not in mine), l3_plans, unloadable,
            self.policy.timeout_s(len(l3_slots) * self.page_size),
        )
        self._planned.append(fetch)
        self.in_flight[req_id] = InflightFetch(
            match.node, list(keys[: match.num_pages]),
            list(keys[match.num_pages : match.num_pages + len(l3_slots)]), l3_slots,
            masks=masks, source=source,
        )
        return fetch

    def start_prefetch(self, fetch_id: str, match: MatchResult, keys: Sequence[PageKey],
                       slots: list[int], timeout_s: float | None,
                       source: EventRequest | None = None) -> RequestFetch:
        """Plan a prefetch at arrival (``fetch_id``: ``plans.prefetch_id``): the L3
        pages after ``match`` (its node locked) into ``slots``, no blocks, for at
        most ``timeout_s`` on the worker; it ends like a fetch (``on_report``), its
        pages entering the tree."""
        spans = SpanLayout() if self.l2.groups.has_state else self.l2.spans
        refs = spans.refs(keys, match.num_pages, match.num_pages + len(slots))
        l3_plans = tuple(PagePlan(slot, keys[match.num_pages + i], 0, (), span=refs[i])
                         for i, slot in enumerate(slots))
        fetch = RequestFetch(fetch_id, (), l3_plans, (), timeout_s, prefetch=True)
        self._planned.append(fetch)
        self.in_flight[fetch_id] = InflightFetch(
            match.node, list(keys[: match.num_pages]),
            list(keys[match.num_pages : match.num_pages + len(slots)]), slots,
            prefetch=True, source=source)
        return fetch

    def cancel_planned(self, fetch_id: str) -> bool:
        """Drop a fetch not yet handed to the workers: its slots are freed and its
        prefix unlocked. False when it has already left (it then ends normally)."""
        planned = [f for f in self._planned if f.req_id == fetch_id]
        if not planned or fetch_id not in self.in_flight:
            return False
        self._planned = [f for f in self._planned if f.req_id != fetch_id]
        fetch = self.in_flight.pop(fetch_id)
        self.l2.publish_fetched(fetch.node, fetch.prefix_keys, fetch.keys, fetch.slots, 0,
                                tried=False)
        return True

    def is_planned(self, fetch_id: str) -> bool:
        """Planned, not yet handed to the workers in a plan."""
        return any(f.req_id == fetch_id for f in self._planned)

    def take(self) -> list[RequestFetch]:
        """The fetches planned since the last plan."""
        planned, self._planned = self._planned, []
        return planned

    def on_report(self, fetched: Mapping[str, list[int]]) -> None:
        """Record the ranks' fetch reports; end each fetch every rank has reported."""
        for req_id, counts in fetched.items():
            fetch = self.in_flight.get(req_id)
            if fetch is None:
                continue
            fetch.reports.extend(counts)
            if len(fetch.reports) >= self.tp_size:
                self._finish(req_id, min(fetch.reports))

    def _finish(self, req_id: str, fetched: int) -> None:
        """Every rank has the fetch's first ``fetched`` L3 pages in L2: publish them."""
        fetch = self.in_flight.pop(req_id)
        if fetch.prefetch:
            self.ended[req_id] = fetched
            self.ended.move_to_end(req_id)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        if fetched < len(fetch.slots) and not fetch.prefetch:
            self.came_short.add(req_id)
        self._stats.l3_fetched_pages += fetched
        self._stats.l3_failed_pages += len(fetch.slots) - fetched
        masks = list(fetch.masks)
        if self.l2.groups.has_state and fetched < len(fetch.slots):
            masks[:fetched] = [self.l2.groups.state_mask] * fetched  # the checkpoint never came
        self.l2.publish_fetched(fetch.node, fetch.prefix_keys, fetch.keys, fetch.slots,
                                fetched, masks, source=fetch.source)
