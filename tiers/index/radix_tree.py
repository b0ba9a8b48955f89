"""HiRadixTree: a radix tree over page keys recording which pages each tier holds.

Modelled on SGLang's ``radix_cache.py`` (node, match, insert, split, evict),
but an edge is a list of :data:`~hicache.tiers.index.page_keys.PageKey` instead of
token ids. Page keys are a hash chain, so within one namespace matching key
sequences is matching token sequences, and a key never needs its tokens again.

Contract:

- The tree lives in the scheduler process and moves no data: it records host
  (L2) slots per page; the caller allocates and frees the slots.
- **Prefix closure**: if a node is resident in L2 (``host_slots`` is not
  None) so is its parent; the root counts as resident. In this version every
  non-root node is in L2 (an evicted node leaves the tree); ``host_slots`` is
  Optional because the L3 tier will keep nodes that live only in L3.
- **Locks** (``lock_ref``) pin a node and all its ancestors, root excluded
  (the root is never evicted anyway). Hence an unlocked node has only
  unlocked descendants, and every unlocked page can eventually be evicted.
- **Node handles stay valid across splits**: a split keeps the original
  object as the *lower* half, so a node returned by :meth:`match_prefix` or
  :meth:`insert` still ends at the same page after later splits.
- **Access times** are set on every node along a matched or inserted path,
  so a parent is never older than its children; leaf-first LRU eviction thus
  pops pages in non-decreasing ``last_access`` order.
- ``total_pages`` / ``evictable_pages`` count L2 pages (all / unlocked) and
  are O(1) counters.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from hicache.tiers.index.page_keys import PageKey

_node_ids = itertools.count()


class TreeNode:
    """One edge of the tree: a run of pages with identical residency and locks."""

    __slots__ = (
        "id",
        "keys",
        "parent",
        "children",
        "host_slots",
        "lock_ref",
        "hit_count",
        "last_access",
    )

    def __init__(
        self,
        keys: list[PageKey],
        parent: TreeNode | None,
        host_slots: list[int] | None,
        last_access: float,
    ) -> None:
        self.id: int = next(_node_ids)
        self.keys = keys
        self.parent = parent
        # Keyed by the child's first page key: siblings never share one.
        self.children: dict[PageKey, TreeNode] = {}
        self.host_slots = host_slots
        self.lock_ref = 0
        self.hit_count = 1  # SGLang semantics: creation counts as one hit
        self.last_access = last_access

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, pages={len(self.keys)}, lock_ref={self.lock_ref}, "
            f"hits={self.hit_count}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    node: TreeNode  # ends exactly at the last matched page (root when nothing matched)
    num_pages: int
    host_slots: list[int]  # one per matched page, in order


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode  # ends exactly at the last inserted page
    unused_slots: list[int]  # given slots of pages that were already present: free them
    num_new_pages: int


class HiRadixTree:
    """Page-granular radix tree of L2-resident prefixes; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._clear()

    # ------------------------------------------------------------------ queries

    def total_pages(self) -> int:
        return self._total_pages

    def evictable_pages(self) -> int:
        return self._evictable_pages

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes, root first, depth-first (for debugging and tests)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, keys: Sequence[PageKey]) -> MatchResult:
        """Longest prefix of ``keys`` resident in L2; splits so ``node`` ends at it."""
        now = self._clock()
        node = self.root
        node.last_access = now
        slots: list[int] = []
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None or child.host_slots is None:
                break
            k = _common_prefix_len(child.keys, keys, i)
            if k < len(child.keys):
                child = self._split(child, k)
            child.last_access = now
            assert child.host_slots is not None  # a split gives both halves their slots
            slots.extend(child.host_slots)
            node = child
            i += k
            # A match that ended inside the edge stops next round: the split
            # node's only child starts with a different key.
        return MatchResult(node=node, num_pages=i, host_slots=slots)

    def insert(self, keys: Sequence[PageKey], host_slots: Sequence[int]) -> InsertResult:
        """Record ``keys`` as resident at ``host_slots``; already-present pages keep their slots."""
        if len(keys) != len(host_slots):
            raise ValueError(f"{len(keys)} keys but {len(host_slots)} host slots")
        now = self._clock()
        node = self.root
        node.last_access = now
        unused: list[int] = []
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                child = self._add_leaf(node, list(keys[i:]), list(host_slots[i:]), now)
                return InsertResult(child, unused, len(keys) - i)
            # L3-only nodes arrive with the L3 tier; until then the whole tree is in L2.
            assert child.host_slots is not None
            k = _common_prefix_len(child.keys, keys, i)
            if k < len(child.keys):
                child = self._split(child, k)
            child.hit_count += 1
            child.last_access = now
            unused.extend(host_slots[i : i + k])
            node = child
            i += k
        return InsertResult(node, unused, 0)

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors (root excluded) against eviction."""
        self._check_attached(node)
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.keys)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]  # attached: parent set

    def unlock(self, node: TreeNode) -> None:
        # Locks propagate upwards, so a positive count here implies positive
        # counts on every ancestor: checking this node suffices.
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of unlocked node {node!r}")
        self._check_attached(node)
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += len(node.keys)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> list[int]:
        """Free exactly ``num_pages`` pages if possible: unlocked leaves, LRU first.

        A leaf longer than what is still needed loses only its tail pages, so
        the reusable head of a long history survives. Fewer are freed only
        when nothing unlocked is left. Returns the freed host slots.
        """
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            still_needed = num_pages - len(freed)
            if len(leaf.keys) > still_needed:
                self._split(leaf, len(leaf.keys) - still_needed)  # leaf keeps the tail
            assert leaf.host_slots is not None
            freed.extend(leaf.host_slots)
            parent = self._remove_leaf(leaf)
            # Parents are never older than children, so pushing one keeps the
            # popped sequence in LRU order.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def remove_slots(self, slots: Iterable[int]) -> tuple[list[int], set[int]]:
        """Forget the pages held in ``slots`` and every page below them.

        Used when a slot turned out unusable (failed store, key mismatch):
        its descendants lose their prefix, so they go too. Pages of the same
        node before the first bad one are kept. Returns ``(freed host slots,
        the given slots that sit in locked nodes and were kept for now)``.
        """
        wanted = set(slots)
        freed: list[int] = []
        kept: set[int] = set()
        for node in list(self.iter_nodes()):  # pre-order: parents before children
            if node is self.root or node.parent is None or node.host_slots is None:
                continue
            bad = [i for i, slot in enumerate(node.host_slots) if slot in wanted]
            if not bad:
                continue
            if node.lock_ref:
                kept.update(node.host_slots[i] for i in bad)
                continue
            if bad[0] > 0:
                self._split(node, bad[0])  # node keeps the lower half, from the bad page on
            freed.extend(self._remove_subtree(node))
        return freed, kept

    def reset(self) -> list[int]:
        """Drop every node; returns all host slots. Raises if anything is locked."""
        if self._evictable_pages != self._total_pages:
            raise RuntimeError("cannot reset the tree while nodes are locked")
        slots: list[int] = []
        for node in self.iter_nodes():
            if node is not self.root:
                slots.extend(node.host_slots or ())
                node.parent = None  # outstanding handles become detached
        self._clear()
        return slots

    def _clear(self) -> None:
        self.root = TreeNode([], None, [], self._clock())
        self._leaves: set[TreeNode] = set()  # childless non-root nodes
        self._total_pages = 0
        self._evictable_pages = 0

    # ------------------------------------------------------------------ internals

    def _add_leaf(
        self, parent: TreeNode, keys: list[PageKey], slots: list[int], now: float
    ) -> TreeNode:
        leaf = TreeNode(keys, parent, slots, now)
        parent.children[keys[0]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._total_pages += len(keys)
        self._evictable_pages += len(keys)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.keys[0]]
        leaf.parent = None  # marks the handle detached
        self._leaves.discard(leaf)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        self._total_pages -= len(leaf.keys)
        self._evictable_pages -= len(leaf.keys)
        return parent

    def _remove_subtree(self, top: TreeNode) -> list[int]:
        """Detach ``top`` and its descendants (all unlocked); returns their slots."""
        parent = top.parent
        assert parent is not None and top.lock_ref == 0
        del parent.children[top.keys[0]]
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        slots: list[int] = []
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            slots.extend(node.host_slots or ())
            self._leaves.discard(node)
            self._total_pages -= len(node.keys)
            self._evictable_pages -= len(node.keys)
            node.parent = None  # outstanding handles become detached
        return slots

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` pages; returns the new upper node.

        The original object keeps the lower half so outstanding handles stay
        valid; locks, hits and access time carry over to both halves.
        """
        assert 0 < k < len(child.keys)
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            child.keys[:k],
            parent,
            None if child.host_slots is None else child.host_slots[:k],
            child.last_access,
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.children[child.keys[k]] = child
        parent.children[upper.keys[0]] = upper
        child.keys = child.keys[k:]
        if child.host_slots is not None:
            child.host_slots = child.host_slots[k:]
        child.parent = upper
        return upper

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"{node!r} is no longer in the tree (evicted or reset)")

    def check_invariants(self) -> None:
        """Assert the structural invariants; O(nodes), for tests and debugging."""
        total = evictable = 0
        leaves: set[TreeNode] = set()
        for node in self.iter_nodes():
            for first, child in node.children.items():
                assert child.parent is node, "child/parent link broken"
                assert child.keys and child.keys[0] == first, "child keyed by wrong page"
                assert child.last_access <= node.last_access or node is self.root, (
                    "child newer than parent"
                )
                if child.host_slots is not None:
                    assert node.host_slots is not None, "L2 residency not prefix-closed"
            if node is self.root:
                assert node.lock_ref == 0 and not node.keys and node.host_slots == []
                continue
            # This version: every tree node is in L2.
            assert node.host_slots is not None and len(node.host_slots) == len(node.keys)
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            total += len(node.keys)
            evictable += len(node.keys) if node.lock_ref == 0 else 0
            if not node.children:
                leaves.add(node)
        assert total == self._total_pages, f"total_pages {self._total_pages} != {total}"
        assert evictable == self._evictable_pages, (
            f"evictable_pages {self._evictable_pages} != {evictable}"
        )
        assert leaves == self._leaves, "leaf set out of date"


def _common_prefix_len(edge: Sequence[PageKey], keys: Sequence[PageKey], start: int) -> int:
    n = min(len(edge), len(keys) - start)
    i = 0
    while i < n and edge[i] == keys[start + i]:
        i += 1
    return i
