"""tiers/controller/admin.py: the gauges ranks report (queue depths, an open L3 breaker)
are kept per rank and shown summed, in /stats and in the admin /metrics; /lookup's
bandwidths come from the copies' own time."""

from __future__ import annotations

import pytest

from hicache.integration.admin.metrics import render_metrics
from hicache.tiers.controller.admin import SchedulerAdmin
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.metrics import WorkerGauge as G
from hicache.tiers.metrics import WorkerKey as K

GEOM = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", 8, 1)


class Config:
    hicache_storage_backend = "file"
    hicache_write_policy = "write_through"
    hicache_storage_prefetch_policy = "timeout"
    hicache_mem_layout = "page_first"
    hicache_write_through_threshold = 2


def admin() -> SchedulerAdmin:
    sched = HiCacheScheduler(geometry=GEOM, namespace=NS, page_size=8, block_size=4,
                             block_ids_of=lambda rid: [[]], tp_size=2)
    return SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0)


def test_a_rank_that_reports_no_change_keeps_its_last_value():
    a = admin()
    a.record_worker_report(WorkerReport(gauges={0: {G.L3_FETCH_QUEUE: 3},
                                                1: {G.L3_FETCH_QUEUE: 2}}))
    assert a.stats()["queues"][G.L3_FETCH_QUEUE] == 5
    # Rank 0's queue drained; rank 1's did not change, so it did not report.
    a.record_worker_report(WorkerReport(gauges={0: {G.L3_FETCH_QUEUE: 0}}))
    assert a.stats()["queues"][G.L3_FETCH_QUEUE] == 2


def test_merged_reports_keep_each_ranks_gauges_apart():
    r0 = WorkerReport(gauges={0: {G.L3_BREAKER_OPEN: 1.0, G.L3_BACKUP_QUEUE_PAGES: 4}})
    r1 = WorkerReport(gauges={1: {G.L3_BREAKER_OPEN: 1.0}})
    merged = r0.merge(r1)
    assert merged.gauges == {0: {G.L3_BREAKER_OPEN: 1.0, G.L3_BACKUP_QUEUE_PAGES: 4},
                             1: {G.L3_BREAKER_OPEN: 1.0}}
    assert r0.gauges == {0: {G.L3_BREAKER_OPEN: 1.0, G.L3_BACKUP_QUEUE_PAGES: 4}}


def test_open_breakers_are_counted_per_rank_in_stats_and_metrics():
    a = admin()
    assert a.stats()["tiers"]["l3"]["unreachable_ranks"] == 0
    a.record_worker_report(WorkerReport(gauges={0: {G.L3_BREAKER_OPEN: 1.0},
                                                1: {G.L3_BREAKER_OPEN: 1.0}}))
    stats = a.stats()
    assert stats["tiers"]["l3"]["unreachable_ranks"] == 2
    assert 'hicache_tier_unreachable_ranks{tier="l3"} 2.0' in render_metrics(stats)
    a.record_worker_report(WorkerReport(gauges={1: {G.L3_BREAKER_OPEN: 0.0}}))
    assert a.stats()["tiers"]["l3"]["unreachable_ranks"] == 1


def test_lookup_costs_each_tier_by_its_copies_own_time_not_the_wall_clock():
    """A CPU server answered ``"load_gbps": {"l2": 0.0038, "l3": 2.48}``: L2's bytes
    over a 10 s window of mostly idle time. Two ranks load 64 KiB each in 20 and 30 us:
    2.62 GB/s, however long the server then idles; L3 likewise from its fetches."""
    a = admin()
    assert a.lookup([1, 2, 3], None)["load_gbps"] == {"l2": None, "l3": None}
    a.record_worker_report(WorkerReport(
        counters={K.LOADED_BYTES: 2 * 65536, K.L3_BYTES_READ: 10**6},
        observations={K.L2_LOAD_SECONDS: [2e-5, 3e-5], K.L3_FETCH_SECONDS: [1e-3]}))
    got = a.lookup(list(range(40)), None)
    assert got["load_gbps"]["l2"] == pytest.approx(2 * 65536 / 5e-5 / 1e9)
    assert got["load_gbps"]["l3"] == pytest.approx(1.0)
