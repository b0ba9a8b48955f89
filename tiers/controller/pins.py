"""Pins: prefixes kept in L2 ahead of LRU until a deadline (a request's ``retain_s``,
the admin's ``POST /pin``).

Contract:
- ``pin(keys, ttl_s)`` locks the L2-resident prefix of ``keys`` in the
  HiRadixTree (the node at the end of its match and every ancestor: eviction
  skips locked nodes) until ``ttl_s`` seconds from now, named by that prefix's
  last page key (the same prefix pinned twice is one pin whose deadline is the
  later one). Returns the pages pinned (0: none of it is in L2).
- Bounded: the pages of all pins never exceed ``max_share`` of L2
  (``hicache_retain_max_share``, half by default), so retention never starves
  other traffic; a pin that would pass the bound raises ``PinRefused`` and
  changes nothing. A pin of a prefix that extends pinned prefixes whose
  deadlines are no later than its own replaces them (a session's next turn
  extends its last one): their pages count once. Other overlapping pins (a
  shared system prompt under two sessions) count their shared pages once per
  pin: the bound is conservative.
- Pins give way to fetches: ``yield_to(pages, room)`` ends pins, soonest
  deadline first, until ``room()`` (L2 pages an allocation could take) reaches
  ``pages`` or no pin is left; the scheduler calls it when an L3 fetch finds
  L2 short, so retention never turns another request's L3 hit into a
  recompute. Stores and prefetches never end pins. ``stats()["yielded"]``
  counts the pins ended so.
- ``release_under(tops)`` ends the pins inside a subtree a flush or forget
  removes; ``release_all()`` every pin (L2 emptied).
- ``expire()`` unlocks every pin whose deadline has passed; the scheduler calls
  it before every plan (eviction happens only while planning) and the admin
  before it reports, so an expired pin is never seen and never protects a page
  past its deadline. It costs the pins it ends, not all pins: deadlines wait
  in a heap (an entry whose pin has ended or moved its deadline is dropped when
  it comes up). ``unpin(keys)`` ends the pin of that prefix now.
- ``stats()``: pins, pinned pages, the bound, seconds to the next expiry.
- Engine-free; the clock is injected (tests drive it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode

# Share of L2 that pins may hold (hicache_retain_max_share's default).
MAX_SHARE = 0.5


class PinRefused(ValueError):
    """The pin would pass the share of L2 pins may hold."""


@dataclass
class _Pin:
    node: TreeNode
    pages: int
    expires: float


class Pins:
    """Prefixes locked in L2 until their deadlines (see the module docstring)."""

    def __init__(self, tree: HiRadixTree, capacity_pages: int, *, max_share: float = MAX_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tree = tree
        self.max_pages = int(capacity_pages * max_share)
        self.max_share = max_share
        self.clock = clock
        self._pins: dict[str, _Pin] = {}
        # (deadline, name) of every pin, and stale entries of pins ended or extended
        self._deadlines: list[tuple[float, str]] = []
        self.yielded = 0

    @staticmethod
    def name_of(keys: Sequence[PageKey]) -> str:
        return keys[-1].hex() if keys else ""

    @property
    def pinned_pages(self) -> int:
        return sum(p.pages for p in self._pins.values())

    def _add(self, name: str, pin: _Pin) -> None:
        self._pins[name] = pin
        self._push(name, pin.expires)

    def _push(self, name: str, expires: float) -> None:
        heapq.heappush(self._deadlines, (expires, name))
        if len(self._deadlines) > 2 * len(self._pins) + 64:  # mostly stale: rebuild
            self._deadlines = [(p.expires, n) for n, p in self._pins.items()]
            heapq.heapify(self._deadlines)

    def _end(self, name: str) -> _Pin:
        """Forget the pin ``name`` and unlock its prefix."""
        pin = self._pins.pop(name)
        self.tree.unlock(pin.node)
        return pin

    def pin(self, keys: Sequence[PageKey], ttl_s: float) -> int:
        self.expire()
        match = self.tree.match_prefix(keys)
        if match.num_pages == 0:
            return 0
        name = self.name_of(keys[: match.num_pages])
        expires = self.clock() + ttl_s
        held = self._pins.get(name)
        if held is not None:
            if expires > held.expires:
                held.expires = expires
                self._push(name, expires)
            return held.pages
        covered = self._covered(match.node, expires)
        freed = sum(self._pins[c].pages for c in covered)
        if self.pinned_pages - freed + match.num_pages > self.max_pages:
            raise PinRefused(
                f"pinning {match.num_pages} pages would hold more than "
                f"hicache_retain_max_share={self.max_share} of L2 ({self.max_pages} pages; "
                f"{self.pinned_pages} pinned now)")
        self.tree.lock(match.node)
        for c in covered:
            self._end(c)
        self._add(name, _Pin(match.node, match.num_pages, expires))
        return match.num_pages

    def _covered(self, node: TreeNode, expires: float) -> list[str]:
        """Pins of prefixes of ``node``'s (itself excluded) ending no later than ``expires``."""
        out = []
        up = node.parent
        while up is not None and up.keys:
            name = self.name_of(up.keys)
            pin = self._pins.get(name)
            if pin is not None and pin.node is up and pin.expires <= expires:
                out.append(name)
            up = up.parent
        return out

    def unpin(self, keys: Sequence[PageKey]) -> int:
        """End the pin of the L2 prefix of ``keys`` now; the pages it held (0: none)."""
        self.expire()
        match = self.tree.peek(keys)
        name = self.name_of(keys[:match]) if match else None
        if name is None or name not in self._pins:
            return 0
        return self._end(name).pages

    def yield_to(self, pages: int, room: Callable[[], int]) -> int:
        """End pins, soonest deadline first, until ``room() >= pages``; how many."""
        self.expire()
        ended = 0
        for name in sorted(self._pins, key=lambda n: self._pins[n].expires):
            if room() >= pages:
                break
            self._end(name)
            ended += 1
        self.yielded += ended
        return ended

    def expire(self) -> int:
        """Unlock the pins whose deadline has passed; how many."""
        now = self.clock()
        ended = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            expires, name = heapq.heappop(self._deadlines)
            pin = self._pins.get(name)
            if pin is not None and pin.expires == expires:  # else ended, or extended
                self._end(name)
                ended += 1
        return ended

    def release_all(self) -> int:
        """End every pin now (L2 is being emptied); how many."""
        count = len(self._pins)
        for name in list(self._pins):
            self._end(name)
        self._deadlines = []
        return count

    def release_under(self, tops: Sequence[TreeNode]) -> int:
        """End the pins of prefixes that run through one of ``tops`` (a subtree that
        is being flushed or forgotten); how many."""
        if not tops:
            return 0
        wanted = set(map(id, tops))
        done = []
        for name, pin in self._pins.items():
            node: TreeNode | None = pin.node
            while node is not None and id(node) not in wanted:
                node = node.parent
            if node is not None:
                done.append(name)
        for name in done:
            self._end(name)
        return len(done)

    def stats(self) -> dict[str, Any]:
        self.expire()
        now = self.clock()
        nearest = min((p.expires for p in self._pins.values()), default=None)
        return {"pins": len(self._pins), "pinned_pages": self.pinned_pages,
                "max_pages": self.max_pages, "yielded": self.yielded,
                "next_expiry_s": None if nearest is None else round(nearest - now, 3)}
