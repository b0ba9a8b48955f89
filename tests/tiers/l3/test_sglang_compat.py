"""tiers/l3/sglang_compat.py: a store written to SGLang's HiCacheStorage interface
(tests/support/sglang_style_store.py, per-key files) loaded through ``dynamic`` and run
behind the batch contract: real files under tmp_path, a real host pool."""

from __future__ import annotations

import pytest
import torch
from support.sglang_style_store import SGLangStyleFileStore

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageConfig, StorageConfigError, WriteBatch
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.guard import GuardedBackend
from hicache.tiers.l3.sglang_compat import SGLangStorage, is_sglang_storage

GEOM = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu:NHD", 16, 2)
STORE = {"module_path": "support.sglang_style_store", "class_name": "SGLangStyleFileStore"}
KEYS = [k.hex() for k in page_keys(NS.seed(), list(range(16 * 6)), 16)]


def backend(tmp_path, layout: str = "page_first", rank: int = 0) -> GuardedBackend:
    cfg = StorageConfig(rank, 2, NS.fingerprint(), layout, GEOM.page_bytes, model_name="tiny",
                        extra_config={**STORE, "path": str(tmp_path)})
    b = create_backend("dynamic", cfg)
    pool = HostPagePool(GEOM, layout=layout, pin_memory=False)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(rank + 7)))
    b.register_host_pool(pool)
    return b


def store_of(b: GuardedBackend) -> SGLangStyleFileStore:
    assert isinstance(b.inner, SGLangStorage)
    return b.inner.store


# writer, reader layouts of one L3 byte order (layer_first through staging pages)
@pytest.mark.parametrize(("writer", "reader"), [("page_first", "page_first"),
                                                ("layer_first", "page_first_direct")])
def test_pages_round_trip_bit_exact_through_sglang_calls(tmp_path, writer, reader):
    a, b = backend(tmp_path, writer), backend(tmp_path, reader)
    assert is_sglang_storage(SGLangStyleFileStore)
    assert store_of(a).suffix == "_0_2"  # built as SGLang builds it: its config's rank
    assert a.write(WriteBatch(KEYS[:4], [0, 1, 2, 3])) == [True] * 4
    assert a.write(WriteBatch(KEYS[:2], [4, 5])) == [True, True]  # exists: skipped
    assert b.exists_prefix(KEYS) == 4 and b.exists_prefix(KEYS[4:]) == 0
    assert b.read(ReadBatch(KEYS[:5], [7, 6, 5, 4, 3])) == [True] * 4 + [False]
    assert a.pool is not None and b.pool is not None
    for src, dst in zip([0, 1, 2, 3], [7, 6, 5, 4], strict=True):
        assert torch.equal(a.pool.canonical[src], b.pool.canonical[dst])
    st_a, st_b = a.stats(), b.stats()
    assert (st_a.set_pages, st_a.set_skipped_existing, st_a.set_failures) == (4, 2, 0)
    assert (st_b.get_hits, st_b.get_misses, st_b.corrupt_pages) == (4, 1, 0)
    assert store_of(a).calls["set"] == 4  # the skipped pages were never sent


def test_reads_are_verified_and_ranks_never_alias(tmp_path):
    a = backend(tmp_path)
    assert a.write(WriteBatch(KEYS[:3], [0, 1, 2])) == [True] * 3
    files = sorted(tmp_path.glob("*.bin"), key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0x01
    files[1].write_bytes(bytes(data))
    assert a.read(ReadBatch(KEYS[:3], [5, 6, 7])) == [True, False, True]
    assert a.stats().corrupt_pages == 1
    # Rank 1's pages of the same keys are other objects: nothing of rank 0's is read.
    other = backend(tmp_path, rank=1)
    assert other.exists_prefix(KEYS[:3]) == 0
    assert other.read(ReadBatch(KEYS[:1], [0])) == [False]


def test_clear_is_the_stores_and_deleting_pages_is_a_clear_error(tmp_path):
    a = backend(tmp_path)
    assert a.write(WriteBatch(KEYS[:2], [0, 1])) == [True, True]
    with pytest.raises(NotImplementedError, match="cannot delete"):
        a.delete(KEYS[:1])  # SGLang's interface has no delete: a prefix flush says so
    a.clear()
    assert a.exists_prefix(KEYS[:2]) == 0 and not list(tmp_path.glob("*.bin"))


def test_a_class_with_neither_interface_is_refused_by_name(tmp_path):
    cfg = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes,
                        extra_config={"module_path": "support.sglang_style_store",
                                      "class_name": "Path"})
    with pytest.raises(StorageConfigError, match=r"class_name='Path' is neither a "
                       r"StorageBackend subclass nor a class with SGLang's"):
        create_backend("dynamic", cfg)
