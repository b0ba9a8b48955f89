import pytest

from hicache.tiers.index.slot_allocator import SlotAllocator, slots_for_budget


def test_alloc_all_or_nothing_and_exhaustion():
    a = SlotAllocator(4)
    assert (a.capacity, a.num_free, a.num_used) == (4, 4, 0)
    first = a.alloc(3)
    assert first is not None and len(set(first)) == 3
    assert a.alloc(2) is None
    assert a.num_free == 1  # the failed alloc took nothing
    last = a.alloc(1)
    assert last is not None and set(first + last) == {0, 1, 2, 3}
    assert a.alloc(1) is None
    assert a.alloc(0) == []
    a.free(first)
    assert (a.num_free, a.num_used) == (3, 1)
    again = a.alloc(3)
    assert again is not None and sorted(again) == sorted(first)


def test_double_free_and_out_of_range_raise_without_side_effects():
    a = SlotAllocator(4)
    slots = a.alloc(2)
    assert slots is not None
    a.free([slots[0]])
    with pytest.raises(ValueError, match="double free"):
        a.free([slots[1], slots[0]])
    assert a.num_free == 3  # slots[1] was not freed by the failing call
    with pytest.raises(ValueError, match="double free"):
        a.free([slots[1], slots[1]])
    with pytest.raises(ValueError, match="out of range"):
        a.free([4])
    with pytest.raises(ValueError, match="out of range"):
        a.free([-1])
    a.free([slots[1]])
    assert a.num_free == 4


def test_invalid_sizes():
    with pytest.raises(ValueError):
        SlotAllocator(0)
    with pytest.raises(ValueError):
        SlotAllocator(1).alloc(-1)


def test_slots_for_budget():
    assert slots_for_budget(10, 3) == 3
    assert slots_for_budget(9, 3) == 3
    assert slots_for_budget(2**34, 2**20) == 2**14
    with pytest.raises(ValueError, match=r"2 bytes.*smaller than one page.*3 bytes"):
        slots_for_budget(2, 3)
    with pytest.raises(ValueError):
        slots_for_budget(10, 0)
