"""HiCache's worker counters and latencies in vLLM's stats pipeline and ``/metrics``.

Contract:
- One path: each worker sends its counter increments and latency
  observations once per step in its ``WorkerReport`` (tiers/worker/report.py);
  vLLM merges the ranks' reports; the scheduler-side connector feeds the
  merged report to the admin view and to ``HiCacheKVStats.record``, and
  returns the recorded stats from its ``get_kv_connector_stats`` (vLLM asks
  the scheduler-side connector every step, after ``update_connector_output``).
  Worker-side connectors return no stats of their own, so every number
  reaches vLLM exactly once, the same numbers the admin endpoint shows.
- ``HiCacheKVStats.data`` is ``{key: counter increment | [observations]}``
  for the rows of ``tiers/metrics.py`` marked ``engine``; ``aggregate``
  adds increments and concatenates observations, ``reduce`` gives vLLM's
  log line (every counter, and count / mean / max seconds of each latency
  observed), ``is_empty`` is true when nothing moved.
- ``HiCachePromMetrics`` (from ``build_prom_metrics``) registers one vLLM
  counter or histogram per engine row, named ``vllm:<name>``, with vLLM's
  per-engine labels (model name, engine index), and ``observe`` adds a
  payload to the engine's children.
- Tier attribution of cached prompt tokens goes through vLLM's
  ``get_external_cache_hit_sources`` (``vllm:prompt_tokens_cached_by_source``):
  L2 hits are ``host``, L3 hits ``disk`` (file, nixl) or ``p2p`` (mooncake's
  distributed memory) or ``external_unspecified`` (dynamic backends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache.tiers.metrics import (
    ENGINE_METRICS,
    add_engine_report,
    merge_engine_payloads,
    summarize_engine_payload,
)

L3_SOURCES = {"file": CacheHitSource.DISK, "nixl": CacheHitSource.DISK,
              "mooncake": CacheHitSource.P2P}


def l3_source(backend: str | None) -> CacheHitSource:
    return L3_SOURCES.get(backend or "", CacheHitSource.EXTERNAL_UNSPECIFIED)


@dataclass
class HiCacheKVStats(KVConnectorStats):
    """Counter increments and latency observations of one interval, over every rank."""

    def reset(self) -> None:
        self.data = {}

    def record(self, counters: Mapping[str, float],
               observations: Mapping[str, list[float]]) -> None:
        """Add one merged worker report (tiers/metrics.py ``add_engine_report``)."""
        add_engine_report(self.data, counters, observations)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge_engine_payloads(self.data, other.data or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        return summarize_engine_payload(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    @classmethod
    def from_payload(cls, data: Mapping[str, Any] | None) -> HiCacheKVStats:
        """Stats from a payload vLLM moved between processes (lists copied, so
        ``aggregate`` never grows a payload another logger still reads)."""
        return cls(data={k: list(v) if isinstance(v, list) else v
                         for k, v in (data or {}).items()})


class HiCachePromMetrics(KVConnectorPromMetrics):
    """One vLLM counter or histogram per engine row of tiers/metrics.py, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        # vLLM's metric classes (prometheus_client's or Ray's), typed loosely there
        histogram_cls: Any = self._histogram_cls
        for key, spec in ENGINE_METRICS.items():
            metric: Any
            if spec.kind == "counter":
                metric = self._counter_cls(name=spec.engine_name, documentation=spec.help,
                                           labelnames=labelnames)
            else:  # engine rows are counters and histograms (tiers/metrics.py)
                metric = histogram_cls(name=spec.engine_name, documentation=spec.help,
                                       labelnames=labelnames, buckets=list(spec.buckets))
            self._children[key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            child = self._children.get(key, {}).get(engine_idx)
            if child is None:
                continue
            if isinstance(value, list):
                for seconds in value:
                    child.observe(seconds)
            elif value:
                child.inc(value)
