"""Build an L3 backend by name: ``file``, ``mooncake``, ``nixl``, ``lmcache`` or ``dynamic``.

Contract: ``create_backend(name, config)`` imports the backend lazily (so a
missing optional dependency only matters to whoever selects it) and returns
it behind its guard (a ``GuardedBackend``, tiers/l3/guard.py: counters,
breaker, never raising), whichever backend it is. ``StorageBackendName`` is
the one list of names (the connector config's ``hicache_storage_backend``
accepts exactly these).
``dynamic`` loads a third-party class as SGLang does: ``extra_config``
names ``module_path`` and ``class_name`` (``backend_name`` and
``interface_v1`` optional; see ``DynamicLoaderConfig``), with the loader
keys removed from ``extra_config`` and every other key passed through. A
``StorageBackend`` subclass is built as ``cls(config)``; a class written to
SGLang's ``HiCacheStorage`` interface (``get``, ``set``, ``exists``) as SGLang
builds it, behind tiers/l3/sglang_compat.py's adapter.
Errors are ``StorageConfigError`` naming the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal, get_args

from pydantic import ConfigDict, Field

from hicache.tiers.l3.base import (
    EXTRA_CONFIG,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    validate_extra,
)
from hicache.tiers.l3.guard import GuardedBackend, guarded
from hicache.tiers.l3.sglang_compat import SGLANG_METHODS, SGLangStorage, is_sglang_storage
from hicache.tiers.settings import Settings

StorageBackendName = Literal["file", "mooncake", "nixl", "lmcache", "dynamic"]
STORAGE_BACKENDS: tuple[str, ...] = get_args(StorageBackendName)
BACKENDS: dict[str, str] = {
    "file": "hicache.tiers.l3.file.backend:FileBackend",
    "mooncake": "hicache.tiers.l3.mooncake.backend:MooncakeBackend",
    "nixl": "hicache.tiers.l3.nixl.backend:NixlBackend",
    "lmcache": "hicache.tiers.l3.lmcache.backend:LMCacheBackend",
}


class DynamicLoaderConfig(Settings):
    """The ``dynamic`` backend's loader keys; every other key goes to the loaded class."""

    model_config = ConfigDict(extra="allow")

    module_path: str = Field(min_length=1, description="importable module holding the class")
    class_name: str = Field(
        min_length=1, description="in module_path: a StorageBackend subclass, or a class "
        "with SGLang's HiCacheStorage methods (get, set, exists)")
    backend_name: str | None = Field(None, description="a name for logs (SGLang's key)")
    interface_v1: bool | int | None = Field(
        None, description="SGLang's flag for its zero-copy batch calls; accepted and "
        "ignored (HiCache backends always read into pool slots)")


LOADER_KEYS: tuple[str, ...] = tuple(DynamicLoaderConfig.model_fields)


def create_backend(name: str, config: StorageConfig) -> GuardedBackend:
    if name == "dynamic":
        return _dynamic(config)
    if name not in BACKENDS:
        raise StorageConfigError(
            f"hicache_storage_backend={name!r} is not supported; allowed values: "
            f"{list(STORAGE_BACKENDS)}"
        )
    module_name, class_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return guarded(cls(config))


def _dynamic(config: StorageConfig) -> GuardedBackend:
    loader = validate_extra(config.extra_config, DynamicLoaderConfig, "dynamic")
    try:
        module = importlib.import_module(loader.module_path)
    except ImportError as exc:
        raise StorageConfigError(
            f"{EXTRA_CONFIG}.module_path={loader.module_path!r} "
            f"cannot be imported: {exc}"
        ) from exc
    cls = getattr(module, loader.class_name, None)
    config = dataclasses.replace(config, extra_config=dict(loader.model_extra or {}))
    if isinstance(cls, type) and issubclass(cls, StorageBackend):
        return guarded(cls(config))
    if isinstance(cls, type) and is_sglang_storage(cls):
        return guarded(SGLangStorage.build(cls, config))
    raise StorageConfigError(
        f"{EXTRA_CONFIG}.class_name={loader.class_name!r} is neither a StorageBackend "
        f"subclass nor a class with SGLang's HiCacheStorage methods "
        f"{list(SGLANG_METHODS)} in {loader.module_path!r}"
    )
