"""What the cache knows of the engine it serves, read once from the engine's config.

Contract:
- ``EngineShape`` is plain data: model name, page and block sizes, TP size,
  MLA, the KV-cache groups, the L2 geometry, the key namespace, the data
  plane (host layout, io backend) after the compatibility rules, and whether
  stores may cross steps. connector/vllm_shape.py builds it from vLLM's
  config; everything below takes it, so the scheduler and every worker
  compute each value the same way, once.
- ``storage(rank, name, extra)`` builds one rank's L3 backend;
  ``lookup(name, extra)`` the scheduler's view over every rank's shard (one
  shared shard for MLA or TP 1).
- ``scheduler_storage(config)`` is the scheduler's own backend instance:
  None without L3. A bad backend configuration raises ``HiCacheConfigError``
  (the engine stops at start, naming the key); an unreachable store only
  turns L3 off (logged): the engine serves from L1 and L2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hicache.tiers.config import HiCacheConfig, HiCacheConfigError
from hicache.tiers.index.kv_groups import KVGroups
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageConfig, StorageConfigError
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.guard import GuardedBackend
from hicache.tiers.l3.rank_shards import RankShards

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineShape:
    """The engine as the cache sees it (see the module docstring)."""

    model: str
    page_size: int  # tokens per page
    block_size: int  # tokens per vLLM block of the attention groups
    tp_size: int
    is_mla: bool
    groups: KVGroups
    geometry: PoolGeometry
    namespace: KeyNamespace
    mem_layout: str  # after SGLang's compatibility rules (HiCacheConfig.resolved_data_plane)
    io_backend: str
    notes: tuple[str, ...]  # how the compatibility rules changed the configured data plane
    # L1 -> L2 stores may finish in later steps (off for sliding-window and Mamba
    # groups, whose blocks vLLM frees or rewrites while a request runs).
    async_stores: bool
    l1_num_blocks: int

    @property
    def blocks_per_page(self) -> int:
        return self.page_size // self.block_size

    @property
    def l1_pages(self) -> int:
        return self.l1_num_blocks // self.blocks_per_page

    def info(self) -> dict[str, Any]:
        """The engine section of the admin view."""
        return {"model": self.model, "page_size": self.page_size,
                "block_size": self.block_size, "tp_size": self.tp_size,
                "l2_pages": self.geometry.num_slots, "page_bytes": self.geometry.page_bytes,
                "mem_layout": self.mem_layout, "io_backend": self.io_backend}

    def storage(self, tp_rank: int, name: str, extra: dict[str, Any]) -> GuardedBackend:
        """This rank's L3 backend ``name`` with backend settings ``extra``."""
        return create_backend(name, StorageConfig(
            tp_rank=tp_rank, tp_size=self.tp_size, namespace=self.namespace.fingerprint(),
            mem_layout=self.mem_layout, page_bytes=self.geometry.page_bytes,
            is_mla=self.is_mla, model_name=self.model, extra_config=extra))

    def lookup(self, name: str, extra: dict[str, Any]) -> GuardedBackend | RankShards:
        """The scheduler's L3 view: every rank's shard (one shared shard for MLA)."""
        if self.is_mla or self.tp_size == 1:
            return self.storage(0, name, extra)
        return RankShards([self.storage(r, name, extra) for r in range(self.tp_size)])

    def scheduler_storage(self, config: HiCacheConfig) -> GuardedBackend | RankShards | None:
        name = config.hicache_storage_backend
        if name is None:
            return None
        try:
            backend = self.lookup(name, config.backend_extra_config())
        except StorageConfigError as exc:
            raise HiCacheConfigError(str(exc)) from exc
        except Exception:  # noqa: BLE001
            logger.exception("HiCache: L3 backend %r unavailable; serving without L3", name)
            return None
        logger.info("HiCache L3: %s backend, prefetch policy %s", name,
                    config.hicache_storage_prefetch_policy)
        return backend
