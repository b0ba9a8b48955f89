"""A store written to SGLang's ``HiCacheStorage`` interface, as a HiCache L3 backend.

Contract:
- ``is_sglang_storage(cls)``: a class (not a ``StorageBackend``) with SGLang's
  per-key methods ``get``, ``set`` and ``exists`` — what SGLang requires of a
  custom backend. The ``dynamic`` loader (factory.py) builds such a class
  as SGLang does, ``cls(storage_config, kwargs)`` with an
  ``SGLangStorageConfig`` (SGLang's ``HiCacheStorageConfig`` fields) and an
  empty ``kwargs``, and wraps it in ``SGLangStorage``; SGLang need not be
  installed.
- ``SGLangStorage`` keeps the batch contract of base.py with the class's
  per-key calls: each page is one object under ``object_key(key)`` (the
  storage fingerprint in the name), holding the ``integrity`` header then
  the payload, passed to ``set(key, value)`` as one flat uint8 CPU tensor
  and read with ``get(key, target_location)`` into such a tensor (the
  class may also return a tensor of its own, or None for a miss). Every
  read is verified; a page that fails is a corrupt miss. Writes skip
  objects ``exists`` finds. ``exists_prefix`` is the class's
  ``batch_exists`` where it has one (SGLang's: how many leading keys exist),
  else ``exists`` key by key. ``clear`` and ``close`` call the class's when it
  has them; ``delete`` its ``delete(key)`` if it has one, else a prefix flush
  of L3 fails with a clear error.
- Capabilities: none beyond the verbs (calls one at a time, from one thread).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageConfig, WriteBatch

SGLANG_METHODS = ("get", "set", "exists")
HEADER = integrity.HEADER_BYTES


def is_sglang_storage(cls: type) -> bool:
    """A class with SGLang's per-key methods, that is not a HiCache backend."""
    return (not issubclass(cls, StorageBackend)
            and all(inspect.isfunction(getattr(cls, m, None)) for m in SGLANG_METHODS))


@dataclass
class SGLangStorageConfig:
    """What SGLang hands a storage backend (its ``HiCacheStorageConfig`` fields)."""

    tp_rank: int
    tp_size: int
    is_mla_model: bool
    is_page_first_layout: bool
    model_name: str | None
    extra_config: dict[str, Any] = field(default_factory=dict)
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    enable_storage_metrics: bool = False

    @classmethod
    def of(cls, config: StorageConfig) -> SGLangStorageConfig:
        return cls(tp_rank=config.tp_rank, tp_size=config.tp_size, is_mla_model=config.is_mla,
                   is_page_first_layout=config.mem_layout != "layer_first",
                   model_name=config.model_name or None,
                   extra_config=dict(config.extra_config))


class SGLangStorage(StorageBackend):
    """``store`` (an SGLang-style storage object) behind the batch contract."""

    def __init__(self, store: Any, config: StorageConfig) -> None:
        super().__init__(config)
        self.store = store
        self._record = HEADER + config.page_bytes

    @classmethod
    def build(cls, store_cls: type, config: StorageConfig) -> SGLangStorage:
        return cls(store_cls(SGLangStorageConfig.of(config), {}), config)

    def _okeys(self, keys: Sequence[str]) -> list[str]:
        return [self.object_key(k) for k in keys]

    def exists_prefix(self, keys: Sequence[str]) -> int:
        okeys = self._okeys(keys)
        if callable(getattr(self.store, "batch_exists", None)):
            return max(0, min(len(okeys), int(self.store.batch_exists(okeys))))
        for i, okey in enumerate(okeys):
            if not self.store.exists(okey):
                return i
        return len(okeys)

    def read(self, batch: ReadBatch) -> list[bool]:
        pool = self._require_pool()
        results = []
        corrupt = 0
        target = torch.empty(self._record, dtype=torch.uint8)  # each page copied out at once
        for key, okey, slot in zip(batch.keys, self._okeys(batch.keys), batch.slots,
                                   strict=True):
            got = self.store.get(okey, target)
            if got is None or got is False:
                results.append(False)
                continue
            data = got if isinstance(got, torch.Tensor) else target
            data = data.reshape(-1).view(torch.uint8)
            ok = data.numel() == self._record and integrity.verify(
                data[:HEADER].numpy(), self.page_key_bytes(key), self.config.fingerprint,
                data[HEADER:].numpy()) is None
            if ok:
                pool.write_page(slot, data[HEADER:])
            corrupt += not ok
            results.append(ok)
        self.report.corrupt(corrupt)
        return results

    def write(self, batch: WriteBatch) -> list[bool]:
        pool = self._require_pool()
        results = []
        skipped = 0
        for key, okey, slot in zip(batch.keys, self._okeys(batch.keys), batch.slots,
                                   strict=True):
            if self.store.exists(okey):
                skipped += 1
                results.append(True)
                continue
            payload = pool.read_page(slot).reshape(-1)
            header = integrity.pack_header(self.page_key_bytes(key), self.config.fingerprint,
                                           payload)
            record = torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8),
                                payload.to(torch.uint8)])
            results.append(bool(self.store.set(okey, record)))
        self.report.skipped(skipped)
        return results

    def delete(self, keys: Sequence[str]) -> int:
        remove = getattr(self.store, "delete", None)
        if not callable(remove):
            return super().delete(keys)
        return sum(1 for okey in self._okeys(keys) if remove(okey))

    def clear(self) -> None:
        if not callable(getattr(self.store, "clear", None)):
            super().clear()
        self.store.clear()

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if callable(close):
            close()
