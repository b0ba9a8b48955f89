"""Bookkeeping of the L2 host pool's page slots.

The scheduler process decides which slot each page goes to and records it in
the radix tree; the worker processes own the bytes behind the slots. This
module is only the free list: slots are ints in ``[0, capacity)``.

Contract: :meth:`SlotAllocator.alloc` is all-or-nothing (``None`` when fewer
than ``n`` slots are free); :meth:`SlotAllocator.free` validates every slot
before freeing any, and raises on out-of-range or double free, because a slot
freed twice would later be handed to two pages and silently mix their KV.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class SlotAllocator:
    """Free list over ``num_slots`` host page slots; O(n) per call."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self._capacity = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._in_use = bytearray(num_slots)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` slots, or ``None`` (taking nothing) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > len(self._free):
            return None
        slots = [self._free.popleft() for _ in range(n)]
        for s in slots:
            self._in_use[s] = 1
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the free list; raises (freeing nothing) on a bad slot."""
        slots = list(slots)
        seen: set[int] = set()
        for s in slots:
            if not 0 <= s < self._capacity:
                raise ValueError(f"slot {s} out of range [0, {self._capacity})")
            if not self._in_use[s] or s in seen:
                raise ValueError(f"double free of slot {s}")
            seen.add(s)
        for s in slots:
            self._in_use[s] = 0
        self._free.extend(slots)


def slots_for_budget(budget_bytes: int, page_bytes: int) -> int:
    """Number of whole pages of ``page_bytes`` that fit in ``budget_bytes``."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    n = max(budget_bytes, 0) // page_bytes
    if n == 0:
        raise ValueError(
            f"host pool budget of {budget_bytes} bytes is smaller than one page "
            f"of {page_bytes} bytes"
        )
    return n
