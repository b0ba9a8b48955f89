"""Where Mooncake reads through its transfer lose against the raw client: a profile.

Usage: ``python -m hicache.integration.bench.micro.mooncake_gap [--page-mib 1,4]
[--total-mib 256] [--repeats 5]``. Starts its own mooncake_master on 127.0.0.1
and, in one process, with every object of ours in the backend's own segment but
reads in place turned off (as for objects in another engine's segment), times
the same pages five ways, medians in GB/s against the raw client's
``batch_get_into``:
- ``bare``: Mooncake's multi-buffer get of our objects, the backend's exact
  call (header into an arena, payload into the slot), nothing else;
- ``ours, no check``: ``MooncakeBackend.read`` with the checksum pass replaced
  by zeros (and corrupt objects kept): everything of the backend but the hash;
- ``ours``: ``MooncakeBackend.read`` as shipped;
- ``hash``: the checksum pass alone over the pages read.
A diagnostic, not a shipped path: the no-check row patches the read path's
checksum call for its duration. Every page read back is checked bit-exact.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.integration.bench.micro.store_rounds import source_pool
from hicache.integration.bench.mooncake_service import apply_client_env, start_mooncake
from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.integrity import HEADER_BYTES
from hicache.tiers.l3.mooncake import reads
from hicache.tiers.l3.mooncake.backend import MooncakeBackend
from hicache.tiers.l3.mooncake.records import ARENA_PAGES


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def profile(page_bytes: int, total_bytes: int, repeats: int) -> dict[str, float]:
    """GB/s of each way (see the module docstring) and the raw client's."""
    apply_client_env()
    n = max(1, total_bytes // page_bytes)
    pool = source_pool(page_bytes, n)
    base, gb = pool.buffer.data_ptr(), n * page_bytes / 1e9
    keys = [f"{i:064x}" for i in range(n)]
    into = ReadBatch(keys, [n + s for s in range(n)])
    with start_mooncake() as svc:
        backend = MooncakeBackend(StorageConfig(
            0, 1, "gap", "page_first_direct", page_bytes,
            extra_config={**svc.extra_config(3 * n * (page_bytes + HEADER_BYTES) + (64 << 20)),
                          "verify": "inline"}))
        try:
            backend.register_host_pool(pool)
            assert all(backend.write(WriteBatch(keys, list(range(n)))))
            backend._segment = None  # every read through Mooncake's transfer
            raw = backend._store
            raw_keys = [f"raw-{i}" for i in range(n)]
            raw.batch_put_from(raw_keys, [base + i * page_bytes for i in range(n)],
                               [page_bytes] * n)
            okeys = [backend.object_key(k) for k in keys]
            arena = torch.zeros(n * HEADER_BYTES, dtype=torch.uint8)
            raw.register_buffer(arena.data_ptr(), arena.numel())
            chunk = ARENA_PAGES  # the backend's calls: at most this many records each

            def bare() -> None:
                for lo in range(0, n, chunk):
                    hi = min(n, lo + chunk)
                    raw.batch_get_into_multi_buffers(
                        okeys[lo:hi],
                        [[arena.data_ptr() + i * HEADER_BYTES, base + (n + i) * page_bytes]
                         for i in range(lo, hi)],
                        [[HEADER_BYTES, page_bytes]] * (hi - lo))

            secs: dict[str, float] = {}
            secs["raw"] = _median_s(lambda: raw.batch_get_into(
                raw_keys, [base + (n + i) * page_bytes for i in range(n)], [page_bytes] * n),
                repeats)
            secs["bare"] = _median_s(bare, repeats)
            secs["ours"] = _median_s(lambda: backend.read(into), repeats)
            shipped, keep = integrity.checksums_at, backend._remove_corrupt
            try:
                reads.integrity.checksums_at = (
                    lambda addresses, payloads, length, known=None: [0] * len(addresses))
                backend._remove_corrupt = lambda okeys: None  # type: ignore[method-assign]
                reads.logger.disabled = True  # every page "corrupt": nothing to say
                secs["ours, no check"] = _median_s(lambda: backend.read(into), repeats)
            finally:
                reads.integrity.checksums_at = shipped
                backend._remove_corrupt = keep  # type: ignore[method-assign]
                reads.logger.disabled = False
            assert all(backend.read(into))
            assert torch.equal(pool.buffer[n:2 * n], pool.buffer[:n])
            secs["hash"] = _median_s(lambda: shipped(
                [base + (n + i) * page_bytes for i in range(n)],
                [pool.buffer[n + i].view(-1).numpy() for i in range(n)], page_bytes), repeats)
            raw.unregister_buffer(arena.data_ptr())
        finally:
            backend.close()
    return {name: gb / s for name, s in secs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page-mib", default="1,4")
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"{'page':>6} {'raw GB/s':>9} {'bare':>7} {'ours, no check':>15} {'ours':>7} "
          f"{'hash GB/s':>10}")
    for mib in (float(x) for x in args.page_mib.split(",")):
        r = profile(int(mib * (1 << 20)), args.total_mib << 20, args.repeats)
        raw = r["raw"]
        print(f"{mib:>4g}Mi {raw:>9.2f} {r['bare'] / raw:>6.2f}x "
              f"{r['ours, no check'] / raw:>14.2f}x {r['ours'] / raw:>6.2f}x {r['hash']:>10.2f}")


if __name__ == "__main__":
    main()
