"""vLLM's KV layers bound to this rank's L2 pool: which rows to copy and how.

Contract:
- ``KVCopies.bind`` (the worker's ``register_kv_caches``) views each layer's
  KV as pool rows of raw bytes (kv_layers.py), allocates the host pool once,
  sized by the same ``PoolGeometry`` the scheduler uses, picks the copy path
  (kernels/io_backend.py) and compiles its kernels ahead (a failure there
  only costs the first copy its compile), and makes the layer pipeline:
  on a CPU copies run in the forward thread between forward passes unless
  stores finish across steps (kernels/layer_pipeline.py "Inline mode"); on
  CUDA on a side stream with per-layer events.
- ``transfer(pages)`` is the copies of a set of pages, one ``BlockTransfer``
  per KV-cache group (transfers.py); ``copy_fn(kind)`` the function the
  pipeline runs (enqueue-only on a CUDA side stream).
- ``load_pages(pages)`` copies L2 -> L1 in the calling thread (the L3 I/O
  thread for a fetched request; on CUDA on the side stream, synchronised
  before the request is reported). Torch copies are thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.kernels import block_copy, io_backend
from hicache.kernels.io_backend import CopyPath
from hicache.kernels.layer_pipeline import LayerPipeline
from hicache.tiers.host_cpus import pin_current_thread
from hicache.tiers.index.plans import PagePlan
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.worker.kv_layers import KVLayers
from hicache.tiers.worker.stats import CopyClock
from hicache.tiers.worker.transfers import GroupTransfer, group_transfer

logger = logging.getLogger(__name__)

# A step stores layer by layer during the forward pass (each layer's copy overlapping
# the next layers' compute) only when a layer's share is at least this many bytes;
# smaller stores go as one copy of every layer at the end of the step. Each per-layer
# save costs the host an enqueue (GPU: an event pair, a stream switch and a kernel
# launch; CPU: a hand-off to the copy thread), which decode steps storing a page or
# two cannot repay (docs/gpu.md, "Serving under load on a GPU", has the measurement).
PER_LAYER_SAVE_MIN_BYTES = {"cuda": 4 << 20, "cpu": 256 << 10}


@dataclass
class KVCopies:
    """This rank's KV layers, its pool, and the pipeline that copies between them."""

    pool: HostPagePool
    layers: list[torch.Tensor]
    group_rows: list[list[int]]  # pool rows (layers) of each KV-cache group
    group_of_row: list[int]
    row_of_layer: dict[str, int]
    copy_path: CopyPath
    pipeline: LayerPipeline
    # A layer's share of a store below this is not saved during the forward pass.
    per_layer_min: int
    block_bytes: int
    side_stream: torch.cuda.Stream | None = None

    @classmethod
    def bind(cls, kv_caches: dict[str, Any], geometry: PoolGeometry, l1_num_blocks: int, *,
             group_layer_names: Sequence[Sequence[str]] | None, layout: str, io: str,
             async_stores: bool, helper_cpus: frozenset[int] = frozenset()) -> KVCopies:
        """``helper_cpus``: where the copy thread of ``async_stores`` runs on a CPU
        engine (tiers/worker/helper_cpus.py; empty: where it is started)."""
        kv = KVLayers.of(kv_caches, group_layer_names, l1_num_blocks,
                         geometry.block_bytes, geometry.num_layers)
        layers = kv.rows
        device = layers[0].device
        on_cuda = device.type == "cuda"
        pool = HostPagePool(
            PoolGeometry(geometry.num_slots, len(layers), geometry.blocks_per_page,
                         geometry.block_bytes),
            layout=layout, device=device)
        copies = cls(
            pool, layers, kv.group_rows, kv.group_of_row, kv.row_of_layer,
            io_backend.select(io, device.type),
            # CUDA: side stream + per-layer events, copies only enqueue (never block the host).
            LayerPipeline(device) if on_cuda else LayerPipeline(
                inline=not async_stores,
                thread_init=functools.partial(pin_current_thread, helper_cpus)),
            PER_LAYER_SAVE_MIN_BYTES["cuda" if on_cuda else "cpu"],
            geometry.block_bytes,
            torch.cuda.Stream(device) if on_cuda else None)
        copies._precompile()
        memory = pool.memory
        logger.info(
            "HiCache L2 pool: %d pages x %.2f MiB = %.2f GiB, %s, %s, copies: %s",
            pool.geometry.num_slots, pool.geometry.page_bytes / 2**20,
            pool.geometry.buffer_bytes / 2**30, layout,
            ("pinned (cudaHostRegister" + ("" if memory.numa_node is None
                                           else f", NUMA node {memory.numa_node}") + ")")
            if memory.pinned else "pageable",
            copies.copy_path.name)
        return copies

    def _precompile(self) -> None:
        """Triton's JIT (GPU) or numba's (CPU) now, not on a serving engine's first copy."""
        if self.copy_path.precompile is None:
            return
        try:
            compiled = self.copy_path.precompile(self.layers, self.pool.canonical)
            logger.info("HiCache: %d copy kernels compiled ahead", compiled)
        except Exception:  # noqa: BLE001 - an optimisation, never a start failure
            logger.exception("HiCache: compiling the copy kernels ahead failed; the "
                             "first copy will compile them")

    @property
    def on_cuda(self) -> bool:
        return self.pipeline.on_cuda

    def transfer(self, pages: Sequence[PagePlan]) -> GroupTransfer:
        return group_transfer(pages, self.group_rows)

    def copy_fn(self, kind: str) -> Callable[..., None]:
        """The copy function the pipeline runs: enqueue-only on a CUDA side stream."""
        if self.pipeline.on_cuda:
            fn = getattr(self.copy_path, f"{kind}_async")
            if fn is not None:
                return fn
        return getattr(self.copy_path, kind)

    def load_pages(self, pages: list[PagePlan]) -> GroupTransfer:
        """L2 -> L1 of ``pages`` in this thread (see the module docstring)."""
        transfer = self.transfer(pages)
        stream = (torch.cuda.stream(self.side_stream) if self.side_stream is not None
                  else contextlib.nullcontext())
        with stream:
            for group, rows in enumerate(self.group_rows):
                if len(transfer.groups[group]):
                    block_copy.load_blocks(self.pool.canonical, self.layers,
                                           transfer.groups[group], rows)
        return transfer

    def new_clock(self) -> CopyClock:
        return CopyClock(cuda=self.pipeline.on_cuda)
