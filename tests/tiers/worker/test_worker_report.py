"""tiers/worker/core.py ``take_report``: a rank's gauges travel under its rank, and
only when they changed (a real worker, pool and file L3 under tmp_path)."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.file_backend import FileBackend
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
