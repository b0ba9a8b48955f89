"""What the L3 store benchmarks (l3_mooncake, l3_lmcache) share.

Contract:
- ``source_pool(page_bytes, n)``: a page_first_direct ``HostPagePool`` of 2n
  one-block pages, slots [0, n) filled with seeded random bytes (the pages
  written), slots [n, 2n) where they are read back.
- ``timed(fn)``: (seconds, result) of one call.
- ``ours_round(backend, pool, keys, batch_pages, samples, check=)``: one timed
  store of slots [0, n) under ``keys`` (``write``), then, with slots
  [n, 2n) zeroed, one timed load into them (``read``), in batches of
  ``batch_pages``; appends GB/s (1e9 payload bytes per second) to
  ``samples["ours_put"]`` / ``samples["ours_get"]``; raises ``RuntimeError``
  naming the backend when a page was not stored or loaded; with ``check``,
  asserts the bytes read equal the bytes written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageBackend, WriteBatch


def source_pool(page_bytes: int, num_pages: int) -> HostPagePool:
    geom = PoolGeometry(num_slots=2 * num_pages, num_layers=1, blocks_per_page=1,
                        block_bytes=page_bytes)
    pool = HostPagePool(geom, layout="page_first_direct", pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    src = pool.buffer[:num_pages].view(-1)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, generator=gen))
    return pool


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ours_round(backend: StorageBackend, pool: HostPagePool, keys: list[str], batch_pages: int,
               samples: dict[str, list[float]], *, check: bool) -> None:
    n = len(keys)
    payload = n * pool.geometry.page_bytes
    batches = [(lo, min(lo + batch_pages, n)) for lo in range(0, n, batch_pages)]
    name = type(backend).__name__
    secs, ok = timed(lambda: sum(
        sum(backend.write(WriteBatch(keys[lo:hi], list(range(lo, hi))))) for lo, hi in batches))
    if ok != n:
        raise RuntimeError(f"{name} stored {ok}/{n} pages")
    samples["ours_put"].append(payload / secs / 1e9)
    pool.buffer[n:].zero_()
    secs, ok = timed(lambda: sum(
        sum(backend.read(ReadBatch(keys[lo:hi], list(range(n + lo,
                                                           n + hi))))) for lo, hi in batches))
    if ok != n:
        raise RuntimeError(f"{name} loaded {ok}/{n} pages")
    samples["ours_get"].append(payload / secs / 1e9)
    if check:
        assert torch.equal(pool.buffer[:n], pool.buffer[n:])
