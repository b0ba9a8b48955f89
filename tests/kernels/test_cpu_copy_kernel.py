"""kernels/cpu_copy_kernel.py: memcpy of byte ranges, checked before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from hicache.kernels.cpu_copy_kernel import batch_copy  # noqa: E402


def ranges(*rows: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst, n = zip(*rows, strict=True)
    return (np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
            np.array(n, dtype=np.int64))


def test_copies_each_range_in_order_and_nothing_else():
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    want = dst.copy()
    rows = [(0, 4096, 4096), (40_000, 100, 7), (12_345, 60_000, 5_536), (9, 30_000, 0)]
    for s, d, n in rows:
        want[d : d + n] = src[s : s + n]
    s_off, d_off, n = ranges(*rows)
    batch_copy(src, s_off, dst, d_off, n)
    assert np.array_equal(dst, want)


def test_a_later_range_overwrites_an_earlier_one():
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(8, dtype=np.uint8)
    s_off, d_off, n = ranges((0, 0, 8), (8, 4, 4))
    batch_copy(src, s_off, dst, d_off, n)
    assert dst.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


@pytest.mark.parametrize("row", [(0, 5, 4), (6, 0, 4), (-1, 0, 1), (0, -1, 1), (0, 0, -1)])
def test_a_range_outside_its_array_raises_before_any_copy(row):
    src = np.arange(8, dtype=np.uint8)
    dst = np.zeros(8, dtype=np.uint8)
    s_off, d_off, n = ranges((0, 0, 2), row)  # the first range is valid
    with pytest.raises(IndexError, match="outside its array"):
        batch_copy(src, s_off, dst, d_off, n)
    assert not dst.any()
