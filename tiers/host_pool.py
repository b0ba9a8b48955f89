"""L2 host page pool: the bytes of cached pages, owned by one worker (TP rank).

Contract:
- ``PoolGeometry`` is computed identically in the scheduler and in every
  worker from the engine's KV-cache shape and the configured budget, so slot
  numbers chosen by the scheduler are valid on every rank.
- ``HostPagePool`` allocates exactly ``geometry.buffer_bytes`` once (pinned
  when CUDA is available) and never grows: host memory stays within budget.
- Layout ``page_first``: ``buffer[slot, layer, block_in_page, byte]``. All
  layers of one page are contiguous, so a page moves to and from L3 as one
  buffer and a page's layer is a run of whole engine blocks.
- Each slot remembers the page key written into it; a load names the key it
  expects and the pool refuses a mismatch (slot reused, store failed), so a
  bookkeeping bug costs a recompute, never wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1_000_000_000  # SGLang's hicache_size unit


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of the L2 pool; identical on the scheduler and every worker."""

    # Number of page slots in the pool.
    num_slots: int
    # KV layers copied per page (attention layers of the engine).
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
    ) -> PoolGeometry:
        """Size the pool by ``hicache_size_gb`` if > 0, else by ``hicache_ratio`` x L1."""
        page_bytes = num_layers * blocks_per_page * block_bytes
        if hicache_size_gb > 0:
            budget = int(hicache_size_gb * GB)
            source = f"hicache_size={hicache_size_gb} GB"
        else:
            budget = int(hicache_ratio * l1_num_blocks * num_layers * block_bytes)
            source = f"hicache_ratio={hicache_ratio} x L1 ({l1_num_blocks} blocks)"
        num_slots = budget // page_bytes
        if num_slots < 1:
            raise ValueError(
                f"L2 budget of {budget} bytes ({source}) is smaller than one page "
                f"of {page_bytes} bytes; raise hicache_size or hicache_ratio"
            )
        return cls(num_slots, num_layers, blocks_per_page, block_bytes)


class HostPagePool:
    """Fixed-size host buffer of page slots plus the page key held by each slot."""

    def __init__(self, geometry: PoolGeometry, *, pin_memory: bool | None = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.geometry = geometry
        self.buffer = torch.empty(
            (geometry.num_slots, geometry.num_layers, geometry.blocks_per_page,
             geometry.block_bytes),
            dtype=torch.uint8,
            pin_memory=pin_memory,
        )
        self._slot_keys: list[bytes | None] = [None] * geometry.num_slots

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def set_key(self, slot: int, key: bytes | None) -> None:
        """Record which page now lives in ``slot`` (None = contents invalid)."""
        self._slot_keys[slot] = key

    def holds(self, slot: int, key: bytes) -> bool:
        """True when ``slot`` contains the page whose key is ``key``."""
        return self._slot_keys[slot] == key

    def invalidate_all(self) -> None:
        self._slot_keys = [None] * self.geometry.num_slots
