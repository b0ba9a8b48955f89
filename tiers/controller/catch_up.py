"""L3 catch-up: back up in the background the pages L2 holds and L3 lacks, hottest first.

Contract:
- Write-through backs a page up to L3 when L2 stores it (stores.py). A page
  that was already in L2 when L3 was flushed or attached, whose backup failed
  or was dropped, or that was stored while L3 was away, is never stored
  again while it stays hot, so L3 would lack exactly the pages a restart
  needs most. ``L3CatchUp.plan`` finds such pages in the HiRadixTree
  (L2-resident, not known in L3, wanted by the L3 admission rule, with L3
  keys: kv_groups.py ``l3_keys``) and returns them for the step's plan
  (``L2Manager.back_up``: page objects, backed up from their L2 slots).
- Order: higher eviction class first, then most recently used; a parent
  before its children (an L3 page is only found after its whole prefix).
- Share: a plan gets catch-up pages only while the workers' L3 I/O has
  nothing else to do: no L3 fetch in flight, every rank's backup queue empty
  as last reported; and at most ``max_in_flight`` of them are queued and not
  yet reported backed up. The I/O thread runs fetches before backups
  (tiers/worker/l3_io.py), so a fetch that arrives meanwhile waits at most
  for the batch being written.
- Every backup a plan carries (the stores' and the catch-up's) is in flight
  from ``note_planned`` until the workers report it (``backed_up``) or
  ``retry_s`` passes (a failed or dropped backup); then the page is a
  candidate again, at most ``MAX_TRIES`` times until L3 changes (``reset``:
  an attach, a detach or a flush of L3).
- Cost: a scan walks the L2 part of the tree and queues what it found, in
  order; later plans take from that queue, checking each page again (still
  in L2, not in L3 nor in flight, still fit), so a large backlog costs one
  walk, not one per plan. A scan runs when L2 holds more pages that L3 lacks
  than are in flight or were found unfit, and then only after an L3 change
  (or a forget), or once the queue is empty and ``rescan_s`` has passed
  since the last one (pages admitted or stored since then). A backup in
  flight that expired goes back to the queue's head.
- ``has_work`` (an idle engine steps while it holds) is true while the queue
  or the catch-up's backups in flight are not empty, or while L2 holds
  lacking pages not known unfit and either backups are in flight (so an
  expiry is seen) or the next plan would scan: an engine that goes idle as
  L3 is flushed or attached still backs L2 up.
- ``backlog``: pages queued by the last scan and not yet taken, plus the
  catch-up's in flight (``/stats`` ``tiers.l3.backlog_pages``).
- Not for models with Mamba state groups: the tree does not index their L3
  pages (``L2Manager.l3_index``), so there is nothing to compare.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from hicache.tiers.controller.policies import L3Admission
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.plans import PagePlan
from hicache.tiers.index.tree_node import TreeNode

if TYPE_CHECKING:
    from hicache.tiers.controller.l2_manager import L2Manager

# Catch-up pages queued and not yet reported backed up, by default.
DEFAULT_MAX_IN_FLIGHT = 64
# Times a page is queued by the catch-up before it gives up on it until L3 changes.
MAX_TRIES = 3
# Backups remembered as in flight (the oldest are forgotten beyond this).
MAX_TRACKED = 1 << 16


class L3CatchUp:
    """Which L2 pages the next plans back up to L3 (see the module docstring)."""

    def __init__(self, l2: L2Manager, admission: L3Admission, stats: SchedulerStats, *,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, retry_s: float = 10.0,
                 rescan_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {max_in_flight}")
        self.l2 = l2
        self.admission = admission
        self.max_in_flight = max_in_flight
        self.retry_s = retry_s
        self.rescan_s = rescan_s
        self._stats = stats
        self._clock = clock
        # page key -> when a plan carried its backup (oldest first).
        self._in_flight: OrderedDict[PageKey, float] = OrderedDict()
        # The catch-up's own pages among them.
        self._mine: set[PageKey] = set()
        self._tries: dict[PageKey, int] = {}
        # Pages to back up next, hottest first: the last scan's candidates not yet
        # taken and expired backups (checked again when taken).
        self._queue: deque[PageKey] = deque()
        # Pages found unfit since the last scan (not admitted, no L3 keys, given
        # up), and when that scan ran.
        self._unfit = 0
        self._last_scan = float("-inf")

    @property
    def enabled(self) -> bool:
        return self.max_in_flight > 0 and self.l2.l3_index

    @property
    def backlog(self) -> int:
        """Pages queued and not yet taken, plus the catch-up's in flight."""
        return len(self._queue) + len(self._mine)

    def has_work(self) -> bool:
        """Catch-up backups are in flight or queued; or L2 holds pages L3 lacks beyond
        those found unfit, and either backups are in flight (one may never report:
        dropped with its slot, failed, reported before an L3 change; only a later
        plan, after ``retry_s``, can tell) or the next plan would scan for them
        (after an L3 change, or ``rescan_s``). An idle engine steps while this
        holds."""
        if not self.enabled:
            return False
        if self._mine or self._queue:
            return True
        lacking = self._lacking()
        if lacking <= self._unfit:
            return False
        return bool(self._in_flight) or (
            self._clock() - self._last_scan >= self.rescan_s)

    def _lacking(self) -> int:
        """L2 pages the tree does not know in L3."""
        tree = self.l2.tree
        return tree.total_pages() - (tree.l3_pages() - tree.l3_only_pages())

    def note_planned(self, plans: Iterable[PagePlan]) -> None:
        """A plan carries these pages' stores or backups: those with L3 keys are
        in flight to L3 until reported (or ``retry_s``)."""
        now = self._clock()
        for plan in plans:
            if plan.l3_keys:
                key = PageKey(plan.key)
                self._in_flight[key] = now
                self._in_flight.move_to_end(key)
        while len(self._in_flight) > MAX_TRACKED:
            key, _ = self._in_flight.popitem(last=False)
            self._mine.discard(key)

    def backed_up(self, keys: Iterable[PageKey]) -> None:
        """Every writing rank reported these pages stored in L3."""
        self._settle(keys)

    def forget(self, keys: Iterable[PageKey]) -> None:
        """L3 lost these pages (a partial flush, a forget): what was in flight of them
        was dropped, and they may be tried again; the next plan scans."""
        self._settle(keys)
        self._last_scan = float("-inf")

    def _settle(self, keys: Iterable[PageKey]) -> None:
        """These pages are no longer in flight, and their tries start over."""
        for key in keys:
            self._in_flight.pop(key, None)
            self._mine.discard(key)
            self._tries.pop(key, None)

    def reset(self) -> None:
        """L3 changed (attached, detached, flushed): what was in flight is dropped or
        went to another store, and every page may be tried again."""
        self._in_flight.clear()
        self._mine.clear()
        self._tries.clear()
        self._queue.clear()
        self._unfit = 0
        self._last_scan = float("-inf")

    def plan(self, *, io_idle: bool) -> list[tuple[PageKey, int]]:
        """(key, slot) of the L2 pages to back up with this step's plan; ``io_idle``:
        no L3 fetch in flight and every rank's backup queue empty."""
        if not self.enabled:
            return []
        now = self._clock()
        self._expire(now)
        room = self.max_in_flight - len(self._mine)
        if not io_idle or room <= 0:
            return []
        if self._lacking() <= len(self._in_flight) + self._unfit:
            self._queue.clear()  # what it holds is in L3 or in flight by now
            return []
        if self._last_scan == float("-inf") or (
                not self._queue and now - self._last_scan >= self.rescan_s):
            self._last_scan = now
            self._scan()
        picked = self._take(room)
        for key, _ in picked:
            self._in_flight[key] = now
            self._in_flight.move_to_end(key)
            self._mine.add(key)
            self._tries[key] = self._tries.get(key, 0) + 1
        self._stats.l3_catch_up_pages += len(picked)
        return picked

    def _expire(self, now: float) -> None:
        """Backups in flight for ``retry_s`` never reported: back to the queue's head,
        in the order they were planned (parents first)."""
        expired: list[PageKey] = []
        while self._in_flight:
            key, since = next(iter(self._in_flight.items()))
            if now - since < self.retry_s:
                break
            del self._in_flight[key]
            self._mine.discard(key)
            expired.append(key)
        self._queue.extendleft(reversed(expired))

    def _fit(self, key: PageKey, slot: int) -> bool:
        """Whether the catch-up may back this L2 page up (tries left, admitted, has
        L3 keys)."""
        return (self._tries.get(key, 0) < MAX_TRIES and self.admission.wants(key)
                and bool(self.l2.groups.l3_keys(key, self.l2.missing_of(slot))))

    def _scan(self) -> None:
        """Queue every fit page L2 holds and L3 lacks, not in flight, hottest first;
        count the unfit ones."""
        nodes = sorted(self._lacking_nodes(), key=lambda n: (n.priority, n.last_access),
                       reverse=True)  # stable: parents stay before their children
        queue: deque[PageKey] = deque()
        unfit = 0
        for node in nodes:
            assert node.host_slots is not None
            for key, slot, in_l3 in zip(node.keys, node.host_slots, node.in_l3, strict=True):
                if in_l3 or key in self._in_flight:
                    continue
                if self._fit(key, slot):
                    queue.append(key)
                else:
                    unfit += 1
        self._queue, self._unfit = queue, unfit

    def _take(self, room: int) -> list[tuple[PageKey, int]]:
        """Up to ``room`` pages off the queue's head that still need a backup: in L2,
        not in L3 nor in flight, fit (an unfit one counts as such)."""
        tree = self.l2.tree
        positions: dict[TreeNode, dict[PageKey, int]] = {}
        picked: list[tuple[PageKey, int]] = []
        while self._queue and len(picked) < room:
            key = self._queue.popleft()
            node = tree.node_of(key)
            if node is None or node.host_slots is None or key in self._in_flight:
                continue
            at = positions.get(node)
            if at is None:
                at = positions[node] = {k: j for j, k in enumerate(node.keys)}
            j = at[key]
            if node.in_l3[j]:
                continue
            slot = node.host_slots[j]
            if self._fit(key, slot):
                picked.append((key, slot))
            else:
                self._unfit += 1
        return picked

    def _lacking_nodes(self) -> list[TreeNode]:
        """L2-resident nodes with a page L3 lacks, parents before children (the
        L3-only part of the tree is not walked: it only has L3-only nodes)."""
        out: list[TreeNode] = []
        stack = [c for c in self.l2.tree.root.children.values() if c.host_slots is not None]
        stack.reverse()
        while stack:
            node = stack.pop()
            if not all(node.in_l3):
                out.append(node)
            kids = [c for c in node.children.values() if c.host_slots is not None]
            kids.reverse()
            stack.extend(kids)
        return out
