"""The scheduler's L3 view over tensor-parallel ranks, with real file backends:
a page counts only where every rank's shard has it; MLA shares one shard."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.l3.rank_shards import RankShards

GEOM = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 2)
KEYS = [k.hex() for k in page_keys(NS.seed(), list(range(48)), 8)]  # 6 pages


def shard(path: Path, rank: int, is_mla: bool = False) -> FileBackend:
    backend = guarded(FileBackend(StorageConfig(rank, 2, NS.fingerprint(), "page_first", GEOM.page_bytes,
                                        is_mla=is_mla, extra_config={"path": str(path)})))
    pool = HostPagePool(GEOM, layout="page_first", pin_memory=False)
    flat = torch.arange(pool.buffer.numel(), dtype=torch.int64).to(torch.uint8)
    pool.buffer.copy_(flat.view(pool.buffer.shape))
    backend.register_host_pool(pool)
    return backend


def test_a_page_is_in_l3_only_where_every_rank_has_it(tmp_path):
    r0, r1 = shard(tmp_path, 0), shard(tmp_path, 1)
    assert all(r0.write(WriteBatch(KEYS[:5], [0, 1, 2, 3, 4])))
    assert all(r1.write(WriteBatch(KEYS[:3], [0, 1, 2])))
    view = RankShards([r0, r1])
    assert r0.exists_prefix(KEYS) == 5
    assert view.exists_prefix(KEYS) == 3  # rank 1 lacks pages 3 and 4
    assert view.exists_prefix(KEYS[3:]) == 0
    assert view.delete(KEYS[:1]) == 1
    assert r1.exists_prefix(KEYS) == 0 == view.exists_prefix(KEYS)
    view.clear()
    assert r0.exists_prefix(KEYS[1:]) == 0


def test_mla_ranks_share_one_shard(tmp_path):
    r0, r1 = shard(tmp_path, 0, is_mla=True), shard(tmp_path, 1, is_mla=True)
    assert r0.config.fingerprint == r1.config.fingerprint
    assert all(r0.write(WriteBatch(KEYS[:2], [0, 1])))
    assert r1.exists_prefix(KEYS) == 2  # written once, by rank 0
    assert r1.read(ReadBatch(KEYS[:2], [5, 6])) == [True, True]
    mha = dataclasses.replace(r0.config, is_mla=False)
    assert mha.fingerprint != r0.config.fingerprint
