"""File L3 backend: round trips, crash-safe writes, corruption as counted misses, sharing."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import StorageConfig, StorageConfigError
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.file_backend import FileBackend

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
def test_round_trip_through_host_slots(tmp_path, layout):
    src, dst = filled_pool(layout, 1), filled_pool(layout, 2)
    a, b = FileBackend(config(tmp_path, layout=layout)), FileBackend(config(tmp_path, layout=layout))
    a.register_host_pool(src)
    b.register_host_pool(dst)
    ks = keys(4)
    assert a.batch_set_v1(ks, [0, 1, 2, 3]) == [True] * 4
    assert b.batch_exists(ks) == 4
    assert b.batch_get_v1(ks, [7, 6, 5, 4]) == [True] * 4
    for s, d in zip([0, 1, 2, 3], [7, 6, 5, 4], strict=True):
        assert torch.equal(src.canonical[s], dst.canonical[d])
    assert b.stats().get_hits == 4 and b.stats().bytes_read == 4 * GEOM.page_bytes


def test_batch_exists_counts_consecutive_hits_and_set_skips_existing(tmp_path):
    backend = FileBackend(config(tmp_path))
    backend.register_host_pool(filled_pool("page_first", 3))
    ks = keys(5)
    backend.batch_set_v1([ks[0], ks[1], ks[3]], [0, 1, 3])
    assert backend.batch_exists(ks) == 2
    assert backend.batch_set_v1([ks[0]], [5]) == [True]
    assert backend.stats().set_skipped_existing == 1


def test_other_rank_or_layout_misses(tmp_path):
    a = FileBackend(config(tmp_path, rank=0))
    a.register_host_pool(filled_pool("page_first", 4))
    ks = keys(2)
    a.batch_set_v1(ks, [0, 1])
    assert FileBackend(config(tmp_path, rank=1)).batch_exists(ks) == 0
    assert FileBackend(config(tmp_path, layout="page_first_direct")).batch_exists(ks) == 0
    # layer_first and page_first_direct slots hold the same byte order: shared.
    assert FileBackend(config(tmp_path, layout="page_first")).batch_exists(ks) == 2


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header_key", "truncate", "append",
                                    "wrong_key_file"])
def test_corruption_is_a_counted_quarantined_miss(tmp_path, damage):
    writer = FileBackend(config(tmp_path))
    writer.register_host_pool(filled_pool("page_first", 5))
    ks = keys(2)
    writer.batch_set_v1(ks, [0, 1])
    victim = writer.pages_dir / f"{writer.object_key(ks[0])}.page"
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
        other = writer.pages_dir / f"{writer.object_key(ks[1])}.page"
        data = bytearray(other.read_bytes())
    victim.write_bytes(bytes(data))
    reader = FileBackend(config(tmp_path))
    dst = filled_pool("page_first", 6)
    before = dst.buffer[3].clone()
    reader.register_host_pool(dst)
    assert reader.batch_get_v1([ks[0]], [3]) == [False]
    assert reader.stats().corrupt_pages == 1
    assert not victim.exists() and len(list(reader.quarantine_dir.iterdir())) == 1
    assert reader.batch_exists(ks) == 0
    assert reader.batch_get_v1([ks[1]], [2]) == [True]
    del before  # the slot's bytes after a failed get are unspecified; the caller drops it


def test_deleted_between_exists_and_get_is_a_plain_miss(tmp_path):
    backend = FileBackend(config(tmp_path))
    backend.register_host_pool(filled_pool("page_first", 7))
    ks = keys(1)
    backend.batch_set_v1(ks, [0])
    assert backend.exists(ks[0])
    (backend.pages_dir / f"{backend.object_key(ks[0])}.page").unlink()
    assert backend.batch_get_v1(ks, [1]) == [False]
    assert backend.stats().corrupt_pages == 0 and backend.stats().get_misses == 1


def test_capacity_evicts_least_recently_used(tmp_path):
    page_file = 128 + GEOM.page_bytes
    backend = FileBackend(config(tmp_path, capacity_gb=3 * page_file / 1e9))
    backend.register_host_pool(filled_pool("page_first", 8))
    ks = keys(4)
    backend.batch_set_v1(ks[:3], [0, 1, 2])
    assert backend.get(ks[0], torch.empty(GEOM.page_bytes, dtype=torch.uint8))  # 0 is now recent
    backend.batch_set_v1([ks[3]], [3])
    assert [backend.exists(k) for k in ks] == [True, False, True, True]
    assert backend.used_bytes <= 3 * page_file and backend.stats().evicted_pages == 1
    # The index is rebuilt from the directory at start.
    assert FileBackend(config(tmp_path, capacity_gb=1)).used_bytes == 3 * page_file


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path):
    FileBackend(config(tmp_path))
    stale = tmp_path / "tmp" / "x.page.999999999.1.tmp"
    live = tmp_path / "tmp" / f"y.page.{os.getpid()}.1.tmp"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    FileBackend(config(tmp_path))
    assert not stale.exists() and live.exists()


def _write_pages(path: str, n: int) -> None:
    backend = FileBackend(config(Path(path)))
    backend.register_host_pool(filled_pool("page_first", 9))
    assert backend.batch_set_v1(keys(n), list(range(n))) == [True] * n


def test_two_processes_share_one_directory(tmp_path):
    proc = mp.get_context("spawn").Process(target=_write_pages, args=(str(tmp_path), 4))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    reader = FileBackend(config(tmp_path))
    reader.register_host_pool(filled_pool("page_first", 10))
    assert reader.batch_exists(keys(4)) == 4
    assert reader.batch_get_v1(keys(4), [4, 5, 6, 7]) == [True] * 4
    assert torch.equal(reader.pool.buffer[4:8], filled_pool("page_first", 9).buffer[0:4])


def test_factory_builds_the_file_backend(tmp_path):
    assert isinstance(create_backend("file", config(tmp_path)), FileBackend)


def test_bad_config_names_the_key(tmp_path):
    with pytest.raises(StorageConfigError, match="capacity_gb"):
        FileBackend(config(tmp_path, capacity_gb=-1))
    with pytest.raises(StorageConfigError, match="allowed keys"):
        FileBackend(config(tmp_path, bogus=1))
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
        ({"path": 7}, "hicache_storage_backend_extra_config.path must be a string or null"),
        ({"bogus": 1, "other": 2}, "unknown hicache_storage_backend_extra_config key(s) for the "
                                   "file backend: ['bogus', 'other']; allowed keys: "
                                   "['capacity_gb', 'fsync', 'path']"),
    ],
)
def test_bad_extra_config_message(tmp_path, extra, expect):
    cfg = dataclasses.replace(config(tmp_path), extra_config={"path": str(tmp_path), **extra})
    with pytest.raises(StorageConfigError) as err:
        FileBackend(cfg)
    assert expect in str(err.value)


def test_dynamic_loader_keys_are_checked_and_the_rest_passes_through(tmp_path):
    with pytest.raises(StorageConfigError) as err:
        create_backend("dynamic", config(tmp_path, module_path="hicache.tiers.l3.file_backend"))
    assert "hicache_storage_backend_extra_config.class_name is required" in str(err.value)
    with pytest.raises(StorageConfigError, match="module_path must be a non-empty string"):
        create_backend("dynamic", config(tmp_path, module_path="", class_name="FileBackend"))
    with pytest.raises(StorageConfigError, match="cannot be imported"):
        create_backend("dynamic", config(tmp_path, module_path="no.such.module",
                                         class_name="FileBackend"))
    backend = create_backend("dynamic", config(
        tmp_path, module_path="hicache.tiers.l3.file_backend", class_name="FileBackend",
        backend_name="mine", interface_v1=1, fsync=True))
    assert isinstance(backend, FileBackend) and backend.fsync and backend.root == tmp_path
    assert backend.config.extra_config == {"path": str(tmp_path), "fsync": True}


def test_dynamic_backend_loads_a_third_party_class(tmp_path):
    cfg = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "backend_name": "mine", "module_path": "hicache.tiers.l3.file_backend",
        "class_name": "FileBackend", "path": str(tmp_path)})
    backend = create_backend("dynamic", cfg)
    assert isinstance(backend, FileBackend) and backend.root == tmp_path
    cfg2 = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "module_path": "hicache.tiers.l3.base", "class_name": "StorageConfig"})
    with pytest.raises(StorageConfigError, match="not a StorageBackend"):
        create_backend("dynamic", cfg2)


def test_delete_removes_one_page(tmp_path):
    backend = FileBackend(config(tmp_path))
    backend.register_host_pool(filled_pool("page_first", 11))
    ks = keys(3)
    backend.batch_set_v1(ks, [0, 1, 2])
    assert backend.batch_delete([ks[1], ks[1]]) == 1
    assert [backend.exists(k) for k in ks] == [True, False, True]
