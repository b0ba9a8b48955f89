"""An L2 eviction that knows the future: ``hicache simulate --eviction oracle``.

Contract:
- ``FutureUses(pages_by_request)`` indexes, for every page key, the positions
  (0, 1, ... in admission order) of the requests whose prompts hold it;
  ``next_use(key, position)`` is the first such position at or after
  ``position`` (``math.inf``: never again).
- ``OracleEviction(uses)`` is Belady's rule on the HiRadixTree's unlocked L2
  leaves: the leaf whose last page is needed again furthest ahead goes first
  (a page never needed again before any other), a long leaf from its tail;
  ties go to the least recently used. The simulator sets ``position`` to the
  request being admitted. A parent is needed no later than its children (a
  prompt that holds a page holds its whole prefix), so the rank never puts a
  parent below a child, as ``HiRadixTree.evict`` requires.
- It bounds what L2 eviction can gain at one size, nothing more: L1 stays
  vLLM's LRU, pins and in-flight pages stay locked, and every page costs the
  same (Belady is exact for unit costs, not for a prefix-closed tree of
  requests that hit all-or-nothing per page run); the headroom it shows is an
  estimate, good for ranking policies, not a proof.
- Used by the simulator only; engine-free.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

from hicache.tiers.controller.policies import EvictionPolicy
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode


class FutureUses:
    """When each page is asked for, by request position (see the module docstring)."""

    def __init__(self, pages_by_request: Iterable[Sequence[PageKey]]) -> None:
        self._uses: dict[PageKey, list[int]] = {}
        for position, keys in enumerate(pages_by_request):
            for key in keys:
                self._uses.setdefault(key, []).append(position)

    def next_use(self, key: PageKey, position: int) -> float:
        uses = self._uses.get(key)
        if not uses:
            return math.inf
        i = bisect.bisect_left(uses, position)
        return uses[i] if i < len(uses) else math.inf


class OracleEviction(EvictionPolicy):
    """Belady's farthest-next-use on L2 leaves (see the module docstring)."""

    name = "oracle"

    def __init__(self, uses: FutureUses) -> None:
        self.uses = uses
        self.position = 0

    def _rank(self, node: TreeNode) -> tuple[float, ...]:
        return (-self.uses.next_use(node.keys[-1], self.position), node.last_access)

    def evict(self, tree: HiRadixTree, num_pages: int) -> list[int]:
        return tree.evict(num_pages, rank=self._rank)
