"""Worker half of the connector: owns this rank's L2 bytes and performs the planned copies.

Contract:
- ``register_kv_caches`` views each layer's KV as whole blocks of raw bytes
  and allocates the host pool once, sized by the same ``PoolGeometry`` the
  scheduler uses.
- ``start_load`` copies every planned L2 -> L1 page before the forward pass.
  A page whose slot does not hold the expected key is not loaded: its blocks
  and every later block of that request go to ``take_load_errors`` so vLLM
  recomputes them, and the slot is reported back to the scheduler.
- ``save`` copies planned L1 -> L2 pages after the forward pass and records
  each slot's key; a failed copy invalidates the slots instead of raising.
- Nothing here raises into the engine for a cache problem: failures degrade
  to recompute.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hicache.connector.metadata import HiCacheStepMetadata, HiCacheWorkerReport, PagePlan
from hicache.kernels import io_backend
from hicache.kernels.block_copy import BlockTransfer, block_byte_view
from hicache.tiers.host_pool import HostPagePool, PoolGeometry

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """Counters of one worker (pages are L2 pages; blocks are vLLM blocks)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    saved_pages: int = 0
    saved_bytes: int = 0
    load_errors: int = 0
    save_errors: int = 0


class HiCacheWorker:
    """Copies between vLLM's KV blocks and the L2 host pool of this rank."""

    def __init__(
        self,
        geometry: PoolGeometry,
        l1_num_blocks: int,
        *,
        layout: str = "page_first_direct",
        io: str = "direct",
    ) -> None:
        self.geometry = geometry
        self.l1_num_blocks = l1_num_blocks
        self.layout = layout
        self.io = io
        self.copy_path = io_backend.TORCH_SLICES
        self.pool: HostPagePool | None = None
        self.layers: list[torch.Tensor] = []
        self.stats = WorkerStats()
        self._load_errors: set[int] = set()
        self._bad_slots: set[int] = set()
        self._released: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: set[tuple[int, int]] = set()
        layers = []
        for tensor in kv_caches.values():
            # Layers that share another layer's KV map to the same tensor.
            ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if ident in seen:
                continue
            seen.add(ident)
            layers.append(block_byte_view(tensor, self.l1_num_blocks))
        block_bytes = layers[0].shape[1]
        if block_bytes != self.geometry.block_bytes or len(layers) > self.geometry.num_layers:
            raise RuntimeError(
                f"KV tensors ({len(layers)} layers x {block_bytes} B/block) do not match the "
                f"KV cache spec ({self.geometry.num_layers} layers x "
                f"{self.geometry.block_bytes} B/block)"
            )
        self.layers = layers
        self.copy_path = io_backend.select(self.io, layers[0].device.type)
        geometry = PoolGeometry(
            self.geometry.num_slots, len(layers), self.geometry.blocks_per_page, block_bytes
        )
        self.pool = HostPagePool(geometry, layout=self.layout)
        logger.info(
            "HiCache L2 pool: %d pages x %.2f MiB = %.2f GiB, %s, %s, copies: %s",
            geometry.num_slots,
            geometry.page_bytes / 2**20,
            geometry.buffer_bytes / 2**30,
            self.layout,
            "pinned" if self.pool.buffer.is_pinned() else "pageable",
            self.copy_path.name,
        )

    # ---- loads ----------------------------------------------------------------

    def start_load(self, meta: HiCacheStepMetadata) -> None:
        pool = self._require_pool()
        block_ids: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        for load in meta.loads:
            self._load_errors.update(load.unloadable_block_ids)
            failed = False
            for page in load.pages:
                if failed or not pool.holds(page.slot, page.key):
                    if not failed:
                        logger.warning(
                            "HiCache: L2 slot %d does not hold the expected page for request "
                            "%s; recomputing from there", page.slot, load.req_id,
                        )
                        self._bad_slots.add(page.slot)
                    failed = True
                    self._load_errors.update(page.block_ids)
                    continue
                _append_page(page, block_ids, slots, offsets)
        if not block_ids:
            return
        transfer = BlockTransfer.from_lists(block_ids, slots, offsets)
        try:
            self.copy_path.load(pool.canonical, self.layers, transfer)
        except Exception:  # a cache failure must cost a recompute, not the engine
            logger.exception("HiCache: L2 -> L1 copy failed; recomputing those blocks")
            self._load_errors.update(block_ids)
            self.stats.load_errors += len(block_ids)
            return
        self.stats.loaded_blocks += len(block_ids)
        self.stats.loaded_bytes += len(block_ids) * self.geometry.block_bytes * len(self.layers)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        self.stats.load_errors += len(errors)
        return errors

    # ---- stores ---------------------------------------------------------------

    def save(self, meta: HiCacheStepMetadata) -> None:
        pool = self._require_pool()
        if meta.stores:
            block_ids: list[int] = []
            slots: list[int] = []
            offsets: list[int] = []
            for page in meta.stores:
                pool.set_key(page.slot, None)  # invalid until the bytes are in
                _append_page(page, block_ids, slots, offsets)
            try:
                self.copy_path.save(self.layers, pool.canonical, BlockTransfer.from_lists(
                    block_ids, slots, offsets))
            except Exception:
                logger.exception("HiCache: L1 -> L2 copy failed; dropping those pages")
                self._bad_slots.update(p.slot for p in meta.stores)
                self.stats.save_errors += len(meta.stores)
            else:
                for page in meta.stores:
                    pool.set_key(page.slot, page.key)
                self.stats.saved_pages += len(meta.stores)
                self.stats.saved_bytes += len(meta.stores) * pool.geometry.page_bytes
        self._released.update(meta.release_after_store)

    def take_released(self) -> set[str]:
        released, self._released = self._released, set()
        return released

    def take_report(self) -> HiCacheWorkerReport | None:
        if not self._bad_slots:
            return None
        report, self._bad_slots = HiCacheWorkerReport(self._bad_slots), set()
        return report

    def _require_pool(self) -> HostPagePool:
        if self.pool is None:
            raise RuntimeError("HiCache worker used before register_kv_caches")
        return self.pool


def _append_page(
    page: PagePlan, block_ids: list[int], slots: list[int], offsets: list[int]
) -> None:
    for i, block_id in enumerate(page.block_ids):
        block_ids.append(block_id)
        slots.append(page.slot)
        offsets.append(page.first_offset + i)
