"""L2 host page pool: the bytes of cached pages, owned by one worker (TP rank).

Contract:
- ``PoolGeometry`` is computed identically in the scheduler and in every
  worker from the engine's KV-cache shape and the configured budget, so slot
  numbers chosen by the scheduler are valid on every rank.
- ``HostPagePool`` allocates exactly ``geometry.buffer_bytes`` once (pinned
  when CUDA is available) and never grows: host memory stays within budget.
- Layouts order (slot, layer, block-in-page) units of one engine block's
  bytes, as SGLang's host layouts order (page, layer, token) units. The
  block is the finest unit here because its inner bytes mean different
  things per attention backend (CPU: a head's K rows then its V rows;
  FlashAttention: K||V per token); MLA blocks hold one latent per token and
  need nothing different.
    ``layer_first``        [layer, slot, block, byte]: per layer, slots are
                           contiguous (as vLLM's own cache); a page is L pieces.
    ``page_first``         [slot, block, layer, byte]: a page is contiguous,
                           block-major then layer (SGLang: token then layer).
    ``page_first_direct``  [slot, layer, block, byte]: a page is contiguous and
                           so is each (page, layer): one copy per page and layer.
  ``canonical`` is the same memory viewed as [slot, layer, block, byte] for
  every layout, which is what the copy paths index.
- Each slot remembers the page key written into it; a load names the key it
  expects and the pool refuses a mismatch (slot reused, store failed), so a
  bookkeeping bug costs a recompute, never wrong KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1_000_000_000  # SGLang's hicache_size unit

# layout -> buffer dim order, in canonical dims (0 slot, 1 layer, 2 block, 3 byte)
LAYOUT_DIMS: dict[str, tuple[int, int, int, int]] = {
    "layer_first": (1, 0, 2, 3),
    "page_first": (0, 2, 1, 3),
    "page_first_direct": (0, 1, 2, 3),
}


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

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        layout: str = "page_first_direct",
        pin_memory: bool | None = None,
    ) -> None:
        if layout not in LAYOUT_DIMS:
            raise ValueError(f"unknown host layout {layout!r}; allowed: {sorted(LAYOUT_DIMS)}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.geometry = geometry
        self.layout = layout
        canonical_shape = (geometry.num_slots, geometry.num_layers, geometry.blocks_per_page,
                           geometry.block_bytes)
        order = LAYOUT_DIMS[layout]
        self.buffer = torch.empty(
            tuple(canonical_shape[d] for d in order), dtype=torch.uint8, pin_memory=pin_memory
        )
        # Inverse permutation: canonical dim i is buffer dim order.index(i).
        self.canonical = self.buffer.permute(*(order.index(i) for i in range(4)))
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

    def page_view(self, slot: int) -> torch.Tensor | None:
        """Slot ``slot`` as one contiguous 1-D uint8 view, or None (layer_first)."""
        page = self.buffer[slot] if self.layout != "layer_first" else None
        return None if page is None else page.view(-1)

    def read_page(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s bytes in slot order: a view where contiguous, else a copy
        in [layer, block, byte] order (the order page_first_direct stores)."""
        view = self.page_view(slot)
        return view if view is not None else self.canonical[slot].contiguous().view(-1)

    def write_page(self, slot: int, data: torch.Tensor) -> None:
        """Fill slot ``slot`` from ``read_page``-ordered bytes."""
        view = self.page_view(slot)
        if view is not None:
            view.copy_(data)
        else:
            self.canonical[slot].copy_(data.view(self.canonical.shape[1:]))

    def invalidate_all(self) -> None:
        self._slot_keys = [None] * self.geometry.num_slots
