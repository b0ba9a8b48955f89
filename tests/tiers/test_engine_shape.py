"""tiers/engine_shape.py: one rank's backend, the scheduler's view over the ranks, and
what a bad or unreachable L3 does at start (real file backends under tmp_path)."""

from __future__ import annotations

import logging

import pytest

from hicache.tiers.config import HiCacheConfig, HiCacheConfigError
from hicache.tiers.engine_shape import EngineShape
from hicache.tiers.index.kv_groups import KVGroups
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.rank_shards import RankShards


def shape(tp_size: int = 1, is_mla: bool = False) -> EngineShape:
    return EngineShape(
        model="tiny", page_size=16, block_size=8, tp_size=tp_size, is_mla=is_mla,
        groups=KVGroups.single(2), geometry=PoolGeometry(4, 2, 2, 64),
        namespace=KeyNamespace("tiny", "float32", "cpu", 16, tp_size),
        mem_layout="page_first", io_backend="direct", notes=(), async_stores=False,
        l1_num_blocks=40)


def test_derived_sizes_and_the_admin_view():
    s = shape()
    assert (s.blocks_per_page, s.l1_pages) == (2, 20)
    assert s.info() == {"model": "tiny", "page_size": 16, "block_size": 8, "tp_size": 1,
                        "l2_pages": 4, "page_bytes": 256, "mem_layout": "page_first",
                        "io_backend": "direct"}


def test_each_rank_gets_its_own_shard_and_the_scheduler_sees_them_all(tmp_path):
    s = shape(tp_size=2)
    ranks = [s.storage(r, "file", {"path": str(tmp_path)}) for r in range(2)]
    assert all(isinstance(b.inner, FileBackend) for b in ranks)
    assert ranks[0].config.fingerprint != ranks[1].config.fingerprint
    view = s.lookup("file", {"path": str(tmp_path)})
    assert isinstance(view, RankShards) and len(view.shards) == 2
    for b in (*ranks, view):
        b.close()


def test_mla_ranks_share_one_shard(tmp_path):
    s = shape(tp_size=2, is_mla=True)
    a, b = (s.storage(r, "file", {"path": str(tmp_path)}) for r in range(2))
    assert a.config.fingerprint == b.config.fingerprint
    view = s.lookup("file", {"path": str(tmp_path)})
    assert isinstance(view.inner, FileBackend)
    for x in (a, b, view):
        x.close()


def test_no_backend_configured_is_no_l3():
    assert shape().scheduler_storage(HiCacheConfig()) is None


def test_a_bad_backend_key_stops_the_start_naming_it(tmp_path):
    config = HiCacheConfig.from_extra_config({
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": {"path": str(tmp_path), "no_such_key": 1}})
    with pytest.raises(HiCacheConfigError, match="no_such_key"):
        shape().scheduler_storage(config)


def test_an_unreachable_store_turns_l3_off(tmp_path, caplog):
    config = HiCacheConfig.from_extra_config({
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": {
            "module_path": "support.fault_injection", "class_name": "FaultyFileBackend",
            "path": str(tmp_path), "fault_unreachable": True}})
    with caplog.at_level(logging.ERROR):
        assert shape().scheduler_storage(config) is None
    assert "serving without L3" in caplog.text


def test_the_engine_scheduler_takes_the_configured_eviction_and_catch_up():
    from hicache.tiers.controller.policies import LeafFirstLRU, TailFirstLRU
    from hicache.tiers.controller.scheduler import HiCacheScheduler
    from hicache.tiers.index.page_keys import token_block_hashes

    def build(**extra):
        return HiCacheScheduler.for_engine(
            shape(), HiCacheConfig.from_extra_config(extra), storage=None,
            block_ids_of=lambda rid: [[]], hash_block_size=8, kv_events=False,
            prefix_hasher=lambda t, s, lora: token_block_hashes(t, 8, s, lora))

    default = build()
    assert isinstance(default.l2.eviction, LeafFirstLRU)
    assert default.catch_up.max_in_flight == 64
    tlru = build(hicache_eviction_policy="tlru", hicache_tlru_tail_tokens=100,
                 hicache_l3_catch_up_pages=0)
    assert isinstance(tlru.l2.eviction, TailFirstLRU)
    assert tlru.l2.eviction.tail_pages == 100 // 16 and not tlru.catch_up.enabled
    for s in (default, tlru):
        s.close()
