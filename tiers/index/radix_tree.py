"""HiRadixTree: a radix tree over page keys recording which pages L2 and L3 hold.

Modelled on SGLang's ``radix_cache.py`` / ``hiradix_cache.py`` (node, match,
insert, split, evict, host and storage residency), but an edge is a list of
:data:`~hicache.tiers.index.page_keys.PageKey` instead of token ids. Page keys
are a hash chain, so within one namespace matching key sequences is matching
token sequences, and a key never needs its tokens again.

Contract:

- The tree lives in the scheduler process and moves no data: it records host
  (L2) slots per node and, per page, whether L3 holds it (``in_l3``); the
  caller allocates and frees the slots and tells it what L3 holds.
- **Every page of the tree is in L2 or in L3.** A node is L2-resident
  (``host_slots`` is a list) or L3-only (``host_slots`` is None, every page
  ``in_l3``). An L2-resident node's pages may or may not be in L3 as well.
- **Prefix closure**: the parent of an L2-resident node is L2-resident (the
  root counts as resident), so L3-only nodes only have L3-only descendants.
  Every page's whole prefix is in the tree (in one tier or the other).
- L3 residency is this engine's knowledge, not the store's truth: it is set
  when a backup or a fetch succeeded or a lookup found the page
  (``mark_l3``, ``mark_l3_keys``) and cleared on flush or a failed fetch
  (``unmark_l3_keys``, ``drop_subtrees``). Another engine or the store's own
  eviction may remove a page meanwhile: a fetch of it then fails and the
  caller recomputes (never wrong bytes: L3 checks every page).
- **Locks** (``lock_ref``) pin an L2-resident node and all its ancestors,
  root excluded. Hence an unlocked node has only unlocked descendants, every
  unlocked L2 page can eventually be evicted, and L3-only nodes are never
  locked.
- **Eviction from L2** (``evict``) takes unlocked L2 leaves (L2-resident
  nodes without an L2-resident child), lowest ``priority`` first and least
  recently used within a priority (or by a caller's ``rank``). Each node
  counts the pages below it that eviction took since it last gained an L2
  child (``tail_lost``: the tail of its conversation a returning turn would
  recompute; the ``tlru`` policy ranks by it). A node
  whose pages L3 holds stays in the tree as L3-only; from its first page
  that L3 does not hold on, it leaves the tree with its subtree.
- Eviction keeps its heap of L2 leaves between calls when the rank only
  rises while a node stays an L2 leaf (the default rank, or a caller's with
  ``rank_rises``): a node enters it when it becomes a leaf, and a popped
  entry whose rank rose since is pushed again with the new one, so a call
  costs O(pages freed + stale entries) log n instead of a scan of every leaf
  (``demote``, the one way a rank falls, drops the heap; it is rebuilt once
  stale entries outnumber the leaves).
- The L3-only part of the index is bounded (``max_l3_only_pages``): beyond
  it, least recently used L3-only leaves are forgotten (the store still
  holds them; a lookup finds them again).
- **Priorities** (eviction classes, small ints; ``DEFAULT_PRIORITY`` when
  nobody says): ``insert(..., priority=p)`` gives new pages ``p`` and raises
  every page on the path to at least ``p``; ``raise_priority`` raises a
  present prefix. Priorities only rise (until a page leaves the tree), except
  that ``demote`` lowers a whole subtree (a closed session's own pages), so a
  parent's is never below a child's, so leaf-first eviction keeps popping
  in non-decreasing (priority, access time) order and a prefix a
  high-priority request uses survives the low-priority tails hanging from it.
- **Node handles stay valid across splits**: a split keeps the original
  object as the *lower* half, so a node returned by :meth:`match_prefix` or
  :meth:`insert` still ends at the same page after later splits.
- **Access times** are set on every node along a matched or inserted path;
  an L3-only node gets its parent's time when added, so a parent is never
  older than its children and leaf-first LRU eviction pops pages in
  non-decreasing ``last_access`` order.
- ``total_pages`` / ``evictable_pages`` count L2 pages (all / unlocked),
  ``l3_pages`` / ``l3_only_pages`` the pages known in L3 (all / not in L2);
  all are O(1) counters. A page key appears at most once in the tree (keys
  hash their prefix), so ``node_of`` finds a page by its key.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.tree_node import (
    DEFAULT_PRIORITY,
    Dropped,
    InsertResult,
    MatchResult,
    TreeNode,
)

# Above every class: the root, the parent of every first page.
_ROOT_PRIORITY = 1 << 30

# Pages of the L3-only index kept by default: about 100 bytes each.
DEFAULT_MAX_L3_ONLY_PAGES = 1 << 20


class HiRadixTree:
    """Page-granular radix tree of L2- and L3-resident prefixes; see the module docstring."""

    # evict's kept heap of (rank, id, node) and its rank (see the module docstring)
    _heap: list[tuple[tuple[float, ...], int, TreeNode]] | None
    _heap_rank: Callable[[TreeNode], tuple[float, ...]] | None

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_l3_only_pages: int = DEFAULT_MAX_L3_ONLY_PAGES) -> None:
        self._clock = clock
        self.max_l3_only_pages = max_l3_only_pages
        self._clear()

    # ------------------------------------------------------------------ queries

    def total_pages(self) -> int:
        return self._total_pages

    def evictable_pages(self) -> int:
        return self._evictable_pages

    def l3_pages(self) -> int:
        return self._l3_pages

    def l3_only_pages(self) -> int:
        return self._l3_only_pages

    def node_of(self, key: PageKey) -> TreeNode | None:
        return self._nodes.get(key)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes, root first, depth-first (parents before children)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def find(self, keys: Sequence[PageKey]) -> TreeNode | None:
        """The node ending exactly at ``keys`` in either tier (split so; root for
        none), or None when the tree lacks one of them. Times are not touched."""
        node, end = self.root, 0
        for child, i, k in self._walk(keys):
            if k < len(child.keys):
                return self._split(child, k) if i + k == len(keys) else None
            node, end = child, i + k
        return node if end == len(keys) else None

    def _walk(self, keys: Sequence[PageKey], node: TreeNode | None = None, i: int = 0, *,
              l2_only: bool = False) -> Iterator[tuple[TreeNode, int, int]]:
        """The one descent: the edges the path of ``keys[i:]`` runs through below
        ``node`` (default the root), as ``(child, i, k)``: ``child`` starts at
        ``keys[i]`` and its first ``k`` pages match. The walk goes below ``child``
        only when its whole edge matched; with ``l2_only`` it stops at an L3-only
        node. It splits and touches nothing: a caller may split the last edge."""
        node = node or self.root
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None or (l2_only and child.host_slots is None):
                return
            k = _common_prefix_len(child.keys, keys, i)
            whole = k == len(child.keys)
            yield child, i, k
            if not whole:
                return
            node, i = child, i + k

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, keys: Sequence[PageKey]) -> MatchResult:
        """Longest prefix of ``keys`` resident in L2 (split so ``node`` ends at it),
        and how many pages after it the tree knows L3 holds."""
        now = self._now()
        node, end = self.root, 0
        node.last_access = now
        slots: list[int] = []
        for child, i, k in self._walk(keys, l2_only=True):
            if k < len(child.keys):
                child = self._split(child, k)
            child.last_access = now
            assert child.host_slots is not None  # a split gives both halves their slots
            slots.extend(child.host_slots)
            node, end = child, i + k
        return MatchResult(node=node, num_pages=end, host_slots=slots,
                           l3_pages=self._l3_run(node, keys, end))

    def peek(self, keys: Sequence[PageKey]) -> int:
        """Leading pages of ``keys`` resident in L2, without touching the tree (no
        split, no access time: a lookup by a router must not refresh its LRU)."""
        end = 0
        for _, i, k in self._walk(keys, l2_only=True):
            end = i + k
        return end

    def shared_depth(self, keys: Sequence[PageKey]) -> int:
        """Leading pages of the prompt ``keys`` that another prefix in the tree (either
        tier) also runs through: the pages before the deepest point where the tree
        forks off the prompt's path. Pages that extend the prompt count as the
        prompt's own, unless it ends exactly where several continuations part: then
        all of it is shared. Times are not touched, nothing is split."""
        shared = 0
        for child, i, k in self._walk(keys):
            end = i + k
            if k < len(child.keys):
                if end < len(keys):
                    shared = end  # another prefix leaves the path inside this edge
                break
            if end < len(keys) and any(key != keys[end] for key in child.children):
                shared = end  # another prefix branches off after page ``end``
            elif end == len(keys) and len(child.children) > 1:
                shared = end  # the prompt ends where several continuations part
        return shared

    def _l3_run(self, node: TreeNode, keys: Sequence[PageKey], i: int) -> int:
        """Pages of ``keys[i:]`` below ``node`` known in L3, consecutively (no splits)."""
        run = 0
        for child, _, k in self._walk(keys, node, i):
            m = 0
            while m < k and child.in_l3[m]:
                m += 1
            run += m
            if m < len(child.keys):
                break
        return run

    def insert(self, keys: Sequence[PageKey], host_slots: Sequence[int],
               priority: int = DEFAULT_PRIORITY) -> InsertResult:
        """Record ``keys`` as L2-resident at ``host_slots``: already-present L2 pages
        keep their slots, L3-only pages take theirs, the rest are added. New pages
        get ``priority``; pages on the path are raised to at least it."""
        if len(keys) != len(host_slots):
            raise ValueError(f"{len(keys)} keys but {len(host_slots)} host slots")
        now = self._now()
        node, end = self.root, 0
        node.last_access = now
        unused: list[int] = []
        new = 0
        for child, i, k in self._walk(keys):
            if k < len(child.keys):
                child = self._split(child, k)
            if child.host_slots is None:
                self._set_slots(child, list(host_slots[i : i + k]))  # L3-only: now in L2 too
                new += k
            else:
                unused.extend(host_slots[i : i + k])
            child.hit_count += 1
            child.last_access = now
            child.priority = max(child.priority, priority)
            node, end = child, i + k
        if end < len(keys):
            leaf = self._add_leaf(node, list(keys[end:]), list(host_slots[end:]), now,
                                  priority=priority)
            return InsertResult(leaf, unused, new + len(keys) - end)
        return InsertResult(node, unused, new)

    def raise_priority(self, keys: Sequence[PageKey], priority: int) -> int:
        """Raise the pages of the longest prefix of ``keys`` in the tree (either tier)
        to at least ``priority`` (split so no page past it changes). Returns that
        prefix's length in pages. Times are not touched."""
        end = 0
        for child, i, k in self._walk(keys):
            if k < len(child.keys):
                if child.priority >= priority:
                    return i + k
                child = self._split(child, k)
            child.priority = max(child.priority, priority)
            end = i + k
        return end

    def subtree_at(self, keys: Sequence[PageKey], start: int) -> TreeNode | None:
        """The node whose first page is ``keys[start]``, under ``keys[:start]`` (split
        so; either tier), or None when the tree lacks one of ``keys[:start + 1]``.
        Times are not touched."""
        if start >= len(keys):
            return None
        above = self.find(keys[:start])
        return above.children.get(keys[start]) if above is not None else None

    def demote(self, top: TreeNode, priority: int) -> int:
        """Lower every page of ``top``'s subtree to at most ``priority``. A whole
        subtree, so no parent ends below a child. Returns the pages lowered."""
        lowered = 0
        for node in _preorder(top):
            if node.priority > priority:
                node.priority = priority
                lowered += len(node.keys)
        if lowered:
            self._heap = None  # ranks fell: the kept eviction heap is out of order
        return lowered

    # ------------------------------------------------------------------ L3 residency

    def mark_l3(self, keys: Sequence[PageKey], start: int = 0) -> list[PageKey]:
        """L3 holds ``keys[start:]``, whose prefix ``keys[:start]`` is in the tree:
        mark them, adding the missing ones as L3-only pages. Returns the keys newly
        marked ([] when the prefix is not in the tree)."""
        newly: list[PageKey] = []
        node, end = self.root, 0
        for child, i, k in self._walk(keys):
            if k < len(child.keys) and i + k < len(keys) and i + k < start:
                return newly  # the prefix leaves the tree inside this edge
            for j in range(max(0, start - i), k):
                if not child.in_l3[j]:
                    self._set_l3(child, j, True)
                    newly.append(child.keys[j])
            if k < len(child.keys) and i + k == len(keys):
                end = len(keys)  # ends inside this edge: nothing to add
                break
            if k < len(child.keys):
                child = self._split(child, k)
            node, end = child, i + k
        if end < len(keys):
            if end < start:
                return newly  # the prefix is not in the tree
            self._add_leaf(node, list(keys[end:]), None, node.last_access,
                           in_l3=[True] * (len(keys) - end))
            newly.extend(keys[end:])
        self._trim_l3_index()
        return newly

    def mark_l3_keys(self, keys: Iterable[PageKey]) -> list[PageKey]:
        """L3 holds these pages: mark those the tree has (others are ignored).
        Returns the keys newly marked."""
        wanted = self._by_node(keys)
        newly: list[PageKey] = []
        for node, mine in wanted.items():
            for j, key in enumerate(node.keys):
                if key in mine and not node.in_l3[j]:
                    self._set_l3(node, j, True)
                    newly.append(key)
        return newly

    def _by_node(self, keys: Iterable[PageKey]) -> dict[TreeNode, set[PageKey]]:
        """The given keys the tree holds, grouped by the node holding them."""
        wanted: dict[TreeNode, set[PageKey]] = {}
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                wanted.setdefault(node, set()).add(key)
        return wanted

    def unmark_l3_keys(self, keys: Iterable[PageKey]) -> list[PageKey]:
        """L3 no longer holds these pages: clear them; an L3-only node loses the
        page and everything after it. Returns the keys that were marked."""
        wanted = self._by_node(keys)
        cleared: list[PageKey] = []
        for node, mine in wanted.items():
            for j, key in enumerate(node.keys):
                if key in mine and node.in_l3[j]:
                    self._set_l3(node, j, False)
                    cleared.append(key)
        for node in wanted:
            self._prune(node)  # a no-op for nodes already pruned with an ancestor's tail
        return cleared

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """Pin the L2-resident ``node`` and its ancestors (root excluded) against eviction."""
        self._check_attached(node)
        if node is not self.root and node.host_slots is None:
            raise ValueError(f"lock of L3-only node {node!r}")
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

    # ------------------------------------------------------------------ eviction / removal

    def evict(self, num_pages: int,
              rank: Callable[[TreeNode], tuple[float, ...]] | None = None,
              take: Callable[[TreeNode], int] | None = None,
              rank_rises: bool = False) -> list[int]:
        """Free exactly ``num_pages`` L2 pages if possible: unlocked L2 leaves, lowest
        ``rank`` first (default: priority, then access time).

        A leaf longer than what is still needed loses only its tail pages, so
        the reusable head of a long history survives. Pages L3 holds stay in
        the tree, L3-only. Fewer are freed only when nothing unlocked is left.
        A ``rank`` given must never put a node below one of its children (the
        default does not: see Priorities and Access times). ``rank_rises``: the
        given rank reads only the node's own fields and falls only through
        ``demote`` while the node stays an L2 leaf (as the default), so the
        heap is kept between calls; otherwise every leaf is ranked anew.
        ``take``: at most how many pages to take from a leaf before ranking
        what is left of it again (default: as many as still needed). Returns
        the freed host slots.
        """
        if rank is None:
            rank, rank_rises = _default_rank, True
        if rank_rises:
            heap = self._eviction_heap(rank)
        else:
            self._heap = None  # no kept heap to keep up while another rank evicts
            heap = [(rank(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
            heapq.heapify(heap)
        freed: list[int] = []
        held: list[TreeNode] = []  # locked leaves popped: back in the heap afterwards
        while len(freed) < num_pages and heap:
            ranked, _, leaf = heapq.heappop(heap)
            if rank_rises:
                if leaf not in self._leaves:
                    continue  # gone, or no longer a leaf: a newer entry stands for it
                if leaf.lock_ref:
                    held.append(leaf)
                    continue
                now = rank(leaf)
                if now != ranked:  # used since it was pushed: its rank rose
                    heapq.heappush(heap, (now, leaf.id, leaf))
                    continue
            still_needed = num_pages - len(freed)
            if take is not None:
                still_needed = max(1, min(still_needed, take(leaf)))
            if len(leaf.keys) > still_needed:
                self._split(leaf, len(leaf.keys) - still_needed)  # leaf keeps the tail
            parent = leaf.parent
            assert parent is not None
            parent.tail_lost = max(parent.tail_lost, leaf.tail_lost + len(leaf.keys))
            freed.extend(self._drop_l2(leaf))
            # A parent never ranks below its children, so pushing one keeps the
            # popped sequence in order (a kept heap got it from _refresh_leaf).
            if not rank_rises and parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (rank(parent), parent.id, parent))
        for leaf in held:
            heapq.heappush(heap, (rank(leaf), leaf.id, leaf))
        self._trim_l3_index()
        return freed

    def _eviction_heap(self, rank: Callable[[TreeNode], tuple[float, ...]],
                       ) -> list[tuple[tuple[float, ...], int, TreeNode]]:
        """The kept heap for ``rank``: every L2 leaf has an entry whose rank is at most
        its own (equal when pushed; ranks only rise since), built anew when missing,
        made for another rank, or mostly stale."""
        if (self._heap is None or self._heap_rank != rank
                or len(self._heap) > 2 * len(self._leaves) + 1024):
            self._heap = [(rank(n), n.id, n) for n in self._leaves]
            heapq.heapify(self._heap)
            self._heap_rank = rank
        return self._heap

    def remove_slots(self, slots: Iterable[int]) -> tuple[list[int], set[int]]:
        """Forget the pages held in ``slots`` and every page below them, in both tiers.

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

    def drop_subtrees(self, tops: Iterable[TreeNode], *, l2: bool, l3: bool) -> Dropped:
        """Take the pages of ``tops`` and of every node below them out of L2
        (``l2``; locked nodes keep theirs) and/or out of L3 (``l3``). Pages left
        in neither tier leave the tree."""
        out = Dropped()
        for top in list(tops):
            if top is self.root or top.parent is None:
                continue
            subtree = list(_preorder(top))
            out.keys.extend(k for node in subtree for k in node.keys)
            for node in reversed(subtree):  # children before parents
                if node.parent is None:
                    continue  # defensive: children come first, so none is detached yet
                if l3:
                    for j, flag in enumerate(node.in_l3):
                        if flag:
                            self._set_l3(node, j, False)
                if l2 and node.host_slots is not None:
                    if node.lock_ref:
                        out.kept_slots.extend(node.host_slots)
                        continue
                    out.freed_slots.extend(self._drop_l2(node))
                elif node.host_slots is None:
                    self._prune(node)
        self._trim_l3_index()
        return out

    def reset(self) -> list[int]:
        """Drop every node (both tiers); returns all host slots. Raises if anything is locked."""
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
        self._latest = self._clock()
        self.root = TreeNode([], None, [], self._latest, priority=_ROOT_PRIORITY)
        self._leaves: set[TreeNode] = set()  # L2 nodes without an L2 child (root excluded)
        self._heap = None
        self._heap_rank = None
        self._nodes: dict[PageKey, TreeNode] = {}
        self._total_pages = 0
        self._evictable_pages = 0
        self._l3_pages = 0
        self._l3_only_pages = 0

    # ------------------------------------------------------------------ internals

    def _add_leaf(self, parent: TreeNode, keys: list[PageKey], slots: list[int] | None,
                  now: float, in_l3: list[bool] | None = None,
                  priority: int = DEFAULT_PRIORITY) -> TreeNode:
        leaf = TreeNode(keys, parent, slots, now, in_l3, min(priority, parent.priority))
        parent.children[keys[0]] = leaf
        if slots is not None:
            parent.tail_lost = 0
        parent.l2_children += slots is not None
        for key in keys:
            self._nodes[key] = leaf
        self._l3_pages += sum(leaf.in_l3)
        if slots is None:
            self._l3_only_pages += len(keys)
        else:
            self._total_pages += len(keys)
            self._evictable_pages += len(keys)
        self._refresh_leaf(leaf)
        self._refresh_leaf(parent)
        return leaf

    def _set_slots(self, node: TreeNode, slots: list[int] | None) -> None:
        """Make ``node`` L2-resident at ``slots`` or (None) L3-only; keeps the counters."""
        n = len(node.keys)
        if node.parent is not None:
            node.parent.l2_children += (slots is not None) - (node.host_slots is not None)
        if node.host_slots is None:
            self._l3_only_pages -= n
        else:
            self._total_pages -= n
            self._evictable_pages -= n if node.lock_ref == 0 else 0
        node.host_slots = slots
        if slots is not None and node.parent is not None:
            node.parent.tail_lost = 0  # its conversation's pages are back
        if slots is None:
            assert node.lock_ref == 0, "a locked node leaves L2"
            self._l3_only_pages += n
        else:
            self._total_pages += n
            self._evictable_pages += n if node.lock_ref == 0 else 0
        self._refresh_leaf(node)
        if node.parent is not None:
            self._refresh_leaf(node.parent)

    def _now(self) -> float:
        """The clock for access times; one that went back (a test's) drops the kept
        eviction heap, whose order assumes access times only rise."""
        now = self._clock()
        if now < self._latest:
            self._heap = None
        self._latest = now
        return now

    def _set_l3(self, node: TreeNode, j: int, value: bool) -> None:
        if node.in_l3[j] != value:
            node.in_l3[j] = value
            self._l3_pages += 1 if value else -1

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Keep ``_leaves`` (L2 nodes without an L2 child) right for ``node``."""
        if (node is not self.root and node.parent is not None and node.host_slots is not None
                and node.l2_children == 0):
            if node not in self._leaves:
                self._leaves.add(node)
                if self._heap is not None:
                    rank = self._heap_rank
                    assert rank is not None  # set with the heap
                    heapq.heappush(self._heap, (rank(node), node.id, node))
        else:
            self._leaves.discard(node)

    def _drop_l2(self, node: TreeNode) -> list[int]:
        """``node`` (unlocked, every descendant already L3-only) leaves L2; what L3
        holds of it stays. Returns its slots."""
        freed = list(node.host_slots or ())
        self._set_slots(node, None)
        self._prune(node)
        return freed

    def _prune(self, node: TreeNode) -> None:
        """An L3-only ``node`` keeps its leading pages that L3 holds; from the first
        other page on it leaves the tree with its subtree (all L3-only)."""
        if node.host_slots is not None or node.parent is None:
            return
        n = 0
        while n < len(node.keys) and node.in_l3[n]:
            n += 1
        if n == len(node.keys):
            return
        if n > 0:
            self._split(node, n)  # node keeps the tail, from the first page L3 lacks
        self._remove_subtree(node)

    def _remove_subtree(self, top: TreeNode) -> list[int]:
        """Detach ``top`` and its descendants (all unlocked); returns their L2 slots."""
        parent = top.parent
        assert parent is not None and top.lock_ref == 0
        del parent.children[top.keys[0]]
        parent.l2_children -= top.host_slots is not None
        slots: list[int] = []
        for node in list(_preorder(top)):
            slots.extend(node.host_slots or ())
            self._leaves.discard(node)
            for key in node.keys:
                self._nodes.pop(key, None)
            self._l3_pages -= sum(node.in_l3)
            if node.host_slots is None:
                self._l3_only_pages -= len(node.keys)
            else:
                self._total_pages -= len(node.keys)
                self._evictable_pages -= len(node.keys)
            node.parent = None  # outstanding handles become detached
        self._refresh_leaf(parent)
        return slots

    def _trim_l3_index(self) -> None:
        """Forget least recently used L3-only leaves beyond ``max_l3_only_pages``."""
        if self._l3_only_pages <= self.max_l3_only_pages:
            return
        target = self.max_l3_only_pages * 9 // 10
        heap = [(n.last_access, n.id, n) for n in self.iter_nodes()
                if n is not self.root and n.host_slots is None and not n.children]
        heapq.heapify(heap)
        while self._l3_only_pages > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self._remove_subtree(leaf)
            if parent is not self.root and parent.host_slots is None and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child`` after ``k`` pages; returns the new upper node.

        The original object keeps the lower half so outstanding handles stay
        valid; residency, locks, hits and access time carry over to both halves.
        """
        assert 0 < k < len(child.keys)
        parent = child.parent
        assert parent is not None
        upper = TreeNode(
            child.keys[:k],
            parent,
            None if child.host_slots is None else child.host_slots[:k],
            child.last_access,
            child.in_l3[:k],
            child.priority,
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.l2_children = int(child.host_slots is not None)
        upper.children[child.keys[k]] = child
        parent.children[upper.keys[0]] = upper
        for key in upper.keys:
            self._nodes[key] = upper
        child.keys = child.keys[k:]
        child.in_l3 = child.in_l3[k:]
        if child.host_slots is not None:
            child.host_slots = child.host_slots[k:]
        child.parent = upper
        return upper

    def _check_attached(self, node: TreeNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"{node!r} is no longer in the tree (evicted or reset)")

    def check_invariants(self) -> None:
        """Assert the structural invariants; O(nodes), for tests and debugging."""
        total = evictable = l3 = l3_only = 0
        leaves: set[TreeNode] = set()
        index: dict[PageKey, TreeNode] = {}
        for node in self.iter_nodes():
            assert node.l2_children == sum(c.host_slots is not None
                                           for c in node.children.values()), "l2_children"
            for first, child in node.children.items():
                assert child.parent is node, "child/parent link broken"
                assert child.keys and child.keys[0] == first, "child keyed by wrong page"
                assert child.last_access <= node.last_access or node is self.root, (
                    "child newer than parent"
                )
                assert child.priority <= node.priority, "child above its parent's priority"
                if child.host_slots is not None:
                    assert node.host_slots is not None, "L2 residency not prefix-closed"
            if node is self.root:
                assert node.lock_ref == 0 and not node.keys and node.host_slots == []
                continue
            assert len(node.in_l3) == len(node.keys)
            for key in node.keys:
                assert key not in index, "page key twice in the tree"
                index[key] = node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            l3 += sum(node.in_l3)
            if node.host_slots is None:
                assert all(node.in_l3), "L3-only node with a page L3 lacks"
                assert node.lock_ref == 0, "locked L3-only node"
                l3_only += len(node.keys)
                continue
            assert len(node.host_slots) == len(node.keys)
            total += len(node.keys)
            evictable += len(node.keys) if node.lock_ref == 0 else 0
            if not any(c.host_slots is not None for c in node.children.values()):
                leaves.add(node)
        assert total == self._total_pages, f"total_pages {self._total_pages} != {total}"
        assert evictable == self._evictable_pages, (
            f"evictable_pages {self._evictable_pages} != {evictable}"
        )
        assert l3 == self._l3_pages, f"l3_pages {self._l3_pages} != {l3}"
        assert l3_only == self._l3_only_pages, f"l3_only_pages {self._l3_only_pages} != {l3_only}"
        assert leaves == self._leaves, "leaf set out of date"
        assert index == self._nodes, "key index out of date"


def _default_rank(node: TreeNode) -> tuple[float, ...]:
    return (node.priority, node.last_access)


def _preorder(top: TreeNode) -> Iterator[TreeNode]:
    stack = [top]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _common_prefix_len(edge: Sequence[PageKey], keys: Sequence[PageKey], start: int) -> int:
    n = min(len(edge), len(keys) - start)
    i = 0
    while i < n and edge[i] == keys[start + i]:
        i += 1
    return i
