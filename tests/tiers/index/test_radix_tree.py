import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from support.clock import ManualClock

from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import DEFAULT_PRIORITY, TreeNode


def K(c: str) -> PageKey:
    return PageKey(c.encode() * 32)


A, B, C, D, X = (K(c) for c in "ABCDX")


def path_keys(node: TreeNode) -> list[PageKey]:
    parts = []
    while node.parent is not None:
        parts.append(node.keys)
        node = node.parent
    return [k for part in reversed(parts) for k in part]


def test_empty_match_returns_root():
    tree = HiRadixTree()
    m = tree.match_prefix([A, B])
    assert m.node is tree.root and m.num_pages == 0 and m.host_slots == []
    assert tree.match_prefix([]).node is tree.root


def test_split_on_match_keeps_handles_valid():
    tree = HiRadixTree()
    leaf = tree.insert([A, B, C], [0, 1, 2]).node
    m = tree.match_prefix([A, B, X])
    assert (m.num_pages, m.host_slots) == (2, [0, 1])
    assert m.node.keys == [A, B] and m.node.parent is tree.root
    assert list(m.node.children.values()) == [leaf]
    # The original object became the lower half and still ends at page C.
    assert leaf.keys == [C] and leaf.host_slots == [2] and path_keys(leaf) == [A, B, C]
    assert tree.match_prefix([A, B, C, D]).host_slots == [0, 1, 2]
    assert tree.match_prefix([A]).host_slots == [0]
    tree.check_invariants()


def test_insert_returns_unused_slots_for_present_pages():
    tree = HiRadixTree()
    first = tree.insert([A, B], [0, 1])
    assert (first.unused_slots, first.num_new_pages) == ([], 2)
    r = tree.insert([A, B, C], [5, 6, 7])
    assert (r.unused_slots, r.num_new_pages) == ([5, 6], 1)
    assert r.node.keys == [C] and r.node.host_slots == [7]
    assert first.node.hit_count == 2
    r = tree.insert([A, D], [8, 9])  # splits [A, B] inside
    assert (r.unused_slots, r.num_new_pages) == ([8], 1)
    assert tree.match_prefix([A, D]).host_slots == [0, 9]
    r = tree.insert([A], [10])
    assert (r.unused_slots, r.num_new_pages, r.node.keys) == ([10], 0, [A])
    assert tree.total_pages() == 4
    tree.check_invariants()


def test_insert_length_mismatch():
    with pytest.raises(ValueError):
        HiRadixTree().insert([A, B], [0])


def test_lock_protects_from_eviction():
    tree = HiRadixTree()
    tree.insert([A, B], [0, 1])
    tree.insert([A, C], [2, 3])
    node = tree.match_prefix([A, B]).node
    tree.lock(node)
    assert tree.evictable_pages() == 1  # only C
    assert tree.evict(100) == [3]
    assert tree.match_prefix([A, B]).num_pages == 2
    assert tree.evict(100) == []
    tree.unlock(node)
    assert tree.evictable_pages() == 2
    assert sorted(tree.evict(100)) == [0, 1]
    assert tree.total_pages() == 0
    with pytest.raises(ValueError):
        tree.lock(node)  # evicted handle
    tree.check_invariants()


def test_unlock_below_zero_raises():
    tree = HiRadixTree()
    node = tree.insert([A], [0]).node
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(ValueError):
        tree.unlock(node)
    tree.lock(tree.root)  # no-op: the root is never evicted
    tree.unlock(tree.root)


def test_leaf_first_lru_order():
    clock = ManualClock()
    tree = HiRadixTree(clock)
    clock.now = 1
    tree.insert([A, B], [0, 1])
    clock.now = 2
    tree.insert([C], [2])
    clock.now = 3
    tree.insert([A, D], [3, 4])  # touches A, so A outlives B and C
    order = [tree.evict(1) for _ in range(5)]
    assert order == [[1], [2], [4], [0], []]
    tree.check_invariants()


def test_lower_priority_goes_first_lru_within_a_priority():
    clock = ManualClock()
    tree = HiRadixTree(clock)
    clock.now = 1
    tree.insert([A, B], [0, 1], priority=2)  # a system prompt and its first turn
    clock.now = 2
    tree.insert([C], [2], priority=0)  # a one-off, newer than everything above
    clock.now = 3
    tree.insert([A, D], [3, 4], priority=1)  # a session below the system prompt
    tree.check_invariants()
    assert [tree.evict(1) for _ in range(6)] == [[2], [4], [1], [0], [], []]


def test_raise_priority_splits_at_the_prefix_end_and_lifts_the_path():
    tree = HiRadixTree()
    tree.insert([A, B, C], [0, 1, 2], priority=0)
    assert tree.raise_priority([A, B, X], 2) == 2
    tree.check_invariants()
    node = tree.find([A, B])
    assert node is not None and node.priority == 2
    assert tree.find([A, B, C]).priority == 0  # type: ignore[union-attr]
    assert tree.evict(1) == [2]  # the tail the raise did not cover goes first
    # Priorities survive a trip to L3 and back: an L3-only page keeps its class.
    tree.mark_l3([A, B])
    assert sorted(tree.evict(2)) == [0, 1]
    assert tree.find([A, B]).priority == 2  # type: ignore[union-attr]
    assert tree.raise_priority([X], 2) == 0


def test_match_refreshes_lru():
    clock = ManualClock()
    tree = HiRadixTree(clock)
    tree.insert([A], [0])
    clock.now = 1
    tree.insert([B], [1])
    clock.now = 2
    tree.match_prefix([A])
    assert tree.evict(1) == [1]


def test_eviction_takes_only_the_tail_of_a_long_leaf():
    tree = HiRadixTree()
    tree.insert([A, B, C], [0, 1, 2])
    assert tree.evict(1) == [2]
    assert tree.match_prefix([A, B, C]).host_slots == [0, 1]
    assert tree.evict(0) == []
    assert sorted(tree.evict(5)) == [0, 1]
    tree.check_invariants()


def test_reset():
    tree = HiRadixTree()
    tree.insert([A, B], [0, 1])
    tree.insert([A, C], [2, 3])
    node = tree.match_prefix([A, C]).node
    tree.lock(node)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.unlock(node)
    assert sorted(tree.reset()) == [0, 1, 3]  # slot 2 came back unused from insert
    assert (tree.total_pages(), tree.evictable_pages()) == (0, 0)
    assert list(tree.iter_nodes()) == [tree.root]
    with pytest.raises(ValueError):
        tree.lock(node)
    tree.check_invariants()


def test_remove_slots_drops_bad_page_and_descendants_keeps_head():
    tree = HiRadixTree()
    tree.insert([A, B, C], [0, 1, 2])
    tree.insert([A, B, D], [0, 1, 3])
    tree.insert([X], [4])
    freed, kept = tree.remove_slots({1})
    # B is bad: B, C and D lose their prefix; A stays; X is unrelated.
    assert sorted(freed) == [1, 2, 3] and kept == set()
    assert tree.match_prefix([A, B, C]).host_slots == [0]
    assert tree.match_prefix([X]).host_slots == [4]
    assert tree.total_pages() == 2
    tree.check_invariants()


def test_remove_slots_keeps_locked_nodes():
    tree = HiRadixTree()
    node = tree.insert([A, B], [0, 1]).node
    tree.lock(node)
    freed, kept = tree.remove_slots({1})
    assert freed == [] and kept == {1}
    tree.unlock(node)
    freed, kept = tree.remove_slots(kept)
    assert freed == [1] and kept == set()
    tree.check_invariants()


# ---------------------------------------------------------------- stateful model check

MAX_LEN = 6


def chain(letters: list[str]) -> list[PageKey]:
    """Page keys as the engine makes them: each one hashes its whole prefix."""
    return [PageKey(hashlib.sha256("".join(letters[: i + 1]).encode()).digest())
            for i in range(len(letters))]


sequences = st.lists(st.sampled_from("abc"), max_size=MAX_LEN).map(chain)


class TreeVsReference(RuleBasedStateMachine):
    """The tree against flat references: L2 prefixes with their slots, the set of
    prefixes known in L3, per-page times (L2) and locks."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.tree = HiRadixTree(self.clock)
        self.ref: dict[tuple[PageKey, ...], int] = {}  # L2 prefix -> its last page's slot
        self.l3: set[tuple[PageKey, ...]] = set()  # prefixes in the tree and known in L3
        self.atime: dict[tuple[PageKey, ...], float] = {}
        # Per page in the tree: its priority (stale entries for pages gone are rewritten
        # before they come back).
        self.prio: dict[tuple[PageKey, ...], int] = {}
        self.locks: dict[tuple[PageKey, ...], int] = {}
        self.handles: list[tuple[TreeNode, tuple[PageKey, ...]]] = []
        self.free: set[int] = set()
        self.handed_out = 0

    def _present(self, prefix: tuple[PageKey, ...]) -> bool:
        return not prefix or prefix in self.ref or prefix in self.l3

    def _close(self) -> None:
        """What the tree keeps: pages in a tier whose whole prefix is kept too."""
        for p in sorted(self.l3, key=len):
            if not self._present(p[:-1]):
                self.l3.discard(p)

    def _take(self, n: int) -> list[int]:
        slots = sorted(self.free)[:n]
        self.free -= set(slots)
        while len(slots) < n:
            slots.append(self.handed_out)
            self.handed_out += 1
        return slots

    def _expected_match(self, seq: list[PageKey]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.ref:
            n += 1
        return n

    def _touch(self, seq: list[PageKey], n: int) -> None:
        for i in range(1, n + 1):
            self.atime[tuple(seq[:i])] = self.clock.now

    @rule(dt=st.sampled_from([0, 1, 1, 2]))
    def tick(self, dt):
        self.clock.now += dt

    @rule(seq=sequences, priority=st.integers(0, 2))
    def insert(self, seq, priority):
        slots = self._take(len(seq))
        r = self.tree.insert(seq, slots, priority)
        expected_unused = []
        for i in range(len(seq)):
            prefix = tuple(seq[: i + 1])
            was = self.prio.get(prefix, 0) if self._present(prefix) else 0
            self.prio[prefix] = max(was, priority)
            if prefix in self.ref:
                expected_unused.append(slots[i])
            else:
                self.ref[prefix] = slots[i]
        assert r.unused_slots == expected_unused
        assert r.num_new_pages == len(seq) - len(expected_unused)
        assert path_keys(r.node) == seq
        self.free |= set(r.unused_slots)
        self._touch(seq, len(seq))

    def _match(self, seq: list[PageKey]) -> TreeNode:
        n = self._expected_match(seq)
        m = self.tree.match_prefix(seq)
        assert m.num_pages == n
        assert m.host_slots == [self.ref[tuple(seq[: i + 1])] for i in range(n)]
        assert path_keys(m.node) == seq[:n]
        run = 0
        while n + run < len(seq) and tuple(seq[: n + run + 1]) in self.l3:
            run += 1
        assert m.l3_pages == run
        self._touch(seq, n)
        return m.node

    @rule(seq=sequences)
    def match(self, seq):
        self._match(seq)

    @rule(seq=sequences, priority=st.integers(0, 2))
    def raise_priority(self, seq, priority):
        n = 0
        while n < len(seq) and self._present(tuple(seq[: n + 1])):
            n += 1
        assert self.tree.raise_priority(seq, priority) == n
        for i in range(1, n + 1):
            self.prio[tuple(seq[:i])] = max(self.prio[tuple(seq[:i])], priority)

    @rule(seq=sequences)
    def lock_match(self, seq):
        node = self._match(seq)
        prefix = tuple(path_keys(node))
        self.tree.lock(node)
        self.handles.append((node, prefix))
        for i in range(1, len(prefix) + 1):
            self.locks[prefix[:i]] = self.locks.get(prefix[:i], 0) + 1

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock(self, data):
        node, prefix = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        self.tree.unlock(node)
        for i in range(1, len(prefix) + 1):
            self.locks[prefix[:i]] -= 1

    @rule(seq=sequences, data=st.data())
    def mark_l3(self, seq, data):
        start = data.draw(st.integers(0, len(seq)))
        newly = self.tree.mark_l3(seq, start)
        expected = []
        if self._present(tuple(seq[:start])):
            expected = [seq[i] for i in range(start, len(seq))
                        if tuple(seq[: i + 1]) not in self.l3]
            for i in range(start, len(seq)):
                prefix = tuple(seq[: i + 1])
                if not self._present(prefix):  # a new L3-only page: its parent's class at most
                    parent = self.prio.get(prefix[:-1], DEFAULT_PRIORITY) if i else DEFAULT_PRIORITY
                    self.prio[prefix] = min(DEFAULT_PRIORITY, parent)
            self.l3 |= {tuple(seq[: i + 1]) for i in range(start, len(seq))}
        assert newly == expected

    @rule(seq=sequences, data=st.data())
    def mark_or_unmark_keys(self, seq, data):
        mark = data.draw(st.booleans())
        chosen = [k for k in seq if data.draw(st.booleans())]
        prefixes = {tuple(seq[: seq.index(k) + 1]) for k in chosen}
        if mark:
            got = self.tree.mark_l3_keys(chosen)
            expected = {p for p in prefixes if self._present(p) and p not in self.l3}
            self.l3 |= expected
        else:
            got = self.tree.unmark_l3_keys(chosen)
            expected = prefixes & self.l3
            self.l3 -= expected
            self._close()
        assert sorted(got) == sorted(p[-1] for p in expected)

    @rule(seq=sequences, l2=st.booleans(), l3=st.booleans())
    def drop_subtree(self, seq, l2, l3):
        top = self.tree.find(seq) if seq else None
        if not self._present(tuple(seq)) or not seq:
            assert top is None
            return
        assert top is not None and path_keys(top) == seq
        # The top's own last page and everything below it.
        below = {p for p in set(self.ref) | self.l3 if p[: len(seq)] == tuple(seq)}
        below_top = [top] if len(top.keys) == 1 else []
        if not below_top:  # the tree's top node may start above seq's last page
            parent = self.tree.find(seq[:-1])
            assert parent is not None
            below_top = [parent.children[seq[-1]]]
        dropped = self.tree.drop_subtrees(below_top, l2=l2, l3=l3)
        assert set(dropped.keys) == {p[-1] for p in below}
        if l3:
            self.l3 -= below
        freed = []
        if l2:
            for p in below:
                if p in self.ref and self.locks.get(p, 0) == 0:
                    freed.append(self.ref.pop(p))
        self._close()
        assert sorted(dropped.freed_slots) == sorted(freed)
        self.free |= set(freed)
        for p in list(self.atime):
            if p not in self.ref:
                del self.atime[p]

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        freed = self.tree.evict(n)
        owner = {slot: prefix for prefix, slot in self.ref.items()}
        removed = [owner[s] for s in freed]  # KeyError: a freed slot was not in the tree
        assert len(set(removed)) == len(removed)
        for p in removed:
            assert self.locks.get(p, 0) == 0, "evicted a locked page"
            del self.ref[p]
        for p in self.ref:  # still prefix-closed: only whole L2 subtrees went
            assert all(p[:i] in self.ref for i in range(1, len(p)))
        remaining_unlocked = [p for p in self.ref if self.locks.get(p, 0) == 0]
        if removed and remaining_unlocked:
            # Lowest priority first, LRU within one: nothing evicted ranks above a survivor.
            assert max((self.prio[p], self.atime[p]) for p in removed) <= min(
                (self.prio[p], self.atime[p]) for p in remaining_unlocked
            )
        if len(freed) < n:
            assert not remaining_unlocked, "stopped early with evictable pages left"
        else:
            assert len(freed) == n, "evicted more pages than asked"
        for p in removed:
            del self.atime[p]
        self._close()
        self.free |= set(freed)

    @precondition(lambda self: not self.handles)
    @rule()
    def reset(self):
        assert sorted(self.tree.reset()) == sorted(self.ref.values())
        self.free |= set(self.ref.values())
        self.ref.clear()
        self.l3.clear()
        self.atime.clear()
        self.locks.clear()

    @precondition(lambda self: any(prefix for _, prefix in self.handles))
    @rule()
    def reset_refused_while_locked(self):
        with pytest.raises(RuntimeError):
            self.tree.reset()

    @invariant()
    def agrees_with_reference(self):
        self.tree.check_invariants()
        seen: dict[tuple[PageKey, ...], int] = {}
        seen_l3: set[tuple[PageKey, ...]] = set()
        for node in self.tree.iter_nodes():
            if node is self.tree.root:
                continue
            start = tuple(path_keys(node.parent))
            for i in range(len(node.keys)):
                prefix = start + tuple(node.keys[: i + 1])
                if node.in_l3[i]:
                    seen_l3.add(prefix)
                assert self.prio[prefix] == node.priority
                assert self.locks.get(prefix, 0) == node.lock_ref
                if node.host_slots is None:
                    continue
                seen[prefix] = node.host_slots[i]
                # Pages of one node share their access time and lock count.
                assert self.atime[prefix] == node.last_access
        assert seen == self.ref
        assert seen_l3 == self.l3
        assert self.tree.total_pages() == len(self.ref)
        assert self.tree.l3_pages() == len(self.l3)
        assert self.tree.l3_only_pages() == len(self.l3 - set(self.ref))
        unlocked = sum(1 for p in self.ref if self.locks.get(p, 0) == 0)
        assert self.tree.evictable_pages() == unlocked

    @invariant()
    def slots_unique_and_conserved(self):
        in_tree = list(self.ref.values())
        assert len(set(in_tree)) == len(in_tree)
        assert not (set(in_tree) & self.free)
        assert set(in_tree) | self.free == set(range(self.handed_out))

    @invariant()
    def handles_still_end_where_they_did(self):
        for node, prefix in self.handles:
            assert tuple(path_keys(node)) == prefix


TreeVsReference.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)
test_tree_vs_reference = TreeVsReference.TestCase
