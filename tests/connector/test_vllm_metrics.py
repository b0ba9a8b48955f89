"""HiCache's stats in vLLM's pipeline: ``HiCacheKVStats`` (record, aggregate over ranks
and steps, reduce for the log line, payload round trip) and ``HiCachePromMetrics``
(one family per engine row, per-engine children) on a private Prometheus registry."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hicache.connector.vllm_metrics import HiCacheKVStats, HiCachePromMetrics
from hicache.tiers.metrics import ENGINE_METRICS


def test_record_keeps_engine_rows_only_and_aggregate_merges():
    a = HiCacheKVStats()
    assert a.is_empty()
    a.record({"saved_bytes": 10, "load_errors": 0, "not_a_metric": 5},
             {"l2_store_seconds": [0.5], "l2_load_seconds": [], "nope": [1.0]})
    assert a.data == {"saved_bytes": 10, "l2_store_seconds": [0.5]}
    assert not a.is_empty()
    b = HiCacheKVStats()
    b.record({"saved_bytes": 5, "l3_errors": 1}, {"l2_store_seconds": [0.25, 1.0]})
    merged = a.aggregate(b)
    assert merged is a
    assert a.data == {"saved_bytes": 15, "l3_errors": 1, "l2_store_seconds": [0.5, 0.25, 1.0]}
    assert a.aggregate(HiCacheKVStats()).data == a.data  # an empty interval changes nothing
    a.reset()
    assert a.is_empty() and a.data == {}


def test_reduce_lists_every_counter_and_observed_latencies():
    s = HiCacheKVStats()
    s.record({"loaded_bytes": 4096}, {"l3_fetch_seconds": [0.5, 1.5]})
    out = s.reduce()
    counters = [k for k, m in ENGINE_METRICS.items() if m.kind == "counter"]
    assert {k: out[k] for k in counters} == {k: 4096 if k == "loaded_bytes" else 0
                                             for k in counters}
    assert (out["l3_fetch_seconds_count"], out["l3_fetch_seconds_mean"],
            out["l3_fetch_seconds_max"]) == (2, 1.0, 1.5)
    assert "l2_load_seconds_count" not in out  # nothing observed


def test_payload_round_trip_never_grows_the_payload():
    s = HiCacheKVStats()
    s.record({"saved_bytes": 1}, {"l2_load_seconds": [0.1]})
    payload = s.to_dict()
    rebuilt = HiCacheKVStats.from_payload(payload)
    rebuilt.aggregate(HiCacheKVStats.from_payload(payload))
    assert rebuilt.data == {"saved_bytes": 2, "l2_load_seconds": [0.1, 0.1]}
    assert payload == {"saved_bytes": 1, "l2_load_seconds": [0.1]}
    assert HiCacheKVStats.from_payload(None).is_empty()


def prom_metrics(registry: CollectorRegistry) -> HiCachePromMetrics:
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return HiCachePromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                              ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})


def test_prom_metrics_export_every_engine_row_per_engine():
    registry = CollectorRegistry()
    prom = prom_metrics(registry)
    stats = HiCacheKVStats()
    stats.record({"saved_bytes": 300, "l3_corrupt_pages": 2},
                 {"l2_store_seconds": [0.0002, 0.003], "l3_fetch_seconds": [2.0]})
    prom.observe(stats.to_dict(), engine_idx=1)
    prom.observe({"saved_bytes": 1}, engine_idx=7)  # an engine vLLM never named: ignored
    one, zero = {"model_name": "m", "engine": "1"}, {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:hicache_saved_bytes_total", one) == 300
    assert value("vllm:hicache_saved_bytes_total", zero) == 0
    assert value("vllm:hicache_l3_corrupt_pages_total", one) == 2
    assert value("vllm:hicache_l2_store_seconds_count", one) == 2
    assert value("vllm:hicache_l2_store_seconds_bucket", {**one, "le": "0.0005"}) == 1
    assert value("vllm:hicache_l2_store_seconds_bucket", {**one, "le": "0.005"}) == 2
    assert value("vllm:hicache_l3_fetch_seconds_bucket", {**one, "le": "1.0"}) == 0
    assert value("vllm:hicache_l3_fetch_seconds_bucket", {**one, "le": "2.5"}) == 1
    families = {f.name: f for f in registry.collect()}
    assert {m.engine_name for m in ENGINE_METRICS.values()} == set(families)
    for key, spec in ENGINE_METRICS.items():
        assert families[spec.engine_name].type == spec.kind, key
