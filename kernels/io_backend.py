"""Pick the copy path for an io backend and device.

``direct`` and ``kernel`` are SGLang's names. On CPU both resolve to the best
CPU path: the numba batch copy (``cpu_copy``), else torch slice copies. On
a GPU, ``direct`` is torch slice copies (one ``cudaMemcpyAsync`` per run and
layer); a GPU ``kernel`` path is not built yet (the config refuses it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hicache.kernels import block_copy, cpu_copy
from hicache.kernels.block_copy import BlockTransfer

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


TORCH_SLICES = CopyPath("torch-slices", block_copy.save_blocks, block_copy.load_blocks)
CPU_BATCH = CopyPath("cpu-batch", cpu_copy.save_blocks, cpu_copy.load_blocks)


def select(io_backend: str, device_type: str) -> CopyPath:
    if io_backend not in ("direct", "kernel"):
        raise ValueError(f"unknown io backend {io_backend!r}; allowed: ['direct', 'kernel']")
    if device_type == "cpu" and cpu_copy.available():
        return CPU_BATCH
    if io_backend == "kernel" and device_type != "cpu":
        raise ValueError("the GPU copy kernel is not built yet; use io backend 'direct'")
    return TORCH_SLICES
