"""Checks every network L3 backend's tests run alike (Mooncake, LMCache), on a real store.

Contract: the page geometry and key namespace of those tests (two TP ranks),
their config, keys, seeded pools and counter deltas; ``check_round_trip``
(writer's slots to reader's slots, bit-exact, plus a miss), ``check_exists_and_dedup``
(consecutive exists, dedup within one instance and across two) and
``read_in_another_process`` (a fresh interpreter builds the backend by name
and reads pages back). Each asserts what the backend contract promises and
returns what the caller may check further; nothing here starts a store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from typing import Any

import torch

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageConfig, StorageStats, WriteBatch

GEOM = PoolGeometry(num_slots=8, num_layers=3, blocks_per_page=2, block_bytes=1024)
NS = KeyNamespace("tiny", "float32", "cpu:NHD", 64, 2)
# writer, reader layouts: the last two share L3 byte order
ROUND_TRIP_LAYOUTS = [("page_first", "page_first"), ("layer_first", "page_first_direct"),
                      ("page_first_direct", "layer_first")]


def config(extra: dict, *, rank: int = 0, layout: str = "page_first") -> StorageConfig:
    return StorageConfig(tp_rank=rank, tp_size=2, namespace=NS.fingerprint(), mem_layout=layout,
                         page_bytes=GEOM.page_bytes, extra_config=extra)


def keys(n: int, seed: int) -> list[str]:
    return [k.hex() for k in page_keys(NS.seed(), list(range(seed, seed + 64 * n)), 64)]


def filled_pool(layout: str, seed: int) -> HostPagePool:
    pool = HostPagePool(GEOM, layout=layout, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    return pool


def delta(backend: StorageBackend, before: StorageStats) -> StorageStats:
    now = backend.stats().as_dict()
    return StorageStats(**{k: v - before.as_dict()[k] for k, v in now.items()})


def pool_of(backend: StorageBackend) -> HostPagePool:
    assert backend.pool is not None
    return backend.pool


def check_round_trip(a: StorageBackend, b: StorageBackend, seed: int) -> StorageStats:
    """Five pages from ``a``'s slots into ``b``'s, bit-exact, then one miss beside a hit.
    Returns ``b``'s counters over the exists and the read."""
    a0, b0 = a.stats(), b.stats()
    ks = keys(5, seed=seed)
    assert a.write(WriteBatch(ks, [0, 1, 2, 3, 4])) == [True] * 5
    assert delta(a, a0).set_pages == 5 and delta(a, a0).bytes_written == 5 * GEOM.page_bytes
    assert b.exists_prefix(ks) == 5
    assert b.read(ReadBatch(ks, [7, 6, 5, 4, 3])) == [True] * 5
    for s, d in zip([0, 1, 2, 3, 4], [7, 6, 5, 4, 3], strict=True):
        assert torch.equal(pool_of(a).canonical[s], pool_of(b).canonical[d])
    st = delta(b, b0)
    assert (st.get_hits, st.get_misses, st.corrupt_pages) == (5, 0, 0)
    assert st.bytes_read == 5 * GEOM.page_bytes
    # a missing page is a plain miss, the others in the batch still load
    assert b.read(ReadBatch([ks[0], keys(1, seed=99_999)[0]], [0, 1])) == [True, False]
    assert delta(b, b0).get_misses == 1 and delta(b, b0).corrupt_pages == 0
    return st


def check_exists_and_dedup(backend: StorageBackend, other: StorageBackend,
                           seed: int) -> list[str]:
    """Consecutive exists; a set skips what exists, in the same instance and in another
    one on the same store. Returns the five keys (the first four stored)."""
    ks = keys(5, seed=seed)
    assert backend.exists_prefix([]) == 0
    assert backend.write(WriteBatch([ks[0], ks[1], ks[3]], [0, 1, 3])) == [True] * 3
    assert backend.exists_prefix(ks) == 2
    assert backend.exists_prefix(ks[3:]) == 1
    assert backend.exists_prefix(ks[2:]) == 0
    before = backend.stats()
    assert backend.write(WriteBatch([ks[0], ks[2]], [5, 2])) == [True, True]
    assert delta(backend, before).set_skipped_existing == 1
    assert delta(backend, before).set_pages == 1
    # another instance (another engine's rank 0) dedups against the same store
    before = other.stats()
    assert other.write(WriteBatch(ks[:4], [0, 1, 2, 3])) == [True] * 4
    assert delta(other, before).set_skipped_existing == 4 and delta(other, before).set_pages == 0
    return ks


_READER = textwrap.dedent("""
    import json, sys, xxhash
    from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
    from hicache.tiers.l3.base import ReadBatch, StorageConfig
    from hicache.tiers.l3.factory import create_backend
    args = json.loads(sys.argv[1])
    b = create_backend(args["backend"], StorageConfig(**args["config"]))
    pool = HostPagePool(PoolGeometry(**args["geom"]), layout="page_first_direct",
                        pin_memory=False)
    b.register_host_pool(pool)
    n = b.exists_prefix(args["keys"])
    ok = b.read(ReadBatch(args["keys"], list(range(len(args["keys"])))))
    digests = [xxhash.xxh3_64_hexdigest(pool.read_page(i).numpy().tobytes()) if o else None
               for i, o in enumerate(ok)]
    print(json.dumps({"exists": n, "ok": ok, "digests": digests}))
    b.close()
""")


def read_in_another_process(writer: StorageBackend, backend_name: str, extra: dict, *,
                            env: Mapping[str, str] | None = None, timeout_s: float) -> None:
    """``writer`` (page_first_direct) stores four pages; a new interpreter with a
    ``backend_name`` backend of the same config finds and reads them bit-exact."""
    import xxhash

    ks = keys(4, seed=4000)
    assert writer.write(WriteBatch(ks, [4, 5, 6, 7])) == [True] * 4
    cfg = config(extra, layout="page_first_direct")
    args: dict[str, Any] = {
        "backend": backend_name,
        "geom": {"num_slots": GEOM.num_slots, "num_layers": GEOM.num_layers,
                 "blocks_per_page": GEOM.blocks_per_page, "block_bytes": GEOM.block_bytes},
        "config": {"tp_rank": cfg.tp_rank, "tp_size": cfg.tp_size, "namespace": cfg.namespace,
                   "mem_layout": cfg.mem_layout, "page_bytes": cfg.page_bytes,
                   "extra_config": cfg.extra_config},
        "keys": ks}
    proc = subprocess.run([sys.executable, "-c", _READER, json.dumps(args)],
                          env=None if env is None else dict(env), capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exists"] == 4 and result["ok"] == [True] * 4
    want = [xxhash.xxh3_64_hexdigest(pool_of(writer).read_page(s).numpy().tobytes())
            for s in (4, 5, 6, 7)]
    assert result["digests"] == want
