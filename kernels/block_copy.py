"""Reference copy path between engine KV blocks and host pool pages (torch).

Contract:
- Engine side: one ``(num_blocks, block_bytes)`` uint8 tensor per layer, on
  CPU or GPU, where row ``b`` is the raw bytes of block ``b`` in that layer
  (see ``block_byte_view``). Blocks are copied as opaque bytes, so the
  attention backend's K/V arrangement inside a block does not matter.
- Host side: the pool's canonical ``(num_slots, num_layers, blocks_per_page,
  block_bytes)`` uint8 view, whatever its layout (``HostPagePool.canonical``):
  slices of it are contiguous or strided as the layout makes them.
- A transfer lists (engine block, pool slot, block offset in the page)
  triples, merged into runs that are contiguous on both sides; each run is
  one slice copy per layer. Indexed gathers (``index_select``/advanced
  indexing) copied ~10x slower than slice copies for KV-sized rows on CPU.
- ``save_blocks`` copies engine -> pool, ``load_blocks`` pool -> engine; both
  are complete when they return (device work is synchronised).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class CopyRun(NamedTuple):
    """``length`` consecutive engine blocks <-> consecutive block offsets of one slot
    (a named tuple: a step's store builds one per run, right after a forward pass)."""

    block_start: int
    slot: int
    offset: int
    length: int


@dataclass(frozen=True)
class BlockTransfer:
    """Which engine blocks move to/from which (slot, block-in-page) places, as merged runs."""

    runs: tuple[CopyRun, ...]

    @classmethod
    def from_lists(
        cls, block_ids: Sequence[int], slots: Sequence[int], offsets: Sequence[int]
    ) -> BlockTransfer:
        if not len(block_ids) == len(slots) == len(offsets):
            raise ValueError("block_ids, slots and offsets must have equal lengths")
        runs: list[CopyRun] = []
        for block, slot, offset in zip(block_ids, slots, offsets, strict=True):
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.slot == slot
                and last.block_start + last.length == block
                and last.offset + last.length == offset
            ):
                runs[-1] = CopyRun(last.block_start, slot, last.offset, last.length + 1)
            else:
                runs.append(CopyRun(block, slot, offset, 1))
        return cls(tuple(runs))

    def __len__(self) -> int:
        return self.num_blocks

    @functools.cached_property
    def num_blocks(self) -> int:
        """Blocks moved (computed once: a transfer is asked for it per layer)."""
        return sum(run.length for run in self.runs)

    @functools.cached_property
    def units(self) -> np.ndarray:
        """(3, blocks) int64, read-only: engine block, slot and block offset of every
        block moved, in run order. Computed once per transfer with whole-array
        operations (a copy kernel asks for it once per layer)."""
        if not self.runs:
            out = np.empty((3, 0), dtype=np.int64)
        else:
            cols = np.array([(r.block_start, r.slot, r.offset, r.length) for r in self.runs],
                            dtype=np.int64)
            lengths = cols[:, 3]
            run_of = np.repeat(np.arange(len(self.runs)), lengths)
            within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths,
                                                                lengths)
            out = np.stack([cols[run_of, 0] + within, cols[run_of, 1], cols[run_of, 2] + within])
        out.flags.writeable = False
        return out


def block_byte_view(layer_kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View one layer's KV tensor as ``(num_blocks, block_bytes)`` uint8, sharing memory.

    Works for any tensor whose dim 0 is the block and whose remaining dims
    cover one dense range per block, whatever their order (vLLM's LB** and
    BL** layouts). When the backend split manager blocks into smaller kernel
    blocks, dim 0 has a multiple of ``num_blocks`` rows that must be adjacent.
    Raises ValueError for anything else.
    """
    t = layer_kv
    rows = t.shape[0]
    if rows % num_blocks:
        raise ValueError(f"KV tensor has {rows} rows on dim 0, not a multiple of {num_blocks}")
    split = rows // num_blocks
    row_elems = 1
    dims = zip(t.stride()[1:], t.shape[1:], strict=True)
    for stride, size in sorted((s, n) for s, n in dims if n > 1):
        if stride != row_elems:
            raise ValueError(
                f"KV block is not one dense range (shape {tuple(t.shape)}, "
                f"stride {tuple(t.stride())})"
            )
        row_elems *= size
    if split > 1 and t.stride(0) != row_elems:
        raise ValueError("kernel blocks of one manager block are not adjacent in memory")
    item = t.element_size()
    as_bytes = t.view(torch.uint8) if t.stride(-1) == 1 else None
    if as_bytes is None:
        raise ValueError("KV tensor's innermost dim must be contiguous")
    return as_bytes.as_strided(
        (num_blocks, row_elems * split * item),
        (t.stride(0) * split * item, 1),
        t.storage_offset() * item,
    )


def save_blocks(
    layers: Sequence[torch.Tensor],
    pool: torch.Tensor,
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
    *,
    wait: bool = True,
) -> None:
    """Copy engine blocks into pool pages, for every layer or only ``layer_indices``.

    ``wait=False`` (CUDA) only enqueues the copies on the current stream."""
    for layer_idx in range(len(layers)) if layer_indices is None else layer_indices:
        layer = layers[layer_idx]
        for run in transfer.runs:
            end = run.block_start + run.length
            pool[run.slot, layer_idx, run.offset : run.offset + run.length].copy_(
                layer[run.block_start : end], non_blocking=True
            )
    if wait:
        _wait(layers)


def load_blocks(
    pool: torch.Tensor,
    layers: Sequence[torch.Tensor],
    transfer: BlockTransfer,
    layer_indices: Sequence[int] | None = None,
    *,
    wait: bool = True,
) -> None:
    """Copy pool pages into engine blocks, for every layer or only ``layer_indices``.

    ``wait=False`` (CUDA) only enqueues the copies on the current stream."""
    for layer_idx in range(len(layers)) if layer_indices is None else layer_indices:
        layer = layers[layer_idx]
        for run in transfer.runs:
            end = run.block_start + run.length
            layer[run.block_start : end].copy_(
                pool[run.slot, layer_idx, run.offset : run.offset + run.length],
                non_blocking=True,
            )
    if wait:
        _wait(layers)


def _wait(layers: Sequence[torch.Tensor]) -> None:
    # Slice copies to/from a GPU are async (cudaMemcpyAsync); the contract is
    # that a transfer is complete on return.
    if layers and layers[0].device.type == "cuda":
        torch.cuda.current_stream(layers[0].device).synchronize()
