"""L2 host page pool: the bytes of cached pages, owned by one worker (TP rank).

See DESIGN.md "Invariants".

Contract:
- The pool's shape is a ``PoolGeometry`` (``tiers/l2/geometry.py``, plain
  arithmetic the scheduler shares), computed identically in the scheduler
  and in every worker, so slot numbers chosen by the scheduler are valid on
  every rank.
- ``HostPagePool`` allocates exactly ``geometry.buffer_bytes`` once and never
  grows: host memory stays within budget. With CUDA it is page-locked
  through ``host_memory.allocate`` (mmap + ``cudaHostRegister``: exactly the
  pool's bytes, on the GPU's NUMA node), not torch's power-of-two caching
  pinned allocator; ``close()`` unregisters it.
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
- A slot may also remember the xxh3-64 checksum of its bytes in
  ``read_page`` order (``set_checksums``), computed once where the bytes were
  just written (the store's copy thread); L3 writes reuse it instead of
  reading the page again (``checksums_of``: None where unknown). Any
  ``set_key`` forgets it: new bytes, new checksum.
"""

from __future__ import annotations

import torch

from hicache.tiers.l2.geometry import GB, PoolGeometry
from hicache.tiers.l2.host_memory import HostBuffer, allocate

# PoolGeometry and GB live in the torch-free geometry module; importers of this
# module get them here too.
__all__ = ["GB", "LAYOUT_DIMS", "HostPagePool", "PoolGeometry"]

# layout -> buffer dim order, in canonical dims (0 slot, 1 layer, 2 block, 3 byte)
LAYOUT_DIMS: dict[str, tuple[int, int, int, int]] = {
    "layer_first": (1, 0, 2, 3),
    "page_first": (0, 2, 1, 3),
    "page_first_direct": (0, 1, 2, 3),
}


class HostPagePool:
    """Fixed-size host buffer of page slots plus the page key held by each slot."""

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        layout: str = "page_first_direct",
        pin_memory: bool | None = None,
        device: torch.device | None = None,
    ) -> None:
        if layout not in LAYOUT_DIMS:
            raise ValueError(f"unknown host layout {layout!r}; allowed: {sorted(LAYOUT_DIMS)}")
        if pin_memory is None:
            pin_memory = (device.type == "cuda" if device is not None
                          else torch.cuda.is_available())
        self.geometry = geometry
        self.layout = layout
        canonical_shape = (geometry.num_slots, geometry.num_layers, geometry.blocks_per_page,
                           geometry.block_bytes)
        order = LAYOUT_DIMS[layout]
        # device: the GPU the pool serves (its NUMA node gets the pages).
        self.memory: HostBuffer = allocate(geometry.buffer_bytes, pin=pin_memory, device=device)
        self.buffer = self.memory.tensor.view(tuple(canonical_shape[d] for d in order))
        # Inverse permutation: canonical dim i is buffer dim order.index(i).
        self.canonical = self.buffer.permute(*(order.index(i) for i in range(4)))
        self._slot_keys: list[bytes | None] = [None] * geometry.num_slots
        self._slot_sums: list[int | None] = [None] * geometry.num_slots

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def set_key(self, slot: int, key: bytes | None) -> None:
        """Record which page now lives in ``slot`` (None = contents invalid)."""
        self._slot_keys[slot] = key
        self._slot_sums[slot] = None

    def set_checksums(self, slots: list[int], sums: list[int]) -> None:
        """The checksums of these slots' current bytes (read_page order)."""
        for slot, value in zip(slots, sums, strict=True):
            self._slot_sums[slot] = int(value)

    def checksums_of(self, slots: list[int]) -> list[int | None]:
        """The known checksum of each slot's bytes (None: not known)."""
        return [self._slot_sums[s] for s in slots]

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

    def close(self) -> None:
        """Unpin the buffer (idempotent); call when no copy uses it any more."""
        self.memory.release()

    def __del__(self) -> None:
        # A registration outliving its mapping would make CUDA refuse the next
        # pool mapped at the same address (cudaErrorHostMemoryAlreadyRegistered).
        memory = getattr(self, "memory", None)
        if memory is not None:
            memory.release()

    def invalidate_all(self) -> None:
        self._slot_keys = [None] * self.geometry.num_slots
        self._slot_sums = [None] * self.geometry.num_slots
