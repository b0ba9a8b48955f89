"""tiers/controller/admin.py ``flush`` of L3 on a store that cannot delete or clear (a
third party's: SGLang's interface has no delete): a 400 that says which flush it cannot
do, and no command for the workers. A real in-memory backend behind its guard."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hicache.tiers.controller.admin import BadRequest, SchedulerAdmin
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageConfig, WriteBatch
from hicache.tiers.l3.guard import guarded

GEOM = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", 8, 1)


class Config:
    hicache_storage_backend = "dynamic"
    hicache_write_policy = "write_through"
    hicache_storage_prefetch_policy = "timeout"
    hicache_mem_layout = "page_first"
    hicache_write_through_threshold = 2


class LookupsOnly(StorageBackend):
    """The three required verbs and nothing else: no delete, no clear."""

    def read(self, batch: ReadBatch) -> list[bool]:
        return [False] * len(batch.keys)

    def write(self, batch: WriteBatch) -> list[bool]:
        return [False] * len(batch.keys)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return 0


@pytest.mark.parametrize(("prefix", "says"), [(None, "cannot be flushed"),
                                             (list(range(16)), "cannot flush a prefix")])
def test_a_store_without_delete_or_clear_refuses_the_flush_by_name(prefix, says):
    sched = HiCacheScheduler(geometry=GEOM, namespace=NS, page_size=8, block_size=4,
                             block_ids_of=lambda rid: [[]],
                             storage=guarded(LookupsOnly(StorageConfig(0, 1, "ns", "page_first",
                                                                       GEOM.page_bytes))))
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0)
    with pytest.raises(BadRequest, match=says):
        admin.flush(["l3"], prefix, None)
    assert sched.build_connector_meta({}).storage_commands == []  # nothing for the workers
