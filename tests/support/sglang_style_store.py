"""A store written to SGLang's ``HiCacheStorage`` interface, as a third party writes one.

It knows nothing of HiCache: it is built as SGLang builds a ``dynamic``
backend, ``SGLangStyleFileStore(storage_config, kwargs)``, and offers
SGLang's per-key methods on tensors, each key one ``<key>.bin`` file in
``storage_config.extra_config["path"]`` (what SGLang's own file store does).
``get`` fills ``target_location`` and returns it (None on a miss), ``set``
skips a key that exists, ``batch_exists`` is the loop SGLang's base class
has, ``clear`` removes every file. ``calls`` counts the calls per method.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import torch


class SGLangStyleFileStore:
    """Per-key files under one directory; see the module docstring."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.dir = Path(storage_config.extra_config["path"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.suffix = f"_{storage_config.tp_rank}_{storage_config.tp_size}"
        self.calls: collections.Counter[str] = collections.Counter()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{self.suffix}.bin"

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        self.calls["get"] += 1
        assert target_location is not None
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        flat = target_location.view(-1).view(torch.uint8)
        if len(data) != flat.numel():
            return None
        flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return target_location

    def batch_get(self, keys: list[str], target_locations: list[torch.Tensor],
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        return [self.get(k, t) for k, t in zip(keys, target_locations, strict=True)]

    def set(self, key: str, value: torch.Tensor | None = None,
            target_location: Any = None, target_sizes: Any = None) -> bool:
        self.calls["set"] += 1
        assert value is not None
        if self.exists(key):
            return True
        tmp = self._path(key).with_suffix(".tmp")
        tmp.write_bytes(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        os.replace(tmp, self._path(key))
        return True

    def batch_set(self, keys: list[str], values: list[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        assert values is not None
        return all(self.set(k, v) for k, v in zip(keys, values, strict=True))

    def exists(self, key: str) -> bool:
        self.calls["exists"] += 1
        return self._path(key).exists()

    def batch_exists(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        for path in self.dir.glob("*.bin"):
            path.unlink(missing_ok=True)
