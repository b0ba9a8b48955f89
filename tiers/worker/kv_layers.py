"""vLLM's KV cache as rows of raw bytes: one ``(num_blocks, block_bytes)`` uint8 view per pool row.

Contract:
- ``KVLayers.of(kv_caches, groups, num_blocks, block_bytes)`` views each
  layer's KV as whole blocks of raw bytes, sharing memory. With several
  KV-cache groups (vLLM's hybrid manager) a pool row per layer of each
  group, in group order; layers of one group that share another layer's KV
  map to one row; layers of different groups that share a tensor are
  separate rows. A layer outside every group that reads another layer's KV
  maps to that layer's row (the worker waits for that row's load).
- A Mamba layer's state tensors (conv, ssm) view the same per-block pages
  of one buffer: the row is each block's first ``block_bytes``, padding
  included.
- Tensors that do not match the engine's KV spec raise ``RuntimeError`` at
  registration (a start failure, never a wrong copy later).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.kernels.block_copy import block_byte_view


@dataclass(frozen=True)
class KVLayers:
    """The pool rows of one rank's KV cache and how vLLM's layers map to them."""

    rows: list[torch.Tensor]
    # Pool rows of each group, and each row's group.
    group_rows: list[list[int]]
    group_of_row: list[int]
    # vLLM's layer name -> its row.
    row_of_layer: dict[str, int]

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]] | None,
           num_blocks: int, block_bytes: int, max_rows: int) -> KVLayers:
        rows: list[torch.Tensor] = []
        names = groups or [list(kv_caches)]
        group_rows: list[list[int]] = [[] for _ in names]
        group_of_row: list[int] = []
        row_of_layer: dict[str, int] = {}
        first_row: dict[tuple[int, int], int] = {}
        for g, layer_names in enumerate(names):
            seen: dict[tuple[int, int], int] = {}
            for name in layer_names:
                view = block_view(kv_caches[name], num_blocks, block_bytes)
                ident = (view.untyped_storage().data_ptr(), int(view.storage_offset()))
                if ident not in seen:
                    seen[ident] = len(rows)
                    first_row.setdefault(ident, len(rows))
                    group_rows[g].append(len(rows))
                    group_of_row.append(g)
                    rows.append(view)
                row_of_layer[name] = seen[ident]
        for name, tensor in kv_caches.items():
            if not isinstance(tensor, torch.Tensor) or name in row_of_layer:
                continue
            ident = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
            if ident in first_row:
                row_of_layer[name] = first_row[ident]
        got = rows[0].shape[1]
        if got != block_bytes or len(rows) > max_rows:
            raise RuntimeError(
                f"KV tensors ({len(rows)} layers x {got} B/block) do not match the "
                f"KV cache spec ({max_rows} layers x {block_bytes} B/block)")
        return cls(rows, group_rows, group_of_row, row_of_layer)


def block_view(kv: Any, num_blocks: int, block_bytes: int) -> torch.Tensor:
    """One layer's L1 as ``(num_blocks, block_bytes)`` uint8, sharing memory: an
    attention layer's KV tensor, or a Mamba layer's state tensors (conv, ssm),
    which view the same per-block pages of one buffer."""
    if isinstance(kv, torch.Tensor):
        view = block_byte_view(kv, num_blocks)
        if view.shape[1] < block_bytes <= view.stride(0):
            # A state page smaller than the block (vLLM pads it to the attention
            # page size): copy the whole block, padding included.
            view = view.as_strided((num_blocks, block_bytes), (view.stride(0), 1))
        return view
    parts = list(kv)
    item = [t.element_size() for t in parts]
    strides = {t.stride(0) * n for t, n in zip(parts, item, strict=True)}
    storages = {t.untyped_storage().data_ptr() for t in parts}
    if len(strides) != 1 or len(storages) != 1 or next(iter(strides)) < block_bytes:
        raise ValueError(f"state tensors of one layer do not share one block layout "
                         f"(block strides {sorted(strides)} B, {len(storages)} buffers)")
    base = min(t.storage_offset() * n for t, n in zip(parts, item, strict=True))
    raw = torch.empty(0, dtype=torch.uint8, device=parts[0].device)
    raw.set_(parts[0].untyped_storage())
    return raw.as_strided((num_blocks, block_bytes), (next(iter(strides)), 1), base)
