"""The metric table: names valid and unique, engine rows exportable by vLLM, cumulative
latency buckets with Prometheus' "le" semantics, fallback names."""

from __future__ import annotations

import re

from hicache.tiers.metrics import (
    ENGINE_METRICS,
    EVERY_KEY,
    METRICS,
    PREFIX,
    LatencyBuckets,
    WorkerKey,
    fallback_name,
    section_metrics,
)

PROM_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def test_every_name_is_a_unique_valid_family_name():
    names = [m.name for m in METRICS]
    assert len(names) == len(set(names))
    for m in METRICS:
        assert PROM_NAME.match(m.name) and PROM_NAME.match(m.engine_name), m.name
        assert m.name.startswith(f"{PREFIX}_")
        # Prometheus adds the suffixes: a name carrying one would be exported twice over.
        assert not m.name.endswith(("_total", "_bucket", "_sum", "_count", "_created"))
        assert m.help and all(PROM_NAME.match(label) for label in m.labels)


def test_sources_are_unique_and_histograms_have_sorted_buckets():
    sources = [(m.section, m.key, m.values) for m in METRICS]
    assert len(sources) == len(set(sources))
    for m in METRICS:
        if m.kind == "histogram":
            assert m.buckets and list(m.buckets) == sorted(set(m.buckets)), m.name
            assert m.section == "latency"
        else:
            assert not m.buckets
        if m.key == EVERY_KEY:
            assert m.labels, m.name  # the key becomes a label


def test_engine_rows_are_unlabelled_worker_counters_and_latencies():
    assert ENGINE_METRICS and all(m.engine for m in ENGINE_METRICS.values())
    for key, m in ENGINE_METRICS.items():
        assert m.key == key and m.labels == ()
        assert (m.section, m.kind) in {("worker", "counter"), ("latency", "histogram")}
    # Every worker counter and latency reaches vLLM; nothing else can.
    assert {m.key for m in section_metrics("worker") + section_metrics("latency")} == set(
        ENGINE_METRICS)
    # Names vLLM users already scrape stay as they were.
    assert ENGINE_METRICS["saved_bytes"].engine_name == "vllm:hicache_saved_bytes"
    assert ENGINE_METRICS["l3_corrupt_pages"].engine_name == "vllm:hicache_l3_corrupt_pages"


def test_latency_buckets_are_cumulative_and_inclusive():
    h = LatencyBuckets((0.1, 1.0))
    h.observe([0.05, 0.1, 0.5, 7.0])
    h.observe([])
    d = h.as_dict()
    # A value equal to a bound counts in that bucket (le = "less or equal").
    assert d["buckets"] == [[0.1, 2], [1.0, 3]]
    assert d["count"] == 4 and abs(d["sum"] - 7.65) < 1e-9


def test_fallback_names_are_sanitised():
    assert fallback_name("tiers", "x-y") == "hicache_tier_x_y"
    assert fallback_name("7bad section", "k") == "hicache__7bad_section_k"
    assert fallback_name("scheduler", "") == "hicache_scheduler_unnamed"


def test_worker_keys_are_the_worker_rows_of_the_table():
    """What the worker writes and the admin view reads are the table's rows: every
    worker counter, and every latency the worker observes (the scheduler's per-request
    histograms aside)."""
    rows = {m.key for m in METRICS if m.section == "worker"} | {
        m.key for m in METRICS if m.section == "latency"
        and not m.key.startswith("request_cached_tokens_")}
    assert {k.value for k in WorkerKey} == rows

