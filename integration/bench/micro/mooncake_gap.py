"""Where Mooncake reads through its transfer lose against the raw client: a profile.

Usage: ``python -m hicache.integration.bench.micro.mooncake_gap [--page-mib 1,4]
[--total-mib 256] [--repeats 5] [--schedules [--group-mib 4,16,64]]``. Starts its own mooncake_master on 127.0.0.1
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
With ``--schedules``, four ways to run the same get and check that the backend
does not ship, each over groups of ``--group-mib`` of pages:
- ``grouped``: get a group, then hash it while it is still in the CPU's cache;
- ``pipelined``: a helper thread hashes group i while the get of group i+1 runs;
- ``ranged``: one get session per call's worth of pages (replicas queried once),
  then a ranged get per group and its hash;
- ``staged``: get a group into a small staging buffer, then copy it into the
  slots and hash it in the same pass (``native_io.copy_records``, as reads in
  place do), so the check reads the staging buffer from the CPU's cache.
A diagnostic, not a shipped path: the no-check row patches the read path's
checksum call for its duration. Every page read back is checked bit-exact.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from hicache.integration.bench.micro.store_rounds import source_pool
from hicache.integration.bench.mooncake_service import apply_client_env, start_mooncake
from hicache.tiers.l3 import integrity, native_io
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


def _schedules(raw: Any, okeys: list[str], arena: int, dests: list[int], page_bytes: int,
               group_mib: list[int], repeats: int) -> dict[str, float]:
    """Seconds of each schedule (the module docstring) per group size."""
    n = len(okeys)

    def get(lo: int, hi: int, ranged: bool = False) -> None:
        buffers = [[arena + i * HEADER_BYTES, dests[i]] for i in range(lo, hi)]
        sizes = [[HEADER_BYTES, page_bytes]] * (hi - lo)
        if ranged:
            raw.batch_get_into_multi_buffer_ranges(okeys[lo:hi], buffers, sizes,
                                                   [[0, HEADER_BYTES]] * (hi - lo))
        else:
            raw.batch_get_into_multi_buffers(okeys[lo:hi], buffers, sizes)

    def groups(per: int, lo: int = 0, hi: int = n) -> list[tuple[int, int]]:
        return [(a, min(hi, a + per)) for a in range(lo, hi, per)]

    def grouped(per: int) -> None:
        for lo, hi in groups(per):
            get(lo, hi)
            native_io.checksums_at(dests[lo:hi], page_bytes)

    def pipelined(per: int) -> None:
        pending = []
        for lo, hi in groups(per):
            get(lo, hi)
            pending.append(helper.submit(native_io.checksums_at, dests[lo:hi], page_bytes))
        for f in pending:
            f.result()

    def ranged(per: int) -> None:
        for lo, hi in groups(ARENA_PAGES):
            raw.batch_get_session_start(okeys[lo:hi])
            for a, b in groups(per, lo, hi):
                get(a, b, ranged=True)
                native_io.checksums_at(dests[a:b], page_bytes)
            raw.batch_get_session_end(okeys[lo:hi])

    record = HEADER_BYTES + page_bytes
    staging = torch.zeros(max(1, (max(group_mib) << 20) // page_bytes) * record,
                          dtype=torch.uint8)
    stage = staging.data_ptr()
    raw.register_buffer(stage, staging.numel())

    def staged(per: int) -> None:
        for lo, hi in groups(per):
            k = hi - lo
            raw.batch_get_into_multi_buffers(
                okeys[lo:hi], [[stage + i * record, stage + i * record + HEADER_BYTES]
                               for i in range(k)], [[HEADER_BYTES, page_bytes]] * k)
            native_io.copy_records([stage + i * record for i in range(k)],
                                   [arena + i * HEADER_BYTES for i in range(lo, hi)],
                                   dests[lo:hi], HEADER_BYTES, page_bytes)

    out: dict[str, float] = {}
    with ThreadPoolExecutor(1) as helper:
        for mib in group_mib:
            per = max(1, (mib << 20) // page_bytes)
            for fn in (grouped, pipelined, ranged, staged):
                out[f"{fn.__name__} {mib} MiB"] = _median_s(partial(fn, per), repeats)
    raw.unregister_buffer(stage)
    return out


def profile(page_bytes: int, total_bytes: int, repeats: int,
            group_mib: list[int] | None = None) -> dict[str, float]:
    """GB/s of each way (see the module docstring) and the raw client's; with
    ``group_mib``, of each schedule per group size too."""
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
            if group_mib:
                secs.update(_schedules(raw, okeys, arena.data_ptr(),
                                       [base + (n + i) * page_bytes for i in range(n)],
                                       page_bytes, group_mib, repeats))
                assert torch.equal(pool.buffer[n:2 * n], pool.buffer[:n])
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
    p.add_argument("--schedules", action="store_true",
                   help="also time the grouped, pipelined, ranged and staged schedules")
    p.add_argument("--group-mib", default="4,16,64",
                   help="group sizes of those schedules, MiB")
    args = p.parse_args()
    group_mib = [int(x) for x in args.group_mib.split(",")] if args.schedules else None
    print(f"{'page':>6} {'raw GB/s':>9} {'bare':>7} {'ours, no check':>15} {'ours':>7} "
          f"{'hash GB/s':>10}")
    for mib in (float(x) for x in args.page_mib.split(",")):
        r = profile(int(mib * (1 << 20)), args.total_mib << 20, args.repeats, group_mib)
        raw = r["raw"]
        print(f"{mib:>4g}Mi {raw:>9.2f} {r['bare'] / raw:>6.2f}x "
              f"{r['ours, no check'] / raw:>14.2f}x {r['ours'] / raw:>6.2f}x {r['hash']:>10.2f}")
        for name in (k for k in r if k.endswith(" MiB")):
            print(f"{'':>6} {name:>20}: {r[name] / raw:.2f}x")


if __name__ == "__main__":
    main()
