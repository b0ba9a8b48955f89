"""Worker half of the connector: owns this rank's L2 bytes and performs the planned copies.

Contract:
- ``register_kv_caches`` views each layer's KV as whole blocks of raw bytes
  and allocates the host pool once, sized by the same ``PoolGeometry`` the
  scheduler uses.
- ``start_load`` checks every planned L2 -> L1 page's key, then copies layer
  by layer on a background thread; ``wait_for_layer`` (vLLM calls it before
  each layer's attention) waits for that layer only. A page whose slot does
  not hold the expected key is not loaded: its blocks and every later block
  of that request go to ``take_load_errors`` so vLLM recomputes them, and
  the slot is reported back to the scheduler.
- ``save_layer`` starts copying a layer's planned L1 -> L2 pages as soon as
  that layer's attention has run; ``finish_step`` (vLLM's wait_for_save)
  copies the rest, waits for every copy of the step and only then records
  slot keys. A failed copy invalidates slots or reports blocks; it never
  raises. Nothing is in flight between steps.
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
from hicache.kernels.layer_pipeline import LayerPipeline
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
    # Layer-wise overlap actually used: waits for one layer's load, and layer
    # saves started during the forward pass (not at its end).
    layer_waits: int = 0
    layer_saves_in_forward: int = 0


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
        self._pipeline = LayerPipeline()
        self._layer_index: dict[str, int] = {}
        # Per-step state, reset by finish_step.
        self._loading: list[int] = []
        self._saved_layers: set[int] = set()
        self._stores_of: tuple[HiCacheStepMetadata, BlockTransfer] | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        seen: dict[tuple[int, int], int] = {}
        layers = []
        for name, tensor in kv_caches.items():
            # Layers that share another layer's KV map to the same tensor.
            ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if ident not in seen:
                seen[ident] = len(layers)
                layers.append(block_byte_view(tensor, self.l1_num_blocks))
            self._layer_index[name] = seen[ident]
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
        """Check every planned page's key, then copy layer by layer in the background."""
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
        self._loading = block_ids
        self._pipeline.start_load(
            lambda layer: self.copy_path.load(pool.canonical, self.layers, transfer, [layer]),
            len(self.layers),
        )

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this layer's planned loads are in vLLM's KV cache."""
        index = self._layer_index.get(layer_name)
        if index is not None and self._loading:
            self.stats.layer_waits += 1
            self._pipeline.wait_layer(index)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        self.stats.load_errors += len(errors)
        return errors

    # ---- stores ---------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: HiCacheStepMetadata) -> None:
        """This layer's KV is final for the step: copy its planned stores while later
        layers compute."""
        index = self._layer_index.get(layer_name)
        if not meta.stores or index is None or index in self._saved_layers:
            return
        transfer = self._store_transfer(meta)
        self._saved_layers.add(index)
        self.stats.layer_saves_in_forward += 1
        pool = self._require_pool()
        self._pipeline.submit(
            "save", lambda: self.copy_path.save(self.layers, pool.canonical, transfer, [index])
        )

    def finish_step(self, meta: HiCacheStepMetadata) -> None:
        """End of the step: copy the layers not saved yet, wait for every copy, and
        publish the outcome (slot keys, load errors, bad slots, released requests)."""
        pool = self._require_pool()
        if meta.stores:
            transfer = self._store_transfer(meta)
            rest = [i for i in range(len(self.layers)) if i not in self._saved_layers]
            if rest:
                self._pipeline.submit(
                    "save", lambda: self.copy_path.save(self.layers, pool.canonical, transfer, rest)
                )
        failures = {kind for kind, _ in self._pipeline.drain()}
        if self._loading:
            if "load" in failures:
                self._load_errors.update(self._loading)
            else:
                self.stats.loaded_blocks += len(self._loading)
                self.stats.loaded_bytes += (
                    len(self._loading) * self.geometry.block_bytes * len(self.layers)
                )
        if meta.stores:
            if "save" in failures:
                self._bad_slots.update(p.slot for p in meta.stores)
                self.stats.save_errors += len(meta.stores)
            else:
                for page in meta.stores:
                    pool.set_key(page.slot, page.key)
                self.stats.saved_pages += len(meta.stores)
                self.stats.saved_bytes += len(meta.stores) * pool.geometry.page_bytes
        self._released.update(meta.release_after_store)
        self._loading, self._saved_layers, self._stores_of = [], set(), None

    def _store_transfer(self, meta: HiCacheStepMetadata) -> BlockTransfer:
        """The step's store transfer, built once; slots are invalid until it lands."""
        if self._stores_of is None or self._stores_of[0] is not meta:
            pool = self._require_pool()
            block_ids: list[int] = []
            slots: list[int] = []
            offsets: list[int] = []
            for page in meta.stores:
                pool.set_key(page.slot, None)
                _append_page(page, block_ids, slots, offsets)
            self._stores_of = (meta, BlockTransfer.from_lists(block_ids, slots, offsets))
        return self._stores_of[1]

    def shutdown(self) -> None:
        self._pipeline.shutdown()

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
