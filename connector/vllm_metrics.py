"""HiCache counters in vLLM's own stats pipeline and Prometheus ``/metrics``.

Contract:
- Each worker's ``get_kv_connector_stats`` returns ``HiCacheKVStats`` with the
  increments of its counters (``HiCacheWorker.counters``) since the last
  call; vLLM sums them over ranks (``aggregate``) and hands them to its
  frontend loggers.
- ``HiCachePromMetrics`` (from ``build_prom_metrics``) turns them into
  counters in vLLM's ``/metrics``: ``vllm:hicache_<name>_total`` per engine,
  with vLLM's own labels (model name, engine index).
- Tier attribution of cached prompt tokens goes through vLLM's
  ``get_external_cache_hit_sources`` (``vllm:prompt_tokens_cached_by_source``):
  L2 hits are ``host``, L3 hits ``disk`` (file, nixl) or ``p2p`` (mooncake's
  distributed memory) or ``external_unspecified`` (dynamic backends).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

# Worker counters exported to vLLM (HiCacheWorker.counters) and their help text.
EXPORTED = {
    "loaded_bytes": "Bytes copied from the HiCache L2 host pool into vLLM's KV cache",
    "saved_bytes": "Bytes copied from vLLM's KV cache into the HiCache L2 host pool",
    "load_errors": "vLLM blocks HiCache could not load (recomputed)",
    "save_errors": "L2 pages whose store failed",
    "l3_fetched_pages": "Pages read from the HiCache L3 store",
    "l3_fetch_failed_pages": "L3 pages not fetched (missing, corrupt, late, failed)",
    "l3_backup_pages": "Pages written to the HiCache L3 store",
    "l3_bytes_read": "Payload bytes read from the HiCache L3 store",
    "l3_bytes_written": "Payload bytes written to the HiCache L3 store",
    "l3_corrupt_pages": "L3 pages rejected by the page key or checksum check",
}

L3_SOURCES = {"file": CacheHitSource.DISK, "nixl": CacheHitSource.DISK,
              "mooncake": CacheHitSource.P2P}


def l3_source(backend: str | None) -> CacheHitSource:
    return L3_SOURCES.get(backend or "", CacheHitSource.EXTERNAL_UNSPECIFIED)


@dataclass
class HiCacheKVStats(KVConnectorStats):
    """Counter increments of one interval, summed over ranks."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in EXPORTED}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HiCachePromMetrics(KVConnectorPromMetrics):
    """One vLLM counter per exported HiCache counter, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in EXPORTED.items():
            counter = self._counter_cls(name=f"vllm:hicache_{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
