"""tiers/index/radix_tree.py: the eviction heap kept between calls frees exactly what a
fresh ranking of every leaf frees, and a call ranks a few nodes, not every leaf."""

from __future__ import annotations

import hashlib

from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.clock import ManualClock

from hicache.tiers.controller.policies import TailFirstLRU
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode


def chain(letters: str) -> list[PageKey]:
    return [PageKey(hashlib.sha256(letters[: i + 1].encode()).digest())
            for i in range(len(letters))]


words = st.text(alphabet="ab", min_size=1, max_size=5)
ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), words, st.integers(0, 2)),
    st.tuples(st.just("match"), words),
    st.tuples(st.just("lock"), words),
    st.tuples(st.just("unlock"), st.integers(0, 7)),
    st.tuples(st.just("demote"), words, st.integers(0, 2)),
    st.tuples(st.just("mark_l3"), words),
    st.tuples(st.just("evict"), st.integers(1, 5)),
), min_size=10, max_size=80)


class Run:
    """One tree driven by the ops; ``evict`` is how it evicts."""

    def __init__(self, evict) -> None:
        self.clock = ManualClock()
        self.tree = HiRadixTree(self.clock)
        self.evict = evict
        self.next_slot = 0
        self.free: list[int] = []
        self.locked: list[TreeNode] = []

    def slots(self, n: int) -> list[int]:
        out = sorted(self.free)[:n]
        self.free = [s for s in self.free if s not in out]
        while len(out) < n:
            out.append(self.next_slot)
            self.next_slot += 1
        return out

    def apply(self, op: tuple) -> object:
        kind = op[0]
        self.clock.now += 1  # every use at its own time: stale ranks differ from fresh ones
        if kind == "insert":
            keys = chain(op[1])
            slots = self.slots(len(keys))
            self.free += self.tree.insert(keys, slots, op[2]).unused_slots
        elif kind == "match":
            self.tree.match_prefix(chain(op[1]))
        elif kind == "lock":
            node = self.tree.match_prefix(chain(op[1])).node
            if node is not self.tree.root:
                self.tree.lock(node)
                self.locked.append(node)
        elif kind == "unlock" and self.locked:
            self.tree.unlock(self.locked.pop(op[1] % len(self.locked)))
        elif kind == "demote":
            keys = chain(op[1])
            top = self.tree.subtree_at(keys, len(keys) - 1)
            if top is not None:
                self.tree.demote(top, op[2])
        elif kind == "mark_l3":
            keys = chain(op[1])
            if self.tree.peek(keys[:-1]) == len(keys) - 1:
                self.tree.mark_l3(keys, len(keys) - 1)
        elif kind == "evict":
            freed = self.evict(self.tree, op[1])
            self.free += freed
            self.tree.check_invariants()
            return freed
        return None


# A leaf used after its entry was pushed must not go before one used less recently.
USED_AFTER_PUSH = [("insert", "a", 1), ("insert", "b", 1), ("evict", 1), ("insert", "aa", 1),
                   ("insert", "ba", 1), ("match", "aa"), ("evict", 1), ("evict", 1)]


@settings(max_examples=500, deadline=None)
@given(ops)
@example(USED_AFTER_PUSH)
def test_the_kept_heap_evicts_what_ranking_every_leaf_evicts(seq):
    kept = Run(lambda tree, n: tree.evict(n))
    fresh = Run(lambda tree, n: tree.evict(n, rank=lambda node: (node.priority,
                                                                    node.last_access)))
    for op in seq:
        assert kept.apply(op) == fresh.apply(op), op


@settings(max_examples=500, deadline=None)
@given(ops)
@example(USED_AFTER_PUSH)
def test_tlru_keeps_its_heap_and_evicts_the_same(seq):
    policy = TailFirstLRU(tail_pages=2)
    kept = Run(policy.evict)
    fresh = Run(lambda tree, n: tree.evict(n, rank=policy._rank, take=policy._take))
    for op in seq:
        assert kept.apply(op) == fresh.apply(op), op


def test_an_eviction_ranks_a_few_nodes_not_every_leaf():
    """1,000 conversations hang off one prefix; each eviction of one page ranks the
    leaf it takes and the few stale entries above it (before: all 1,000 leaves)."""
    clock = ManualClock()
    tree = HiRadixTree(clock)
    prefix = chain("p" * 8)
    tree.insert(prefix, list(range(8)))
    slot = 8
    for i in range(1000):
        clock.now += 1
        tail = [PageKey(hashlib.sha256(f"{i}-{j}".encode()).digest()) for j in range(2)]
        tree.insert(prefix + tail, list(range(8)) + [slot, slot + 1])
        slot += 2
    calls = 0

    def rank(node: TreeNode) -> tuple[float, ...]:
        nonlocal calls
        calls += 1
        return (node.priority, node.last_access)

    tree.evict(1, rank=rank, rank_rises=True)  # builds the heap: every leaf once
    assert calls <= 1000 + 3  # and the popped leaf, the head a split leaves
    calls = 0
    for _ in range(50):
        clock.now += 1
        tree.match_prefix(prefix)  # the shared prefix is used between evictions
        assert len(tree.evict(1, rank=rank, rank_rises=True)) == 1
    assert calls <= 3 * 50
    tree.check_invariants()
