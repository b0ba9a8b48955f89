"""Pick the copy path for an io backend and device.

``direct`` and ``kernel`` are SGLang's names.
- CPU: both resolve to the best CPU path, the numba batch copy
  (``cpu_copy``), else torch slice copies.
- GPU, ``direct``: torch slice copies (one ``cudaMemcpyAsync`` per merged run
  and layer, ``block_copy``).
- GPU, ``kernel``: the Triton copy kernel (``gpu_copy``), one launch for all
  pages and layers of a call, reading/writing the pinned pool directly.
  ``select`` raises ValueError when it cannot run (no CUDA or no triton).

Every path's ``save``/``load`` is complete on return. GPU paths also carry
``save_async``/``load_async``: same arguments, but they only enqueue the copy
on the current CUDA stream and return; the copy is complete when that stream
reaches it (``layer_pipeline`` runs them on its side stream). They are None
where a path has no asynchronous form (CPU). ``precompile``, where set, compiles
the path's kernels for a pair of layers and pool ahead of the first copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, get_args

import torch

from hicache.kernels import block_copy, cpu_copy, gpu_copy
from hicache.kernels.block_copy import BlockTransfer

# SGLang's io backend names; the connector config's hicache_io_backend accepts these.
IoBackendName = Literal["kernel", "direct"]

# (engine layers, pool canonical view, transfer, layer indices or None = all)
CopyFn = Callable[[Sequence[torch.Tensor], torch.Tensor, BlockTransfer, Sequence[int] | None],
                  None]
LoadFn = Callable[[torch.Tensor, Sequence[torch.Tensor], BlockTransfer, Sequence[int] | None],
                  None]


@dataclass(frozen=True)
class CopyPath:
    """The functions that move blocks, and a name for logs and benchmarks."""

    name: str
    save: CopyFn
    load: LoadFn
    # Enqueue-only forms on the current CUDA stream (None: no async form).
    save_async: CopyFn | None = None
    load_async: LoadFn | None = None
    # Compile ahead what the first copies between these layers and this pool
    # would compile (None: nothing to compile).
    precompile: Callable[[Sequence[torch.Tensor], torch.Tensor], int] | None = None


TORCH_SLICES = CopyPath("torch-slices", block_copy.save_blocks, block_copy.load_blocks,
                        partial(block_copy.save_blocks, wait=False),
                        partial(block_copy.load_blocks, wait=False))
CPU_BATCH = CopyPath("cpu-batch", cpu_copy.save_blocks, cpu_copy.load_blocks,
                     precompile=cpu_copy.precompile)
GPU_KERNEL = CopyPath("gpu-kernel", gpu_copy.save_blocks, gpu_copy.load_blocks,
                      gpu_copy.save_blocks_async, gpu_copy.load_blocks_async,
                      gpu_copy.precompile)


def select(io_backend: str, device_type: str) -> CopyPath:
    if io_backend not in get_args(IoBackendName):
        raise ValueError(
            f"unknown io backend {io_backend!r}; allowed: {list(get_args(IoBackendName))}")
    if device_type == "cpu" and cpu_copy.available():
        return CPU_BATCH
    if io_backend == "kernel" and device_type != "cpu":
        if device_type == "cuda" and gpu_copy.available():
            return GPU_KERNEL
        raise ValueError(
            f"io backend 'kernel' on {device_type!r}: the Triton GPU copy kernel cannot run "
            f"here (it needs CUDA and triton; CUDA usable: "
            f"{torch.cuda.is_available()}, triton importable: {gpu_copy._triton_importable()}); "
            "use io backend 'direct'"
        )
    return TORCH_SLICES
