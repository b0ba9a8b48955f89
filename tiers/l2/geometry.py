"""L2 pool geometry: how many page slots the host budget buys, and their size in bytes.

Contract:
- ``PoolGeometry`` is plain arithmetic (no torch): the scheduler computes it
  to number its slots, every worker computes the same one to allocate its
  ``HostPagePool`` (``tiers/l2/host_pool.py``), so slot numbers chosen by
  the scheduler are valid on every rank.
- A page holds every KV layer of the engine: with several KV-cache groups
  (vLLM's hybrid manager), each group's layers for the page's tokens, so
  ``num_layers`` counts the layers of all groups and ``page_bytes`` is the
  real size of a page of all of them (tiers/index/kv_groups.py).
- ``for_budget`` sizes the pool by ``hicache_size`` (GB, SGLang's unit) when
  it is > 0, else by ``hicache_ratio`` x the engine's own KV cache (its real
  bytes, ``l1_bytes``, when the groups share tensors), and
  refuses a budget smaller than one page (ValueError naming both settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GB = 1_000_000_000  # SGLang's hicache_size unit
# Byte layouts of the host pool (tiers/l2/host_pool.py LAYOUT_DIMS); the
# connector config's hicache_mem_layout accepts exactly these.
MemLayoutName = Literal["layer_first", "page_first", "page_first_direct"]


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of the L2 pool; identical on the scheduler and every worker."""

    # Number of page slots in the pool.
    num_slots: int
    # KV layers copied per page (attention layers of the engine, all groups).
    num_layers: int
    # Engine KV blocks per page (page_size // block_size).
    blocks_per_page: int
    # Bytes of one engine block in one layer.
    block_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.blocks_per_page * self.block_bytes

    @property
    def buffer_bytes(self) -> int:
        return self.num_slots * self.page_bytes

    @classmethod
    def for_budget(
        cls,
        *,
        num_layers: int,
        blocks_per_page: int,
        block_bytes: int,
        l1_num_blocks: int,
        hicache_size_gb: float,
        hicache_ratio: float,
        l1_bytes: int | None = None,
    ) -> PoolGeometry:
        """Size the pool by ``hicache_size_gb`` if > 0, else by ``hicache_ratio`` x L1
        (``l1_bytes``, default ``l1_num_blocks`` blocks of every layer)."""
        page_bytes = num_layers * blocks_per_page * block_bytes
        if hicache_size_gb > 0:
            budget = int(hicache_size_gb * GB)
            source = f"hicache_size={hicache_size_gb} GB"
        else:
            if l1_bytes is None:
                l1_bytes = l1_num_blocks * num_layers * block_bytes
            budget = int(hicache_ratio * l1_bytes)
            source = f"hicache_ratio={hicache_ratio} x L1 ({l1_num_blocks} blocks)"
        num_slots = budget // page_bytes
        if num_slots < 1:
            raise ValueError(
                f"L2 budget of {budget} bytes ({source}) is smaller than one page "
                f"of {page_bytes} bytes; raise hicache_size or hicache_ratio"
            )
        return cls(num_slots, num_layers, blocks_per_page, block_bytes)
