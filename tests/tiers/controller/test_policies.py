"""Policy objects chosen by name: each write policy's decision, each prefetch policy's
timeout, the selective threshold and its bounded memory, eviction order, the L3
admission rules, unknown names."""

import itertools

import pytest

from hicache.tiers.controller.policies import (
    EVICTION_POLICIES,
    EVICTION_POLICY_NAMES,
    L3_ADMISSION_NAMES,
    L3_ADMISSIONS,
    PREFETCH_POLICIES,
    PREFETCH_POLICY_NAMES,
    WRITE_POLICIES,
    WRITE_POLICY_NAMES,
    AdmitReused,
    LeafFirstLRU,
    Timeout,
    WriteThroughSelective,
    make_eviction_policy,
    make_l3_admission,
    make_prefetch_policy,
    make_write_policy,
)
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree

SCHEDULED = {"a": 16, "b": 3}


def pages(*names: str) -> list[PageKey]:
    return [PageKey(n.encode().ljust(32, b".")) for n in names]


def test_every_configurable_name_has_exactly_one_policy():
    assert tuple(WRITE_POLICIES) == WRITE_POLICY_NAMES
    assert tuple(PREFETCH_POLICIES) == PREFETCH_POLICY_NAMES
    assert tuple(EVICTION_POLICIES) == EVICTION_POLICY_NAMES
    assert tuple(L3_ADMISSIONS) == L3_ADMISSION_NAMES
    for name in L3_ADMISSION_NAMES:
        assert make_l3_admission(name).name == name
    for name in WRITE_POLICY_NAMES:
        assert make_write_policy(name).name == name
    for name in PREFETCH_POLICY_NAMES:
        assert make_prefetch_policy(name).name == name


@pytest.mark.parametrize(("make", "kind", "allowed"), [
    (make_write_policy, "write policy", WRITE_POLICY_NAMES),
    (make_prefetch_policy, "prefetch policy", PREFETCH_POLICY_NAMES),
    (make_eviction_policy, "eviction policy", EVICTION_POLICY_NAMES),
    (make_l3_admission, "L3 admission rule", L3_ADMISSION_NAMES),
])
def test_unknown_name_is_an_error_naming_the_allowed_values(make, kind, allowed):
    with pytest.raises(ValueError, match=f"unknown {kind} 'write-through'") as err:
        make("write-through")
    assert all(name in str(err.value) for name in allowed)


def test_write_through_stores_every_page_of_every_running_request():
    policy = make_write_policy("write_through")
    assert policy.running_requests(SCHEDULED) == SCHEDULED
    assert policy.pages_worth_storing(pages("p0", "p1", "p2"), counted=0) == 3


def test_write_back_stores_nothing_while_running_and_everything_at_the_end():
    policy = make_write_policy("write_back")
    assert policy.running_requests(SCHEDULED) == {}
    # request_finished asks for the pages of the finished request: all of them.
    assert policy.pages_worth_storing(pages("p0", "p1", "p2"), counted=0) == 3


def test_selective_stores_the_prefix_that_reached_the_threshold():
    policy = make_write_policy("write_through_selective", threshold=2)
    assert policy.running_requests(SCHEDULED) == SCHEDULED
    first = pages("p0", "p1", "p2")
    assert policy.pages_worth_storing(first, counted=0) == 0  # computed once
    # The same request asking again counts only its new pages.
    assert policy.pages_worth_storing(first, counted=3) == 0
    second = pages("p0", "p1", "q2")  # shares two pages with the first
    assert policy.pages_worth_storing(second, counted=0) == 2
    third = pages("p0", "p1", "p2")
    assert policy.pages_worth_storing(third, counted=0) == 3


def test_selective_threshold_of_one_stores_at_first_computation():
    policy = make_write_policy("write_through_selective", threshold=1)
    assert policy.pages_worth_storing(pages("p0", "p1"), counted=0) == 2


def test_selective_memory_is_bounded_and_forgets_the_least_recent_page():
    policy = WriteThroughSelective(threshold=2, capacity=2)
    policy.pages_worth_storing(pages("a"), counted=0)
    policy.pages_worth_storing(pages("b", "c"), counted=0)  # "a" is forgotten
    assert policy.pages_worth_storing(pages("a"), counted=0) == 0  # counted anew
    assert policy.pages_worth_storing(pages("a"), counted=0) == 1


def test_selective_memory_grows_with_the_l2_pool():
    small = make_write_policy("write_through_selective", threshold=3, l2_pages=10)
    large = make_write_policy("write_through_selective", threshold=3, l2_pages=10_000)
    assert isinstance(small, WriteThroughSelective) and isinstance(large, WriteThroughSelective)
    assert (small.threshold, small.capacity) == (3, 4096)
    assert large.capacity == 80_000


def test_best_effort_and_wait_complete_timeouts():
    assert make_prefetch_policy("best_effort").timeout_s(10_000) == 0.0
    assert make_prefetch_policy("wait_complete").timeout_s(10_000) is None


def test_timeout_grows_with_the_fetch_up_to_its_cap():
    policy = make_prefetch_policy("timeout", {"prefetch_timeout_base": 1.0,
                                              "prefetch_timeout_per_ki_token": 0.5,
                                              "prefetch_timeout_max": 3.0})
    assert policy == Timeout(base_s=1.0, per_ki_token_s=0.5, max_s=3.0)
    assert policy.timeout_s(0) == 1.0
    assert policy.timeout_s(2048) == 2.0
    assert policy.timeout_s(1 << 20) == 3.0


def test_timeout_defaults_are_sglangs():
    policy = make_prefetch_policy("timeout")
    assert policy.timeout_s(1024) == pytest.approx(2.1)
    assert policy.timeout_s(1 << 30) == 30.0


def test_lru_evicts_the_least_recent_leaf_tail_first():
    ticks = itertools.count()
    tree = HiRadixTree(clock=lambda: float(next(ticks)))
    tree.insert(pages("a0", "a1", "a2"), [0, 1, 2])
    tree.insert(pages("b0", "b1"), [3, 4])
    policy = make_eviction_policy()
    assert isinstance(policy, LeafFirstLRU)
    assert policy.evict(tree, 2) == [1, 2]  # "a" is older; its head page stays
    assert tree.match_prefix(pages("a0", "a1")).num_pages == 1
    tree.lock(tree.match_prefix(pages("b0", "b1")).node)
    assert policy.evict(tree, 5) == [0]  # locked pages never leave


def test_tlru_takes_every_conversations_tail_before_any_history():
    ticks = itertools.count()
    tree = HiRadixTree(clock=lambda: float(next(ticks)))
    tree.insert(pages(*(f"a{i}" for i in range(6))), list(range(6)))
    tree.insert(pages(*(f"b{i}" for i in range(6))), list(range(6, 12)))
    lru, tlru = make_eviction_policy("lru"), make_eviction_policy("tlru", tail_pages=2)
    # LRU takes four pages of the older conversation: its next turn recomputes four.
    assert sorted(lru.evict(tree, 4)) == [2, 3, 4, 5]
    tree.check_invariants()
    # Both back (the same pages again: their lost tails return).
    tree.insert(pages(*(f"a{i}" for i in range(6))), list(range(6)))
    tree.insert(pages(*(f"b{i}" for i in range(6))), list(range(6, 12)))
    # tlru takes two from each end first: neither turn recomputes more than two.
    assert sorted(tlru.evict(tree, 4)) == [4, 5, 10, 11]
    assert tree.peek(pages(*(f"a{i}" for i in range(6)))) == 4
    # Past every tail, LRU again: the older conversation goes on losing.
    assert sorted(tlru.evict(tree, 1)) == [3]
    tree.check_invariants()
    with pytest.raises(ValueError, match="tail_pages"):
        make_eviction_policy("tlru", tail_pages=0)


def test_all_admits_every_stored_page_to_l3():
    rule = make_l3_admission("all")
    assert rule.admit(pages("a", "b"), returns=False) == 2
    assert rule.reused(pages("a", "b")) == []


def test_reused_admits_a_page_the_second_time_it_is_used():
    rule = make_l3_admission("reused", l2_pages=4)
    assert rule.admit(pages("s", "a1", "a2"), returns=False) == 0  # first computations
    # A later request reaches s and a1 in L2: both go to L3 now, once.
    assert rule.reused(pages("s", "a1")) == [0, 1]
    assert rule.reused(pages("s", "a1", "a2")) == [2]
    assert rule.reused(pages("s", "a1", "a2")) == []
    # A page that left every tier and is computed again is admitted with its store;
    # admission is a prefix: a new page ends it.
    assert rule.admit(pages("b1", "b2"), returns=False) == 0
    assert rule.admit(pages("b1", "b2", "b3"), returns=False) == 2
    # A request whose hints say it returns (retain_s) is admitted whole.
    assert rule.admit(pages("c1", "c2"), returns=True) == 2


def test_reused_forgets_the_oldest_pages_beyond_its_capacity():
    rule = AdmitReused(capacity=2)
    rule.admit(pages("a", "b", "c"), returns=False)
    assert rule.admit(pages("a"), returns=False) == 0  # forgotten: new again
    assert rule.admit(pages("c"), returns=False) == 1
