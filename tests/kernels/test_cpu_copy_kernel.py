"""kernels/cpu_copy_kernel.py: memcpy of each layer's runs, checked before any byte moves."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from hicache.kernels.cpu_copy_kernel import copy_runs  # noqa: E402


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def reference(kv, pool, kv_base, kv_stride, pool_at, row_at, start, nbytes, load):
    kv, pool = kv.copy(), pool.copy()
    for j in range(len(kv_base)):
        for k in range(len(start)):
            e, h, n = kv_base[j] + start[k] * kv_stride[j], pool_at[k] + row_at[j], nbytes[k]
            if load:
                kv[e : e + n] = pool[h : h + n]
            else:
                pool[h : h + n] = kv[e : e + n]
    return kv, pool


@pytest.mark.parametrize("load", [False, True])
def test_every_layer_and_run_lands_where_the_offsets_say_and_nothing_else(load):
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 256, size=1 << 14, dtype=np.uint8)
    pool = rng.integers(0, 256, size=1 << 14, dtype=np.uint8)
    # Two layers 8 KiB apart, 64-byte blocks; three runs of 1, 2 and 0 blocks.
    args = (i64(0, 8192), i64(64, 64), i64(100, 4000, 9000), i64(0, 3000),
            i64(3, 40, 7), i64(64, 128, 0))
    want_kv, want_pool = reference(kv, pool, *args, load)
    copy_runs(kv, args[0], args[1], pool, args[2], args[3], args[4], args[5], load)
    assert np.array_equal(kv, want_kv) and np.array_equal(pool, want_pool)


def test_a_later_run_overwrites_an_earlier_one():
    kv = np.arange(16, dtype=np.uint8)
    pool = np.zeros(8, dtype=np.uint8)
    copy_runs(kv, i64(0), i64(1), pool, i64(0, 4), i64(0), i64(0, 8), i64(8, 4), False)
    assert pool.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


@pytest.mark.parametrize("load", [False, True])
@pytest.mark.parametrize("bad", ["kv_end", "pool_end", "negative_at", "negative_bytes"])
def test_a_range_outside_its_array_raises_before_any_copy(load, bad):
    kv = np.arange(1, 17, dtype=np.uint8)
    pool = np.arange(101, 117, dtype=np.uint8)
    before = kv.copy(), pool.copy()
    start, pool_at, nbytes = i64(0, 2), i64(0, 8), i64(4, 4)  # the first run is valid
    if bad == "kv_end":
        start = i64(0, 13)
    elif bad == "pool_end":
        pool_at = i64(0, 13)
    elif bad == "negative_at":
        pool_at = i64(0, -1)
    else:
        nbytes = i64(4, -1)
    with pytest.raises(IndexError, match="outside its array"):
        copy_runs(kv, i64(0), i64(1), pool, pool_at, i64(0), start, nbytes, load)
    assert np.array_equal(kv, before[0]) and np.array_equal(pool, before[1])
