"""tiers/worker/report.py through the worker: a rank's gauges travel under its rank, and
only when they changed; its stored L3 keys with its count of L3 changes applied
(a real worker, pool and file L3 under tmp_path)."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.tiers.index.commands import ClearStore, RetainPages
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, StepPlan
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.metrics import WorkerGauge as G
from hicache.tiers.worker.core import HiCacheWorker

GEOM = PoolGeometry(num_slots=4, num_layers=1, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 1)
LAYER = "model.layers.0.self_attn.attn"


def test_gauges_are_reported_under_the_rank_once_until_they_change(tmp_path: Path):
    def build(name: str, extra: dict) -> FileBackend:
        return guarded(FileBackend(StorageConfig(1, 2, NS.fingerprint(), "page_first",
                                                 GEOM.page_bytes, extra_config=extra)))

    w = HiCacheWorker(GEOM, 8, layout="page_first", rank=1, storage_builder=build,
                      storage_spec=("file", {"path": str(tmp_path)}),
                      group_layer_names=[[LAYER]])
    w.register_kv_caches({LAYER: torch.zeros(8, 16)})
    try:
        report = w.take_report()
        assert report is not None
        assert report.gauges == {1: {G.L3_FETCH_QUEUE: 0, G.L3_BACKUP_QUEUE_PAGES: 0,
                                     G.L3_BREAKER_OPEN: 0.0}}
        assert w.take_report() is None  # nothing changed, nothing to say
    finally:
        w.shutdown()


def test_backups_travel_with_the_count_of_l3_changes_applied_before_them(tmp_path: Path):
    """A rank's stored keys say how many L3-changing commands it had applied (the
    scheduler drops those from before its latest change); ``begin_step`` applies a
    plan's commands, a retention changes nothing."""
    def build(name: str, extra: dict) -> FileBackend:
        return guarded(FileBackend(StorageConfig(0, 1, NS.fingerprint(), "page_first",
                                                 GEOM.page_bytes, extra_config=extra)))

    key_a, key_b = page_keys(NS.seed(), list(range(17)), 8)
    w = HiCacheWorker(GEOM, 8, layout="page_first", storage_builder=build,
                      storage_spec=("file", {"path": str(tmp_path)}),
                      group_layer_names=[[LAYER]])
    w.register_kv_caches({LAYER: torch.randn(8, 16)})

    def stored_after(seq: int, slot: int, key: bytes) -> dict:
        """Store a page into ``slot`` (blocks from 2: block 0 is vLLM's null block)."""
        w.finish_step(StepPlan(stores=[PagePlan(slot, key, 0, (2 * slot + 2, 2 * slot + 3))],
                               seq=seq))
        assert w.storage_io is not None and w.storage_io.wait_backups(60)
        report = w.take_report()
        assert report is not None
        return {"stored": report.l3_stored, "changes": report.l3_changes}

    try:
        assert stored_after(1, 0, key_a) == {"stored": {0: [key_a]}, "changes": {0: 0}}
        w.begin_step(StepPlan(seq=2, storage_commands=[RetainPages((key_a,), 1.0)]))
        w.begin_step(StepPlan(seq=3, storage_commands=[ClearStore()]))
        assert stored_after(4, 1, key_b) == {"stored": {0: [key_b]}, "changes": {0: 1}}
    finally:
        w.shutdown()


def test_a_cpu_worker_runs_its_backups_between_forward_passes(tmp_path: Path):
    """vLLM's CPU forward pass runs between ``begin_step`` (bind_connector_metadata) and
    ``finish_step`` (wait_for_save): a backup queued in it waits for its end."""
    def build(name: str, extra: dict) -> FileBackend:
        return guarded(FileBackend(StorageConfig(0, 1, NS.fingerprint(), "page_first",
                                                 GEOM.page_bytes, extra_config=extra)))

    (key_a,) = page_keys(NS.seed(), list(range(9)), 8)
    w = HiCacheWorker(GEOM, 8, layout="page_first", storage_builder=build,
                      storage_spec=("file", {"path": str(tmp_path)}),
                      group_layer_names=[[LAYER]])
    w.register_kv_caches({LAYER: torch.randn(8, 16)})  # CPU tensors: a CPU engine
    io = w.storage_io
    assert io is not None and io.gate.enabled
    try:
        w.finish_step(StepPlan(stores=[PagePlan(0, key_a, 0, (2, 3))], seq=1))
        assert io.wait_backups(60)  # stored, then backed up once the step ended
        w.begin_step(StepPlan(seq=2))  # the next forward pass starts
        assert w.pool is not None
        io.submit_backup([(key_a, 0, b"\x01" * len(key_a))])  # queued during the pass
        assert not io.wait_backups(0.2) and io.stats.backup_pages == 1
        w.finish_step(StepPlan(seq=2))
        assert io.wait_backups(60) and io.stats.backup_pages == 2
    finally:
        w.shutdown()
