"""tiers/host_cpus.py: Linux CPU lists read and written, and a real thread pinned and
given its own affinity back."""

from __future__ import annotations

import os

import pytest
from support.threads import in_thread

from hicache.tiers.host_cpus import format_cpus, parse_cpu_list, pin_current_thread, running_on


def test_cpu_lists_read_and_write_linux_cpulist_form():
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list(" 5 \n") == {5}
    assert format_cpus({8, 0, 1, 2, 3, 10, 11}) == "0-3,8,10-11"
    assert format_cpus(set()) == ""
    for bad in ("x", "3-1", "-2", "1,,2"):
        with pytest.raises(ValueError, match="not a CPU number or range"):
            parse_cpu_list(bad)


def test_a_thread_is_pinned_where_the_cpuset_allows_and_left_alone_elsewhere():
    mine = frozenset(os.sched_getaffinity(0))
    one = frozenset({max(mine)})
    assert in_thread(lambda: (pin_current_thread(one), os.sched_getaffinity(0))) == (True, one)
    absent = frozenset({max(range(os.cpu_count() or 1)) + 1})  # no such CPU here
    assert in_thread(lambda: (pin_current_thread(absent), os.sched_getaffinity(0))) \
        == (False, mine)
    assert in_thread(lambda: pin_current_thread(frozenset())) is False


def test_a_block_runs_on_the_cpus_then_the_thread_gets_its_own_back():
    mine = frozenset(os.sched_getaffinity(0))
    one = frozenset({min(mine)})

    def inside_and_after() -> tuple[set[int], set[int]]:
        with running_on(one):
            inside = os.sched_getaffinity(0)
        return inside, os.sched_getaffinity(0)

    assert in_thread(inside_and_after) == (one, mine)
