"""GPU copy kernel (Triton): every (layer, block) of a transfer in ONE launch.

Contract:
- Same operands as ``block_copy.save_blocks`` / ``load_blocks``: the engine
  side is one ``(num_blocks, block_bytes)`` uint8 view per layer (each layer
  a separate tensor, e.g. from ``block_byte_view``), the host side is the
  pool's canonical ``(slot, layer, block, byte)`` uint8 view with the strides
  of any host layout (``HostPagePool.canonical``). Blocks move as opaque
  bytes, so dtype, MHA/MLA shape and the backend's K/V order do not matter.
- The engine layers must be on one CUDA device and the pool in pinned host
  memory. The kernel addresses the pool directly: with unified virtual
  addressing (every 64-bit CUDA platform) a pinned host pointer is valid on
  the device, so host bytes cross PCIe/NVLink-C2C inside the kernel, with no
  staging buffer and no per-block ``cudaMemcpyAsync``.
- One launch per call: a device int64 table holds the per-layer base
  addresses (layers are separate tensors), per-layer block strides and pool
  layer indices, and the per-unit (engine block, slot, block offset) of the
  transfer; a bounded grid of programs walks the (layer, unit) items. Each
  item copies one block in the widest word (8, 4, 2 or 1 bytes) that divides
  ``block_bytes`` and every base address and stride, hinting 16-byte
  alignment to the compiler when it holds so loads/stores vectorise.
  ``Tuning`` sets the grid (programs per SM), the warps per program, the
  chunk one loop iteration moves, and ``split``: whether the programs walk
  (layer, unit, chunk) items instead of whole blocks (more independent loads
  in flight when a transfer has few blocks). Every tuning moves the same
  bytes; ``TUNING`` is the one the io backend uses.
- ``precompile(layers, pool)`` compiles the kernels a transfer between these
  tensors will use (both directions) without running them, so the first
  load does not pay Triton's JIT (the worker calls it when vLLM registers its
  KV caches).
- Completion: ``save_blocks_async`` / ``load_blocks_async`` enqueue the copy
  on ``stream`` (default: the current stream of the engine device) and return
  at once. The copy is complete when that stream reaches this point of its
  work: after ``stream.synchronize()``, or for another stream after it waits
  on an event recorded on ``stream`` after the call. Until then the caller
  must not read the destination or overwrite the source. Index tables are
  allocated on ``stream`` (and staged through pinned memory that the caching
  host allocator keeps alive until the upload completes), so callers need no
  ``record_stream``. ``save_blocks`` / ``load_blocks`` are the synchronous
  forms: complete on return, like ``block_copy``.
- Indices are validated on the host before launch (the kernel has no bounds
  checks): an out-of-range block, slot, offset or layer raises IndexError and
  copies nothing.
- Triton is imported on first launch, never at module import (``tiers`` and
  ``kernels`` import without triton). ``available()`` says whether CUDA and
  triton are usable. For tests, the same kernel runs on CPU tensors under
  Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported;
  ``interpreter_active()``); with CPU tensors and no interpreter the calls
  raise ValueError.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.kernels.block_copy import BlockTransfer


@dataclass(frozen=True)
class Tuning:
    """How a launch spreads its bytes over the GPU (see the module contract)."""

    # Items are walked by at most this many programs per SM: a few programs per SM
    # keep loads in flight to cover PCIe latency while the copy leaves most of the
    # GPU to the forward pass (SGLang caps its kernel at a small CTA count too).
    programs_per_sm: int = 4
    # Warps per program; 0: one per 256 words of a chunk, at most 4.
    num_warps: int = 0
    # Largest chunk of words one program moves per loop iteration.
    max_chunk_words: int = 1024
    # Items are (layer, unit, chunk) instead of (layer, unit).
    split: bool = False


TUNING = Tuning()

_kernel: Any = None


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install means "not available"
        return False
    return True


def available() -> bool:
    """Whether the kernel can run on a GPU here: CUDA is usable and triton imports."""
    return torch.cuda.is_available() and _triton_importable()


def _copy_kernel() -> Any:
    """The Triton kernel, defined on first use (triton is imported here)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_layers", "n_units", "n_chunks"])
    def kv_block_copy(
        meta_ptr,  # noqa: ANN001 - int64[3*n_layers + 3*n_units], layout in _meta_table
        pool_base,  # noqa: ANN001 - int64 address of canonical[0, 0, 0, 0]
        pool_s_slot,  # noqa: ANN001 - canonical byte strides of the pool
        pool_s_layer,  # noqa: ANN001
        pool_s_block,  # noqa: ANN001
        n_layers,  # noqa: ANN001
        n_units,  # noqa: ANN001
        n_chunks,  # noqa: ANN001 - chunks of CHUNK words per block
        words,  # noqa: ANN001 - words per block
        WORD_T: tl.constexpr,  # word type: int64 / int32 / int16 / uint8
        CHUNK: tl.constexpr,  # words per loop iteration (power of two)
        EVEN: tl.constexpr,  # words == n_chunks * CHUNK: no mask needed
        ALIGN: tl.constexpr,  # every address is a multiple of ALIGN bytes
        LOAD: tl.constexpr,  # True: pool -> engine; False: engine -> pool
        SPLIT: tl.constexpr,  # items are (layer, unit, chunk), not (layer, unit)
    ):
        pid = tl.program_id(0)
        n_programs = tl.num_programs(0)
        per_block = n_chunks if SPLIT else 1
        for item in range(pid, n_layers * n_units * per_block, n_programs):
            # Layer-major: neighbouring programs take neighbouring units of
            # one layer, which are neighbours in the pool for most layouts.
            block_item = item // per_block
            lay = block_item // n_units
            unit = block_item % n_units
            layer_base = tl.load(meta_ptr + lay)
            layer_stride = tl.load(meta_ptr + n_layers + lay)
            pool_layer = tl.load(meta_ptr + 2 * n_layers + lay)
            block = tl.load(meta_ptr + 3 * n_layers + unit)
            slot = tl.load(meta_ptr + 3 * n_layers + n_units + unit)
            offset = tl.load(meta_ptr + 3 * n_layers + 2 * n_units + unit)
            engine_addr = layer_base + block * layer_stride
            host_addr = pool_base + slot * pool_s_slot + pool_layer * pool_s_layer
            host_addr += offset * pool_s_block
            # int64 -> pointer: the engine tensors and (via UVA) the pinned
            # pool are plain addresses in the device's address space.
            engine = engine_addr.to(tl.pointer_type(WORD_T))
            host = host_addr.to(tl.pointer_type(WORD_T))
            if ALIGN > 1:
                engine = tl.multiple_of(engine, ALIGN)
                host = tl.multiple_of(host, ALIGN)
            if LOAD:
                src = host
                dst = engine
            else:
                src = engine
                dst = host
            if SPLIT:
                offs = (item % per_block) * CHUNK + tl.arange(0, CHUNK)
                if EVEN:
                    tl.store(dst + offs, tl.load(src + offs))
                else:
                    mask = offs < words
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
            else:
                for chunk in range(0, n_chunks):
                    offs = chunk * CHUNK + tl.arange(0, CHUNK)
                    if EVEN:
                        tl.store(dst + offs, tl.load(src + offs))
                    else:
                        mask = offs < words
                        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    _kernel = kv_block_copy
    return _kernel


def _word_type(nbytes: int) -> Any:
    import triton.language as tl

    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}[nbytes]


def _alignment(values: Sequence[int]) -> int:
    """Largest power of two <= 16 dividing every value."""
    g = 0
    for v in values:
        g = math.gcd(g, int(v))
    align = 16
    while align > 1 and g % align:
        align //= 2
    return align


def _check_shapes(
    layers: Sequence[torch.Tensor], pool: torch.Tensor, indices: Sequence[int]
) -> None:
    if pool.dim() != 4 or pool.dtype != torch.uint8 or pool.stride(3) != 1:
        raise ValueError("pool must be the canonical (slot, layer, block, byte) uint8 view")
    block_bytes = pool.shape[3]
    for i in indices:
        if not 0 <= i < len(layers):
            raise IndexError(f"layer index {i} outside the {len(layers)} engine layers")
        if i >= pool.shape[1]:
            raise IndexError(f"layer index {i} outside the pool's {pool.shape[1]} layers")
        t = layers[i]
        if t.dim() != 2 or t.dtype != torch.uint8 or t.shape[1] != block_bytes:
            raise ValueError(
                f"layer {i} must be a (num_blocks, {block_bytes}) uint8 view, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
        if t.stride(1) != 1:
            raise ValueError(f"layer {i}: a block's bytes must be contiguous")


def _check_devices(
    layers: Sequence[torch.Tensor], pool: torch.Tensor, indices: Sequence[int]
) -> torch.device:
    """The engine device, once the pool and layers are where the kernel can reach them."""
    device = layers[indices[0]].device
    if any(layers[i].device != device for i in indices):
        raise ValueError("all engine layers must be on one device")
    if device.type == "cuda":
        if pool.device.type != "cpu" or not pool.is_pinned():
            raise ValueError(
                "the GPU copy kernel reads and writes the host pool directly, so the pool "
                "must be pinned host memory (HostPagePool(pin_memory=True))"
            )
    elif device.type == "cpu":
        if not interpreter_active():
            raise ValueError(
                "the Triton copy kernel runs on CPU tensors only under TRITON_INTERPRET=1 "
                "(tests); use kernels.cpu_copy on CPU"
            )
        if pool.device.type != "cpu":
            raise ValueError("pool must be in host memory")
    else:
        raise ValueError(f"unsupported engine device {device}")
    return device


def _units(
    transfer: BlockTransfer, layers: Sequence[torch.Tensor], pool: torch.Tensor,
    indices: Sequence[int],
) -> np.ndarray:
    """(3, n_units) int64: engine block, slot, block offset of every block moved
    (the transfer's cached ``units``), checked against the layers and the pool."""
    out = transfer.units
    n = out.shape[1]
    num_blocks = min(layers[j].shape[0] for j in indices)
    for row, limit, what in ((0, num_blocks, "engine block"), (1, pool.shape[0], "pool slot"),
                             (2, pool.shape[2], "block offset in page")):
        if n and (out[row].min() < 0 or out[row].max() >= limit):
            bad = out[row][(out[row] < 0) | (out[row] >= limit)][0]
            raise IndexError(f"{what} {bad} outside [0, {limit})")
    return out


def _meta_table(
    layers: Sequence[torch.Tensor], indices: Sequence[int], units: np.ndarray
) -> np.ndarray:
    """[layer base addr x L, layer block stride x L, pool layer x L, block x U, slot x U,
    offset x U] as one int64 array (one upload)."""
    per_layer = np.array(
        [[layers[i].data_ptr() for i in indices],
         [layers[i].stride(0) for i in indices],
         list(indices)],
        dtype=np.int64,
    )
    return np.concatenate([per_layer.reshape(-1), units.reshape(-1)])


def _plan(
    layers: Sequence[torch.Tensor], pool: torch.Tensor, indices: Sequence[int], n_units: int,
    load: bool, tuning: Tuning, max_programs: int | None, device: torch.device,
) -> tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]:
    """(grid, scalar arguments, compile-time constants) of one launch."""
    block_bytes = pool.shape[3]
    s_slot, s_layer, s_block, _ = pool.stride()
    align = _alignment(
        [block_bytes, pool.data_ptr(), s_slot, s_layer, s_block]
        + [layers[i].data_ptr() for i in indices] + [layers[i].stride(0) for i in indices]
    )
    word = min(align, 8)
    words = block_bytes // word
    low_bit = words & -words  # largest power of two dividing words
    if low_bit >= 128:  # chunks tile the block exactly: no masks
        chunk = min(low_bit, tuning.max_chunk_words)
    else:
        chunk = min(_next_power_of_2(words), tuning.max_chunk_words)
    n_chunks = -(-words // chunk)
    n_items = len(indices) * n_units * (n_chunks if tuning.split else 1)
    if max_programs is None:
        max_programs = _default_programs(device, tuning)
    grid = (max(1, min(n_items, max_programs)),)
    args = (pool.data_ptr(), s_slot, s_layer, s_block, len(indices), n_units, n_chunks, words)
    warps = tuning.num_warps or max(1, min(4, chunk // 256))
    consts = dict(WORD_T=_word_type(word), CHUNK=chunk, EVEN=words == n_chunks * chunk,
                  ALIGN=align, LOAD=load, SPLIT=tuning.split, num_warps=warps,
                  enable_fp_fusion=False)  # no float math; also silences triton 3.9's warning
    return grid, args, consts


def launch(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
    *,
    load: bool,
    stream: torch.cuda.Stream | None = None,
    max_programs: int | None = None,
    tuning: Tuning | None = None,
) -> None:
    """Enqueue one kernel moving ``transfer`` for the chosen layers (see module contract).

    ``load=True`` copies pool -> engine, else engine -> pool. ``max_programs``
    caps the grid (default: the tuning's programs per SM x the SM count on a GPU).
    """
    indices = list(range(len(layers)) if layer_indices is None else layer_indices)
    if not len(transfer) or not indices:
        return
    _check_shapes(layers, pool, indices)
    units = _units(transfer, layers, pool, indices)
    device = _check_devices(layers, pool, indices)
    grid, args, consts = _plan(layers, pool, indices, units.shape[1], load,
                               tuning or TUNING, max_programs, device)
    table = torch.from_numpy(_meta_table(layers, indices, units))
    kernel = _copy_kernel()
    if device.type == "cpu":  # interpreter: runs synchronously
        kernel[grid](table, *args, **consts)
        return
    if stream is None:
        stream = torch.cuda.current_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        meta = table.pin_memory().to(device, non_blocking=True)
        kernel[grid](meta, *args, **consts)


def precompile(
    layers: Sequence[torch.Tensor], pool: torch.Tensor, tuning: Tuning | None = None
) -> int:
    """Compile (without running) the save and load kernels that transfers between
    ``layers`` and ``pool`` will launch; returns how many were compiled. A no-op
    (0) where the kernel cannot run: no CUDA, or CPU tensors."""
    indices = list(range(min(len(layers), pool.shape[1])))
    if not indices or not available() or layers[0].device.type != "cuda":
        return 0
    _check_shapes(layers, pool, indices)
    device = _check_devices(layers, pool, indices)
    kernel = _copy_kernel()
    meta = torch.zeros(3 * len(indices) + 3, dtype=torch.int64, device=device)
    compiled = 0
    with torch.cuda.device(device):
        for load in (True, False):
            grid, args, consts = _plan(layers, pool, indices, 1, load, tuning or TUNING, None,
                                       device)
            kernel.warmup(meta, *args, grid=grid, **consts)
            compiled += 1
    return compiled


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_programs(device: torch.device, tuning: Tuning = TUNING) -> int:
    if device.type != "cuda":
        return 4  # interpreter: programs run one after another anyway
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuning.programs_per_sm * _sm_count(index)


def save_blocks_async(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Enqueue engine -> pool on ``stream`` (default current); complete when it gets there."""
    launch(layers, pool, transfer, layer_indices, load=False, stream=stream)


def load_blocks_async(
    pool: torch.Tensor,
    layers: Sequence[torch.Tensor],
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Enqueue pool -> engine on ``stream`` (default current); complete when it gets there."""
    launch(layers, pool, transfer, layer_indices, load=True, stream=stream)


def save_blocks(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
) -> None:
    """Engine -> pool, complete on return (``block_copy.save_blocks`` contract)."""
    launch(layers, pool, transfer, layer_indices, load=False)
    _sync(layers, layer_indices)


def load_blocks(
    pool: torch.Tensor,
    layers: Sequence[torch.Tensor],
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
) -> None:
    """Pool -> engine, complete on return (``block_copy.load_blocks`` contract)."""
    launch(layers, pool, transfer, layer_indices, load=True)
    _sync(layers, layer_indices)


def _sync(layers: Sequence[torch.Tensor], layer_indices: Sequence[int] | None) -> None:
    """Wait for the current stream of the engine device (the kernel was launched on it)."""
    indices = list(range(len(layers)) if layer_indices is None else layer_indices)
    if indices and layers[indices[0]].device.type == "cuda":
        torch.cuda.current_stream(layers[indices[0]].device).synchronize()
