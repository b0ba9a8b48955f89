"""File L3 backend: round trips, crash-safe writes, corruption as counted misses, sharing,
the fan-out / 4 KiB-aligned layout, and O_DIRECT with its buffered fallbacks.

Every test runs three times: with the GIL-free batch path (tiers/l3/native_io.py, what
pool-slot batches use where numba runs), the same with every read's checksum on a helper
thread (``verify: helper``), and with the per-page Python path."""

from __future__ import annotations

import dataclasses
import errno
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.spans import SpanRef
from hicache.tiers.l2 import host_pool as host_pool_module
from hicache.tiers.l2.host_memory import allocate
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3 import integrity, native_io, verify
from hicache.tiers.l3.base import ReadBatch, StorageConfig, StorageConfigError, WriteBatch
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.file.backend import FILE_HEADER_BYTES, FILE_LAYOUT, FileBackend
from hicache.tiers.l3.guard import GuardedBackend, guarded


@pytest.fixture(autouse=True, params=["native", "native-helper", "python"])
def io_path(request, monkeypatch):
    if request.param.startswith("native"):
        if not native_io.available():
            pytest.skip("the GIL-free batch path does not run here (numba or libc missing)")
        # verify: helper wherever the batch path runs (auto picks inline on this host)
        helper = request.param == "native-helper"
        monkeypatch.setattr(verify, "wants_helpers", lambda mode, pool: helper)
    else:
        monkeypatch.setattr(native_io, "available", lambda: False)
    return request.param.partition("-")[0]


# Before the fixture above patches it (it picks the path by itself).
WANTS_HELPERS = verify.wants_helpers
GEOM = PoolGeometry(num_slots=8, num_layers=3, blocks_per_page=2, block_bytes=256)
NS = KeyNamespace("tiny", "float32", "cpu:NHD", 64, 1)


def config(path: Path, *, rank: int = 0, layout: str = "page_first", **extra) -> StorageConfig:
    return StorageConfig(tp_rank=rank, tp_size=2, namespace=NS.fingerprint(), mem_layout=layout,
                         page_bytes=GEOM.page_bytes, extra_config={"path": str(path), **extra})


def keys(n: int, seed: int = 0) -> list[str]:
    return [k.hex() for k in page_keys(NS.seed(), list(range(seed, seed + 64 * n)), 64)]


def filled_pool(layout: str, seed: int) -> HostPagePool:
    pool = HostPagePool(GEOM, layout=layout, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    return pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_round_trip_through_host_slots(tmp_path, layout, io_path):
    src, dst = filled_pool(layout, 1), filled_pool(layout, 2)
    a, b = guarded(FileBackend(config(tmp_path, layout=layout))), guarded(FileBackend(config(tmp_path, layout=layout)))
    a.register_host_pool(src)
    b.register_host_pool(dst)
    # Contiguous slots take the batch path where it runs; layer_first stages a page.
    assert (b.inner._pool_np is not None) == (io_path == "native" and layout != "layer_first")
    ks = keys(4)
    assert a.write(WriteBatch(ks, [0, 1, 2, 3])) == [True] * 4
    assert b.exists_prefix(ks) == 4
    assert b.read(ReadBatch(ks, [7, 6, 5, 4])) == [True] * 4
    for s, d in zip([0, 1, 2, 3], [7, 6, 5, 4], strict=True):
        assert torch.equal(src.canonical[s], dst.canonical[d])
    assert b.stats().get_hits == 4 and b.stats().bytes_read == 4 * GEOM.page_bytes


def test_exists_prefix_counts_consecutive_hits_and_writes_skip_existing(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    backend.register_host_pool(filled_pool("page_first", 3))
    ks = keys(5)
    backend.write(WriteBatch([ks[0], ks[1], ks[3]], [0, 1, 3]))
    assert backend.exists_prefix(ks) == 2
    assert backend.write(WriteBatch([ks[0]], [5])) == [True]
    assert backend.stats().set_skipped_existing == 1


def test_other_rank_or_layout_misses(tmp_path):
    a = guarded(FileBackend(config(tmp_path, rank=0)))
    a.register_host_pool(filled_pool("page_first", 4))
    ks = keys(2)
    a.write(WriteBatch(ks, [0, 1]))
    assert guarded(FileBackend(config(tmp_path, rank=1))).exists_prefix(ks) == 0
    assert guarded(FileBackend(config(tmp_path, layout="page_first_direct"))).exists_prefix(ks) == 0
    # layer_first and page_first_direct slots hold the same byte order: shared.
    assert guarded(FileBackend(config(tmp_path, layout="page_first"))).exists_prefix(ks) == 2


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header_key", "truncate", "append",
                                    "wrong_key_file"])
def test_corruption_is_a_counted_quarantined_miss(tmp_path, damage):
    writer = guarded(FileBackend(config(tmp_path)))
    writer.register_host_pool(filled_pool("page_first", 5))
    ks = keys(2)
    writer.write(WriteBatch(ks, [0, 1]))
    victim = writer.inner.page_path(ks[0])
    data = bytearray(victim.read_bytes())
    if damage == "flip_payload":
        data[-100] ^= 0x40
    elif damage == "flip_header_key":
        data[30] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "append":
        data += b"x"
    else:  # another page's file renamed onto this key
        other = writer.inner.page_path(ks[1])
        data = bytearray(other.read_bytes())
    victim.write_bytes(bytes(data))
    reader = guarded(FileBackend(config(tmp_path)))
    dst = filled_pool("page_first", 6)
    before = dst.buffer[3].clone()
    reader.register_host_pool(dst)
    assert reader.read(ReadBatch([ks[0]], [3])) == [False]
    assert reader.stats().corrupt_pages == 1
    assert not victim.exists() and len(list(reader.inner.quarantine_dir.iterdir())) == 1
    assert reader.exists_prefix(ks) == 0
    assert reader.read(ReadBatch([ks[1]], [2])) == [True]
    del before  # the slot's bytes after a failed get are unspecified; the caller drops it


def test_deleted_between_exists_and_get_is_a_plain_miss(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    backend.register_host_pool(filled_pool("page_first", 7))
    ks = keys(1)
    backend.write(WriteBatch(ks, [0]))
    assert (backend.exists_prefix([ks[0]]) == 1)
    backend.inner.page_path(ks[0]).unlink()
    assert backend.read(ReadBatch(ks, [1])) == [False]
    assert backend.stats().corrupt_pages == 0 and backend.stats().get_misses == 1


def test_capacity_evicts_least_recently_used(tmp_path):
    page_file = FILE_HEADER_BYTES + GEOM.page_bytes
    backend = guarded(FileBackend(config(tmp_path, capacity_gb=3 * page_file / 1e9)))
    backend.register_host_pool(filled_pool("page_first", 8))
    ks = keys(4)
    backend.write(WriteBatch(ks[:3], [0, 1, 2]))
    assert backend.read(ReadBatch(ks[:1], [4])) == [True]  # 0 is now recent
    backend.write(WriteBatch([ks[3]], [3]))
    assert [(backend.exists_prefix([k]) == 1) for k in ks] == [True, False, True, True]
    assert backend.inner.used_bytes <= 3 * page_file and backend.stats().evicted_pages == 1
    # The index is rebuilt from the directory at start.
    assert FileBackend(config(tmp_path, capacity_gb=1)).used_bytes == 3 * page_file


def test_retained_pages_are_passed_over_until_their_deadline(tmp_path, monkeypatch):
    """A retained page (retained before it is even written) outlives older and newer
    plain pages; at its deadline, or when ended (until=0), it is evictable again; when
    only retained pages are left the capacity wins, oldest first. (One page per write:
    a batch may pass the capacity while it is written.)"""
    now = [1000.0]
    monkeypatch.setattr("hicache.tiers.l3.file.capacity.time.time", lambda: now[0])
    page_file = FILE_HEADER_BYTES + GEOM.page_bytes
    backend = guarded(FileBackend(config(tmp_path, capacity_gb=3 * page_file / 1e9)))
    backend.register_host_pool(filled_pool("page_first", 8))
    ks = keys(8)

    def write(*pages: int) -> None:
        for i in pages:
            assert backend.write(WriteBatch([ks[i]], [i])) == [True]

    def held(*pages: int) -> list[bool]:
        return [(backend.exists_prefix([ks[i]]) == 1) for i in pages]

    assert backend.retain([ks[0]], 1060.0) == 1
    write(0, 1, 2, 3, 4)  # two evictions: 1 and 2, not 0
    assert held(0, 1, 2, 3, 4) == [True, False, False, True, True]  # (a read is a use)
    now[0] = 1060.0  # its deadline: plain LRU again, and the oldest page
    write(5)
    assert held(0, 3, 4, 5) == [False, True, True, True]
    assert backend.retain([ks[4], ks[5]], 2000.0) == 2
    assert backend.retain([ks[5]], 0) == 0  # ended now
    write(6)  # 3 goes
    assert held(3, 4, 5, 6) == [False, True, True, True]
    write(7)  # 4 is older but retained: 5 goes
    assert held(4, 5, 6, 7) == [True, False, True, True]
    # Everything retained: the capacity still holds, the oldest retained page goes.
    assert backend.retain([ks[6], ks[7], ks[1]], 2000.0) == 3
    write(1)
    assert backend.inner.used_bytes <= 3 * page_file
    assert held(4, 6, 7, 1) == [False, True, True, True]


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path):
    guarded(FileBackend(config(tmp_path)))
    stale = tmp_path / "tmp" / "x.page.999999999.1.tmp"
    live = tmp_path / "tmp" / f"y.page.{os.getpid()}.1.tmp"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    guarded(FileBackend(config(tmp_path)))
    assert not stale.exists() and live.exists()


def _write_pages(path: str, n: int) -> None:
    backend = guarded(FileBackend(config(Path(path))))
    backend.register_host_pool(filled_pool("page_first", 9))
    assert backend.write(WriteBatch(keys(n), list(range(n)))) == [True] * n


def test_two_processes_share_one_directory(tmp_path):
    proc = mp.get_context("spawn").Process(target=_write_pages, args=(str(tmp_path), 4))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    reader = guarded(FileBackend(config(tmp_path)))
    reader.register_host_pool(filled_pool("page_first", 10))
    assert reader.exists_prefix(keys(4)) == 4
    assert reader.read(ReadBatch(keys(4), [4, 5, 6, 7])) == [True] * 4
    assert torch.equal(reader.pool.buffer[4:8], filled_pool("page_first", 9).buffer[0:4])


def test_factory_builds_the_file_backend(tmp_path):
    backend = create_backend("file", config(tmp_path))
    assert isinstance(backend, GuardedBackend) and isinstance(backend.inner, FileBackend)


def test_bad_config_names_the_key(tmp_path):
    with pytest.raises(StorageConfigError, match="capacity_gb"):
        guarded(FileBackend(config(tmp_path, capacity_gb=-1)))
    with pytest.raises(StorageConfigError, match="allowed keys"):
        guarded(FileBackend(config(tmp_path, bogus=1)))
    with pytest.raises(StorageConfigError, match="allowed values"):
        create_backend("s3", config(tmp_path))
    with pytest.raises(StorageConfigError, match="module_path"):
        create_backend("dynamic", config(tmp_path))


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        ({"capacity_gb": -1}, "hicache_storage_backend_extra_config.capacity_gb must be a "
                              "number >= 0 (got -1)"),
        ({"capacity_gb": True}, "capacity_gb must be a number >= 0 (got True)"),
        ({"fsync": "yes"}, "hicache_storage_backend_extra_config.fsync must be true or false"),
        ({"direct_io": "yes"}, "hicache_storage_backend_extra_config.direct_io='yes' is not "
                               "supported; allowed values: ['off', 'auto', 'on']"),
        ({"direct_io": True}, "direct_io=True is not supported; allowed values"),
        ({"path": 7}, "hicache_storage_backend_extra_config.path must be a string or null"),
        ({"bogus": 1, "other": 2}, "unknown hicache_storage_backend_extra_config key(s) for the "
                                   "file backend: ['bogus', 'other']; allowed keys: "
                                   "['capacity_gb', 'direct_io', 'fsync', 'path', "
                                   "'verify']"),
        ({"verify": "later"}, "hicache_storage_backend_extra_config.verify='later' is not "
                              "supported; allowed values: ['auto', 'inline', 'helper']"),
    ],
)
def test_bad_extra_config_message(tmp_path, extra, expect):
    cfg = dataclasses.replace(config(tmp_path), extra_config={"path": str(tmp_path), **extra})
    with pytest.raises(StorageConfigError) as err:
        guarded(FileBackend(cfg))
    assert expect in str(err.value)


def test_dynamic_loader_keys_are_checked_and_the_rest_passes_through(tmp_path):
    with pytest.raises(StorageConfigError) as err:
        create_backend("dynamic", config(tmp_path, module_path="hicache.tiers.l3.file.backend"))
    assert "hicache_storage_backend_extra_config.class_name is required" in str(err.value)
    with pytest.raises(StorageConfigError, match="module_path must be a non-empty string"):
        create_backend("dynamic", config(tmp_path, module_path="", class_name="FileBackend"))
    with pytest.raises(StorageConfigError, match="cannot be imported"):
        create_backend("dynamic", config(tmp_path, module_path="no.such.module",
                                         class_name="FileBackend"))
    backend = create_backend("dynamic", config(
        tmp_path, module_path="hicache.tiers.l3.file.backend", class_name="FileBackend",
        backend_name="mine", interface_v1=1, fsync=True))
    inner = backend.inner
    assert isinstance(inner, FileBackend) and inner.fsync and inner.root == tmp_path
    assert backend.config.extra_config == {"path": str(tmp_path), "fsync": True}


def test_dynamic_backend_loads_a_third_party_class(tmp_path):
    cfg = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "backend_name": "mine", "module_path": "hicache.tiers.l3.file.backend",
        "class_name": "FileBackend", "path": str(tmp_path)})
    backend = create_backend("dynamic", cfg)
    assert isinstance(backend.inner, FileBackend) and backend.inner.root == tmp_path
    cfg2 = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "module_path": "hicache.tiers.l3.base", "class_name": "StorageConfig"})
    with pytest.raises(StorageConfigError, match="neither a StorageBackend"):
        create_backend("dynamic", cfg2)


def test_delete_removes_one_page(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    backend.register_host_pool(filled_pool("page_first", 11))
    ks = keys(3)
    backend.write(WriteBatch(ks, [0, 1, 2]))
    assert backend.delete([ks[1], ks[1]]) == 1
    assert [(backend.exists_prefix([k]) == 1) for k in ks] == [True, False, True]


@pytest.mark.parametrize(("mode", "pinned", "cpus", "helper"), [
    ("inline", True, 64, False), ("helper", False, 1, True),
    ("auto", True, 64, True),  # a GPU host: pinned pool, cores to spare
    ("auto", False, 64, False),  # a CPU engine: its cores compute the model
    ("auto", True, 2, False)])
def test_verify_picks_where_read_checksums_run(tmp_path, monkeypatch, io_path, mode, pinned,
                                               cpus, helper):
    monkeypatch.setattr(verify, "wants_helpers", WANTS_HELPERS)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    pool = filled_pool("page_first", 1)
    pool.memory.pinned = pinned  # what the choice reads; nothing here is pinned for real
    b = guarded(FileBackend(config(tmp_path, verify=mode)))
    b.register_host_pool(pool)
    pool.memory.pinned = False
    assert (b.inner._verify_helper is not None) == (helper and io_path == "native")
    ks = keys(3)
    assert b.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    assert b.read(ReadBatch(ks, [5, 6, 7])) == [True] * 3
    assert torch.equal(pool.buffer[5:8], pool.buffer[0:3])
    b.close()  # the helper stops; reads after it checksum on their own thread
    assert b.inner._verify_helper is None
    assert b.read(ReadBatch(ks, [5, 6, 7])) == [True] * 3


# ---- layout: fan-out, aligned payload, format version ------------------------------------


def test_pages_fan_out_into_subdirectories_made_on_first_write(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    assert list(backend.inner.pages_dir.iterdir()) == []  # nothing made before a page is written
    backend.register_host_pool(filled_pool("page_first", 12))
    ks = keys(6)
    assert backend.write(WriteBatch(ks, list(range(6)))) == [True] * 6
    for k in ks:
        path = backend.inner.page_path(k)
        assert path == backend.inner.pages_dir / k[:2] / f"{backend.object_key(k)}.page"
        assert path.is_file()
    assert sorted(p.name for p in backend.inner.pages_dir.iterdir()) == sorted({k[:2] for k in ks})
    assert not list(backend.inner.pages_dir.glob("*.page"))  # nothing flat
    assert not list(backend.inner.tmp_dir.iterdir())  # every temp file renamed in


def test_payload_starts_4k_aligned_after_a_zero_padded_header(tmp_path):
    backend = guarded(FileBackend(config(tmp_path, layout="page_first_direct")))
    pool = filled_pool("page_first_direct", 13)
    backend.register_host_pool(pool)
    k = keys(1)[0]
    backend.write(WriteBatch([k], [2]))
    data = backend.inner.page_path(k).read_bytes()
    assert FILE_HEADER_BYTES % 4096 == 0
    assert len(data) == FILE_HEADER_BYTES + GEOM.page_bytes
    payload = data[FILE_HEADER_BYTES:]
    assert payload == bytes(pool.read_page(2).numpy())
    assert data[integrity.HEADER_BYTES:FILE_HEADER_BYTES] == bytes(FILE_HEADER_BYTES
                                                                  - integrity.HEADER_BYTES)
    header = data[:integrity.HEADER_BYTES]
    key_bytes, fp = bytes.fromhex(k), backend.config.fingerprint
    assert integrity.verify(header, key_bytes, fp, payload, layout=FILE_LAYOUT) is None
    # The version field names the padded layout: a reader of the earlier one refuses it.
    assert integrity.verify(header, key_bytes, fp, payload) == "bad magic/version"


@pytest.mark.parametrize("old", ["v2_file", "v2_header_padded", "padding_flipped"])
def test_old_format_or_damaged_padding_is_a_quarantined_miss(tmp_path, old):
    backend = guarded(FileBackend(config(tmp_path)))
    pool = filled_pool("page_first", 14)
    backend.register_host_pool(pool)
    k = keys(1)[0]
    payload = bytes(pool.read_page(0).numpy())
    v2_header = integrity.pack_header(bytes.fromhex(k), backend.config.fingerprint, payload)
    path = backend.inner.page_path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    if old == "v2_file":  # the previous format: 128-byte header, payload right after it
        path.write_bytes(v2_header + payload)
    elif old == "v2_header_padded":  # the new layout with the previous version number
        path.write_bytes(v2_header.ljust(FILE_HEADER_BYTES, b"\0") + payload)
    else:
        backend.write(WriteBatch([k], [0]))
        data = bytearray(path.read_bytes())
        data[FILE_HEADER_BYTES - 1] ^= 0x01
        path.write_bytes(bytes(data))
    assert (backend.exists_prefix([k]) == 1)  # existence is a hint; the read decides
    assert backend.read(ReadBatch([k], [5])) == [False]
    assert backend.stats().corrupt_pages == 1 and backend.stats().get_hits == 0
    assert not path.exists() and len(list(backend.inner.quarantine_dir.iterdir())) == 1
    # Stored again, it is served.
    assert backend.write(WriteBatch([k], [0])) == [True]
    assert backend.read(ReadBatch([k], [5])) == [True]
    assert torch.equal(pool.buffer[5], pool.buffer[0])


def test_flat_files_of_the_earlier_layout_are_never_read_but_counted_and_cleared(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    backend.register_host_pool(filled_pool("page_first", 15))
    k = keys(1)[0]
    legacy = backend.inner.pages_dir / f"{backend.object_key(k)}.page"
    legacy.write_bytes(b"\0" * (integrity.HEADER_BYTES + GEOM.page_bytes))
    restarted = guarded(FileBackend(config(tmp_path)))
    assert restarted.inner.used_bytes == integrity.HEADER_BYTES + GEOM.page_bytes
    assert not (restarted.exists_prefix([k]) == 1)
    restarted.register_host_pool(filled_pool("page_first", 16))
    assert restarted.read(ReadBatch([k], [0])) == [False]
    assert restarted.stats().corrupt_pages == 0  # never opened
    restarted.clear()
    assert not legacy.exists() and restarted.inner.used_bytes == 0


def test_capacity_index_is_rebuilt_from_the_fan_out_oldest_first(tmp_path):
    page_file = FILE_HEADER_BYTES + GEOM.page_bytes
    writer = guarded(FileBackend(config(tmp_path)))
    writer.register_host_pool(filled_pool("page_first", 17))
    ks = keys(5)
    writer.write(WriteBatch(ks[:4], [0, 1, 2, 3]))
    assert len({k[:2] for k in ks[:4]}) > 1  # spread over several sub-directories
    legacy = writer.inner.pages_dir / "legacy_0123.page"  # earlier flat layout, oldest of all
    legacy.write_bytes(b"\0" * 100)
    for age, path in enumerate([legacy] + [writer.inner.page_path(k) for k in [ks[2], ks[0], ks[3],
                                                                         ks[1]]]):
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    restarted = guarded(FileBackend(config(tmp_path, capacity_gb=4 * page_file / 1e9)))
    assert restarted.inner.used_bytes == 4 * page_file + 100
    restarted.register_host_pool(filled_pool("page_first", 17))
    # needs room for one page: the legacy file, then ks[2]
    restarted.write(WriteBatch([ks[4]], [4]))
    assert not legacy.exists()
    assert [(restarted.exists_prefix([k]) == 1) for k in ks] == [True, True, False, True, True]
    assert restarted.inner.used_bytes == 4 * page_file and restarted.stats().evicted_pages == 2


def test_clear_removes_pages_of_every_subdirectory(tmp_path):
    backend = guarded(FileBackend(config(tmp_path)))
    backend.register_host_pool(filled_pool("page_first", 18))
    ks = keys(6)
    backend.write(WriteBatch(ks, list(range(6))))
    backend.clear()
    assert backend.exists_prefix(ks) == 0 and backend.inner.used_bytes == 0
    assert not list(backend.inner.pages_dir.glob("*/*.page"))
    assert backend.write(WriteBatch(ks[:1], [0])) == [True]  # sub-directories kept or remade


# ---- O_DIRECT ------------------------------------------------------------------------------

GEOM_4K = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=1, block_bytes=4096)


def config_4k(path: Path, **extra) -> StorageConfig:
    return StorageConfig(tp_rank=0, tp_size=1, namespace=NS.fingerprint(),
                         mem_layout="page_first_direct", page_bytes=GEOM_4K.page_bytes,
                         extra_config={"path": str(path), **extra})


class _FakeCudart:
    """cudaHostRegister stand-in: the pool is then page-aligned anonymous memory."""

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's name
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return 0


def aligned_pool(monkeypatch, seed: int) -> HostPagePool:
    monkeypatch.setattr(host_pool_module, "allocate",
                        lambda n, pin, device=None: allocate(n, pin=True, cudart=_FakeCudart()))
    pool = HostPagePool(GEOM_4K, layout="page_first_direct", pin_memory=True)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))
    assert pool.buffer.data_ptr() % 4096 == 0
    return pool


def direct_backend(cfg: StorageConfig) -> FileBackend:
    backend = guarded(FileBackend(dataclasses.replace(cfg, extra_config={**cfg.extra_config,
                                                                 "direct_io": "auto"})))
    if not backend.inner.direct_io:
        pytest.skip(f"{cfg.extra_config['path']} does not accept O_DIRECT")
    return backend


def iovec_counts(monkeypatch) -> list[int]:
    """Record how many buffers each os.preadv call reads into."""
    seen: list[int] = []
    real = os.preadv

    def spy(fd, buffers, offset, *args):
        seen.append(len(buffers))
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", spy)
    return seen


def native_direct_calls(monkeypatch) -> list[tuple[str, bool]]:
    """Record each batch of native_io (not warm_up's empty ones) and whether it asked
    for O_DIRECT."""
    seen: list[tuple[str, bool]] = []
    for name in ("read_pages", "write_pages"):
        real = getattr(native_io, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            if len(args[0]):
                seen.append((_name, kwargs.get("direct", False)))
            return _real(*args, **kwargs)

        monkeypatch.setattr(native_io, name, spy)
    return seen


def test_direct_io_moves_aligned_pages_straight_between_file_and_slot(tmp_path, monkeypatch,
                                                                       io_path):
    src, dst = aligned_pool(monkeypatch, 20), aligned_pool(monkeypatch, 21)
    writer = direct_backend(config_4k(tmp_path))
    writer.register_host_pool(src)
    batches = native_direct_calls(monkeypatch)
    ks = keys(4)
    assert writer.write(WriteBatch(ks, [0, 1, 2, 3])) == [True] * 4
    reader = direct_backend(config_4k(tmp_path))
    reader.register_host_pool(dst)
    calls = iovec_counts(monkeypatch)
    assert reader.read(ReadBatch(ks, [4, 5, 6, 7])) == [True] * 4
    if io_path == "native":  # aligned slots: whole batches, GIL-free, with O_DIRECT
        assert batches == [("write_pages", True), ("read_pages", True)] and calls == []
        assert reader.capabilities.spans and reader.capabilities.timed
    else:
        assert batches == [] and calls == [3] * 4  # header, the slot, one block past the end
    assert torch.equal(dst.buffer[4:8], src.buffer[0:4])
    assert reader.stats().get_hits == 4 and reader.stats().corrupt_pages == 0
    # Empty batches are empty answers, not errors, with O_DIRECT too.
    assert writer.write(WriteBatch([], [])) == [] and reader.read(ReadBatch([], [])) == []


def test_direct_io_span_files_round_trip_and_check_every_record(tmp_path, monkeypatch,
                                                                io_path):
    if io_path != "native":
        pytest.skip("span objects need the GIL-free batch path")
    src, dst = aligned_pool(monkeypatch, 27), aligned_pool(monkeypatch, 28)
    writer, reader = direct_backend(config_4k(tmp_path)), direct_backend(config_4k(tmp_path))
    writer.register_host_pool(src)
    reader.register_host_pool(dst)
    ks = keys(3)
    span_key = bytes.fromhex(ks[-1])
    spans = [SpanRef(span_key, i, 3) for i in range(3)]
    assert writer.write(WriteBatch(ks, [0, 1, 2], spans=spans)) == [True] * 3
    path = writer.inner.page_path(ks[-1])
    assert path.stat().st_size == 3 * (FILE_HEADER_BYTES + GEOM_4K.page_bytes)
    assert reader.read(ReadBatch(ks, [4, 5, 6], spans=spans)) == [True] * 3
    assert torch.equal(dst.buffer[4:7], src.buffer[0:3])
    # A flipped byte in the second record: that page is a miss, the file quarantined.
    data = bytearray(path.read_bytes())
    data[2 * FILE_HEADER_BYTES + GEOM_4K.page_bytes + 7] ^= 0x01
    path.write_bytes(bytes(data))
    assert reader.read(ReadBatch(ks, [4, 5, 6], spans=spans)) == [True, False, True]
    assert reader.stats().corrupt_pages == 1 and not path.exists()


def test_direct_io_bounces_unaligned_slots_and_odd_page_sizes(tmp_path, monkeypatch):
    # GEOM's pages (1536 B) are not a multiple of 4 KiB, torch.empty slots not 4 KiB
    # aligned: reads go through the aligned bounce buffer, writes stay buffered.
    src, dst = filled_pool("page_first", 22), filled_pool("page_first", 23)
    writer = direct_backend(config(tmp_path))
    writer.register_host_pool(src)
    ks = keys(4)
    assert writer.write(WriteBatch(ks, [0, 1, 2, 3])) == [True] * 4
    reader = direct_backend(config(tmp_path))
    reader.register_host_pool(dst)
    calls = iovec_counts(monkeypatch)
    assert reader.read(ReadBatch(ks, [4, 5, 6, 7])) == [True] * 4
    assert calls == [1] * 4
    assert torch.equal(dst.buffer[4:8], src.buffer[0:4])
    # A damaged page read through the bounce buffer is still a quarantined miss.
    path = reader.inner.page_path(ks[0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    assert reader.read(ReadBatch(ks[:1], [4])) == [False] and reader.stats().corrupt_pages == 1


def refuse_o_direct(monkeypatch) -> list[int]:
    """Make every O_DIRECT open fail as on a filesystem without it; returns the refusals."""
    refused: list[int] = []
    real = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(flags)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    return refused


def test_direct_io_auto_falls_back_to_buffered_where_o_direct_is_refused(tmp_path, monkeypatch):
    refused = refuse_o_direct(monkeypatch)
    backend = guarded(FileBackend(config(tmp_path, direct_io="auto")))
    assert refused and not backend.inner.direct_io  # the probe at start
    backend.register_host_pool(filled_pool("page_first", 24))
    ks = keys(3)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    assert backend.read(ReadBatch(ks, [4, 5, 6])) == [True] * 3
    assert torch.equal(backend.pool.buffer[4:7], backend.pool.buffer[0:3])


def test_direct_io_on_refused_by_the_filesystem_is_a_config_error(tmp_path, monkeypatch):
    refuse_o_direct(monkeypatch)
    with pytest.raises(StorageConfigError) as err:
        guarded(FileBackend(config(tmp_path, direct_io="on")))
    assert "hicache_storage_backend_extra_config.direct_io='on'" in str(err.value)
    assert "allowed values" in str(err.value)


def refuse_native_o_direct(monkeypatch) -> None:
    """The batch path's answers where the filesystem refuses every O_DIRECT open (its
    C ``open`` fails): writes ``OPEN_FAILED``, reads ``MISSING`` (simulated: this VM's
    filesystems all accept O_DIRECT)."""
    def write_pages(tmp_paths, paths, *args, **kwargs):
        return np.full(len(paths), native_io.OPEN_FAILED, np.int64)

    def read_pages(paths, *args, **kwargs):
        return (np.full(len(paths), native_io.MISSING, np.int64),
                np.zeros(len(paths), np.int64))

    monkeypatch.setattr(native_io, "write_pages", write_pages)
    monkeypatch.setattr(native_io, "read_pages", read_pages)


def test_pages_fall_back_to_buffered_when_o_direct_is_refused_later(tmp_path, monkeypatch,
                                                                    io_path):
    src, dst = aligned_pool(monkeypatch, 25), aligned_pool(monkeypatch, 26)
    backend = direct_backend(config_4k(tmp_path))  # the probe passed
    backend.register_host_pool(src)
    refused = refuse_o_direct(monkeypatch)  # then, say, pages/ is another mount
    if io_path == "native":
        refuse_native_o_direct(monkeypatch)
    ks = keys(3)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    backend.register_host_pool(dst)
    assert backend.read(ReadBatch(ks, [3, 4, 5])) == [True] * 3
    # each write and each read tried O_DIRECT first (natively, then again in Python)
    assert len(refused) == 6
    assert torch.equal(dst.buffer[3:6], src.buffer[0:3])
    assert backend.stats().corrupt_pages == 0


def test_timed_reads_start_no_page_after_the_deadline(tmp_path, io_path):
    import time

    src, dst = filled_pool("page_first", 1), filled_pool("page_first", 2)
    a, b = guarded(FileBackend(config(tmp_path))), guarded(FileBackend(config(tmp_path)))
    a.register_host_pool(src)
    b.register_host_pool(dst)
    ks = keys(3)
    assert a.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    assert b.capabilities.timed == (io_path == "native")
    if io_path != "native":
        return  # the per-page Python path has no deadline inside a batch
    before = b.stats()
    assert b.read(ReadBatch(ks, [5, 6, 7], deadline=time.monotonic() - 1)) == [False] * 3
    after = b.stats()
    # Not started is neither a hit nor a miss: nothing counted, nothing quarantined.
    assert (after.get_misses, after.corrupt_pages) == (before.get_misses, before.corrupt_pages)
    assert not list((tmp_path / "quarantine").iterdir())
    assert b.read(ReadBatch(ks, [5, 6, 7], deadline=time.monotonic() + 3600)) == [True] * 3
    assert torch.equal(src.canonical[0], dst.canonical[5])
