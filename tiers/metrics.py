"""Every HiCache metric in one table: its Prometheus name, kind, help, labels and source.

See DESIGN.md "Metrics".

Contract:
- ``METRICS`` is the only place a metric name is written. The two exporters
  read it: ``connector/vllm_metrics.py`` registers the rows marked
  ``engine`` in vLLM's ``/metrics`` (named ``vllm:`` + name, with vLLM's
  per-engine labels), ``integration/admin/metrics.py`` renders every row
  from the admin ``stats()`` dict for the admin ``/metrics``. A name is the
  family name: counters are exported with ``_total`` appended, histograms
  as ``_bucket`` / ``_sum`` / ``_count``.
- A row's ``section`` and ``key`` say where its value is in the stats
  dicts. ``SchedulerAdmin.stats()`` (tiers/controller/admin.py) returns::

      {"tiers":   {"l1": {<key>: number}, "l2": {...}, "l3": {...}},  one sample per tier
       "queues":  {<queue>: number},                 key "*": one sample per queue
       "policy":  {<setting>: str | bool | number},  key "*": one sample per setting
       "worker":  {<key>: number},                   cumulative worker counters
       "latency": {<key>: LatencyBuckets.as_dict()}, cumulative worker histograms
       "<any other section>": {<key>: number}}       exported as fallback_name()

  and vLLM's stats payload (``HiCacheKVStats.data``) holds, for the rows
  marked ``engine``, ``{<key>: counter increment | [histogram observations]}``.
- The worker counts and times (tiers/worker/stats.py) and sends the
  increments once per step in its ``WorkerReport``; the scheduler-side
  connector hands that one report to both exporters, and adds its own
  per-request observations (``request_cached_tokens_<tier>``) to both the
  same way. Engine rows are therefore only ``worker`` counters and
  ``latency`` histograms (every histogram row: seconds or tokens), with no
  labels of their own.
- Keys of a stats section that no row names still reach the admin
  ``/metrics`` as untyped samples named by ``fallback_name``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

MetricKind = Literal["counter", "gauge", "histogram"]
Section = Literal["tiers", "queues", "sessions", "policy", "worker", "latency"]

PREFIX = "hicache"
# vLLM's /metrics names its own families "vllm:<name>"; ours follow.
ENGINE_PREFIX = "vllm:"
EVERY_KEY = "*"


class WorkerKey(StrEnum):
    """Keys of the worker counters and latencies (each one a row of ``METRICS``): what
    the worker writes and the admin view reads, never retyped as strings."""

    LOADED_BLOCKS = "loaded_blocks"
    LOADED_BYTES = "loaded_bytes"
    SAVED_PAGES = "saved_pages"
    SAVED_BYTES = "saved_bytes"
    LOAD_ERRORS = "load_errors"
    SAVE_ERRORS = "save_errors"
    STORE_WAITS = "store_waits"
    L3_FETCHED_PAGES = "l3_fetched_pages"
    L3_FETCH_FAILED_PAGES = "l3_fetch_failed_pages"
    L3_FETCH_DEADLINE_MISSES = "l3_fetch_deadline_misses"
    L3_FETCH_LATE_PAGES = "l3_fetch_late_pages"
    L3_BACKUP_PAGES = "l3_backup_pages"
    L3_BACKUP_FAILED_PAGES = "l3_backup_failed_pages"
    L3_BYTES_READ = "l3_bytes_read"
    L3_BYTES_WRITTEN = "l3_bytes_written"
    L3_CORRUPT_PAGES = "l3_corrupt_pages"
    L3_ERRORS = "l3_errors"
    L3_REFUSED_CALLS = "l3_refused_calls"
    L3_PAGES_IN_PLACE = "l3_pages_in_place"
    L3_FLUSHED_PAGES = "l3_flushed_pages"
    L3_RETAINED_PAGES = "l3_retained_pages"
    L2_LOAD_SECONDS = "l2_load_seconds"
    L2_STORE_SECONDS = "l2_store_seconds"
    L3_FETCH_SECONDS = "l3_fetch_seconds"


class WorkerGauge(StrEnum):
    """Current values a rank reports when they change (``WorkerReport.gauges``); the
    admin view keeps each rank's latest and shows their sum."""

    L3_FETCH_QUEUE = "l3_fetch_queue"
    L3_BACKUP_QUEUE_PAGES = "l3_backup_queue_pages"
    # 1 while this rank's L3 circuit breaker is open (its store stopped answering).
    L3_BREAKER_OPEN = "l3_breaker_open"


# Copy time of one step's pages on one rank: tens of microseconds to seconds.
COPY_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                        0.25, 0.5, 1.0, 2.5)
# An L3 fetch waits for a remote or disk store: milliseconds to tens of seconds.
FETCH_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                         10.0, 30.0)

# Prompt tokens of one request from one tier: none to a long context.
TOKEN_BUCKETS = (0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family and where its value comes from (see the module docstring)."""

    # Family name, without the "_total" Prometheus adds to counters.
    name: str
    kind: MetricKind
    help: str
    # Top-level key of the stats dict that holds the value.
    section: Section
    # Key inside the section (inside each tier for "tiers"); EVERY_KEY = each key
    # of the section is one sample, the key being the last label.
    key: str
    # Labels of the admin samples (vLLM adds its own per-engine labels in front).
    labels: tuple[str, ...] = ()
    # "text" rows take string and bool values, exported as 1 with the text as
    # the "value" label; "number" rows take numbers (bools as 0 / 1).
    values: Literal["number", "text"] = "number"
    # The stats value times scale is the exported value (GB/s -> bytes/s).
    scale: float = 1.0
    buckets: tuple[float, ...] = ()
    # Also exported in vLLM's /metrics (worker counters and latencies).
    engine: bool = False

    @property
    def engine_name(self) -> str:
        """The name in vLLM's /metrics."""
        return ENGINE_PREFIX + self.name


def _tier(key: str, name: str, kind: MetricKind, help_text: str,
          scale: float = 1.0) -> MetricSpec:
    return MetricSpec(f"{PREFIX}_tier_{name}", kind, help_text, "tiers", key, ("tier",),
                      scale=scale)


def _worker(key: str, help_text: str) -> MetricSpec:
    return MetricSpec(f"{PREFIX}_{key}", "counter", help_text, "worker", key, engine=True)


def _latency(key: str, help_text: str, buckets: tuple[float, ...]) -> MetricSpec:
    return MetricSpec(f"{PREFIX}_{key}", "histogram", help_text, "latency", key,
                      buckets=buckets, engine=True)


METRICS: tuple[MetricSpec, ...] = (
    # Per tier (l1 = vLLM's own KV cache, l2 = host pool, l3 = storage backend).
    _tier("capacity_pages", "capacity_pages", "gauge", "Pages the tier can hold."),
    _tier("used_pages", "used_pages", "gauge", "Pages the tier holds now."),
    _tier("capacity_bytes", "capacity_bytes", "gauge", "Bytes the tier can hold."),
    _tier("used_bytes", "used_bytes", "gauge", "Bytes the tier holds now."),
    _tier("recent_load_gbps", "load_bytes_per_second", "gauge",
          "Recent load throughput out of the tier, bytes per second.", scale=1e9),
    _tier("recent_save_gbps", "save_bytes_per_second", "gauge",
          "Recent save throughput into the tier, bytes per second.", scale=1e9),
    _tier("hits", "hits", "counter", "Pages looked up and found in the tier."),
    _tier("misses", "misses", "counter", "Pages looked up and not found in the tier."),
    _tier("evictions", "evictions", "counter", "Pages evicted from the tier."),
    _tier("pages_loaded", "loaded_pages", "counter", "Pages loaded out of the tier."),
    _tier("bytes_loaded", "loaded_bytes", "counter", "Bytes loaded out of the tier."),
    _tier("pages_saved", "saved_pages", "counter", "Pages saved into the tier."),
    _tier("bytes_saved", "saved_bytes", "counter", "Bytes saved into the tier."),
    _tier("corrupt_pages", "corrupt_pages", "counter",
          "Pages read from the tier that failed verification."),
    _tier("indexed_pages", "indexed_pages", "gauge",
          "Pages the HiRadixTree records in the tier (L3: what this engine knows it holds)."),
    _tier("backlog_pages", "backlog_pages", "gauge",
          "Pages L2 holds that the tier lacks and that the catch-up will back up (L3; "
          "as of its last scan, those in flight included)."),
    _tier("catch_up_pages", "catch_up_pages", "counter",
          "Pages L2 held and the tier lacked that the catch-up queued for backup (L3: "
          "after a flush or attach of L3, a failed backup)."),
    _tier("unreachable_ranks", "unreachable_ranks", "gauge",
          "TP ranks whose circuit breaker for the tier is open: their store stopped "
          "answering, their calls fail at once and their hits are recomputed (L3)."),
    # Queues and configuration.
    MetricSpec(f"{PREFIX}_queue_depth", "gauge", "Items waiting in a HiCache queue.",
               "queues", EVERY_KEY, ("queue",)),
    MetricSpec(f"{PREFIX}_sessions", "gauge",
               "Sessions (kv_transfer_params.hicache.session_id) this engine remembers, "
               "by state (open, closed).", "sessions", EVERY_KEY, ("state",)),
    MetricSpec(f"{PREFIX}_policy_info", "gauge",
               "Configured HiCache policies (value label), always 1.",
               "policy", EVERY_KEY, ("key", "value"), values="text"),
    MetricSpec(f"{PREFIX}_policy_value", "gauge", "Numeric HiCache policy settings.",
               "policy", EVERY_KEY, ("key",)),
    # Worker counters, summed over TP ranks (also in vLLM's /metrics).
    _worker(WorkerKey.LOADED_BLOCKS, "vLLM blocks copied from the HiCache L2 host pool into vLLM's "
            "KV cache"),
    _worker(WorkerKey.LOADED_BYTES,
            "Bytes copied from the HiCache L2 host pool into vLLM's KV cache"),
    _worker(WorkerKey.SAVED_PAGES, "L2 pages copied from vLLM's KV cache into the HiCache L2 host "
            "pool"),
    _worker(WorkerKey.SAVED_BYTES,
            "Bytes copied from vLLM's KV cache into the HiCache L2 host pool"),
    _worker(WorkerKey.LOAD_ERRORS, "vLLM blocks HiCache could not load (recomputed)"),
    _worker(WorkerKey.SAVE_ERRORS, "L2 pages whose store failed"),
    _worker(WorkerKey.STORE_WAITS, "Times an engine step waited for L2 stores of earlier steps "
            "(backlog, a preempted request's blocks, a slot read from L3, an L3 deletion)"),
    _worker(WorkerKey.L3_FETCHED_PAGES, "Pages read from the HiCache L3 store"),
    _worker(WorkerKey.L3_FETCH_FAILED_PAGES,
            "L3 pages a fetch read and did not get (missing, corrupt, store errors)"),
    _worker(WorkerKey.L3_FETCH_LATE_PAGES,
            "L3 pages not read because their fetch's deadline passed or it was cancelled"),
    _worker(WorkerKey.L3_FETCH_DEADLINE_MISSES, "L3 fetches stopped by their deadline"),
    _worker(WorkerKey.L3_BACKUP_PAGES, "Pages written to the HiCache L3 store"),
    _worker(WorkerKey.L3_BACKUP_FAILED_PAGES, "Pages the HiCache L3 store did not accept"),
    _worker(WorkerKey.L3_BYTES_READ, "Payload bytes read from the HiCache L3 store"),
    _worker(WorkerKey.L3_BYTES_WRITTEN, "Payload bytes written to the HiCache L3 store"),
    _worker(WorkerKey.L3_CORRUPT_PAGES, "L3 pages rejected by the page key or checksum check"),
    _worker(WorkerKey.L3_ERRORS, "Errors raised by the HiCache L3 store"),
    _worker(WorkerKey.L3_REFUSED_CALLS,
            "HiCache L3 calls its open circuit breaker failed at once (the store was down)"),
    _worker(WorkerKey.L3_PAGES_IN_PLACE, "L3 pages read from store memory of this process (a "
            "Mooncake segment it holds), copied and checked in one pass"),
    _worker(WorkerKey.L3_FLUSHED_PAGES,
            "Pages deleted from the HiCache L3 store by an admin flush"),
    _worker(WorkerKey.L3_RETAINED_PAGES,
            "Pages the HiCache L3 store agreed to keep ahead of its eviction (retain_s, pins)"),
    # Worker latencies, one observation per rank (also in vLLM's /metrics).
    _latency(WorkerKey.L2_LOAD_SECONDS, "Copy time of one step's HiCache L2 -> vLLM KV cache loads "
             "on one rank (all layers), seconds", COPY_SECONDS_BUCKETS),
    _latency(WorkerKey.L2_STORE_SECONDS,
             "Copy time of one step's vLLM KV cache -> HiCache L2 stores "
             "on one rank (all layers), seconds", COPY_SECONDS_BUCKETS),
    _latency(WorkerKey.L3_FETCH_SECONDS,
             "Time from an L3 fetch's start to its pages being in vLLM's "
             "KV cache on one rank, seconds", FETCH_SECONDS_BUCKETS),
    # Per finished request, from the scheduler (also in vLLM's /metrics).
    *(_latency(f"request_cached_tokens_{tier}", f"Prompt tokens of a finished request served "
               f"by {where} at its first admission", TOKEN_BUCKETS)
      for tier, where in (("l1", "vLLM's own prefix cache (L1)"),
                          ("l2", "the HiCache L2 host pool"), ("l3", "the HiCache L3 store"))),
)

ENGINE_METRICS: dict[str, MetricSpec] = {m.key: m for m in METRICS if m.engine}


def section_metrics(section: Section) -> tuple[MetricSpec, ...]:
    """The rows whose values are in ``section`` of the admin stats dict."""
    return tuple(m for m in METRICS if m.section == section)


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def sanitize_name(name: object) -> str:
    """A metric-name fragment: ``[a-zA-Z0-9_]`` only, never empty, never starting with a digit."""
    out = _NAME_BAD.sub("_", str(name)).strip("_") or "unnamed"
    return "_" + out if out[0].isdigit() else out


def fallback_name(section: str, key: object) -> str:
    """The untyped family of a stats key no row names: ``hicache_tier_<key>`` inside a
    tier, ``hicache_<section>_<key>`` elsewhere."""
    if section == "tiers":
        return f"{PREFIX}_tier_{sanitize_name(key)}"
    return f"{PREFIX}_{sanitize_name(section)}_{sanitize_name(key)}"


@dataclass
class LatencyBuckets:
    """Cumulative histogram of one ``latency`` row, as the admin stats keep it."""

    bounds: tuple[float, ...]
    # Observations per bucket (not cumulative); the last one is above every bound.
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, values: list[float]) -> None:
        for value in values:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.total += value

    def as_dict(self) -> dict[str, Any]:
        """``{"count", "sum", "buckets": [[upper bound, observations <= bound], ...]}``."""
        cumulative, running = [], 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            cumulative.append([bound, running])
        return {"count": sum(self.counts), "sum": self.total, "buckets": cumulative}


def add_engine_report(data: dict[str, Any], counters: Mapping[str, float],
                      observations: Mapping[str, list[float]]) -> None:
    """Add one merged worker report to an engine stats payload ``data`` (keys no engine
    row names are not exported): counter increments summed, observations appended."""
    for key, value in counters.items():
        spec = ENGINE_METRICS.get(key)
        if spec is not None and spec.kind == "counter" and value:
            data[key] = data.get(key, 0) + value
    for key, values in observations.items():
        spec = ENGINE_METRICS.get(key)
        if spec is not None and spec.kind == "histogram" and values:
            data.setdefault(key, []).extend(values)


def merge_engine_payloads(data: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Add payload ``other`` into ``data``."""
    for key, value in other.items():
        if isinstance(value, list):
            data.setdefault(key, []).extend(value)
        else:
            data[key] = data.get(key, 0) + value


def summarize_engine_payload(data: Mapping[str, Any]) -> dict[str, int | float]:
    """Every engine counter, and count / mean / max of each histogram observed."""
    out: dict[str, int | float] = {}
    for key, spec in ENGINE_METRICS.items():
        value = data.get(key)
        if spec.kind == "counter":
            out[key] = value or 0
        elif value:
            out[f"{key}_count"] = len(value)
            out[f"{key}_mean"] = round(sum(value) / len(value), 6)
            out[f"{key}_max"] = round(max(value), 6)
    return out
