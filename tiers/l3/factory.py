"""Build an L3 backend by name: ``file``, ``mooncake``, ``nixl`` or ``dynamic``.

Contract: ``create_backend(name, config)`` imports the backend lazily (so a
missing optional dependency only matters to whoever selects it) and returns
a ``StorageBackend``. ``dynamic`` loads a third-party class as SGLang does:
``extra_config`` names ``module_path`` and ``class_name`` (``backend_name``
optional, for logs); the class must subclass ``StorageBackend`` and is built
as ``cls(config)`` with those loader keys removed from ``extra_config``. Errors are ``StorageConfigError`` naming the key and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import importlib

from hicache.tiers.l3.base import StorageBackend, StorageConfig, StorageConfigError

BACKENDS: dict[str, str] = {
    "file": "hicache.tiers.l3.file_backend:FileBackend",
    "mooncake": "hicache.tiers.l3.mooncake_backend:MooncakeBackend",
    "nixl": "hicache.tiers.l3.nixl_backend:NixlBackend",
}
STORAGE_BACKENDS = (*BACKENDS, "dynamic")
LOADER_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


def create_backend(name: str, config: StorageConfig) -> StorageBackend:
    if name == "dynamic":
        return _dynamic(config)
    if name not in BACKENDS:
        raise StorageConfigError(
            f"hicache_storage_backend={name!r} is not supported; allowed values: "
            f"{list(STORAGE_BACKENDS)}"
        )
    module_name, class_name = BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config)


def _dynamic(config: StorageConfig) -> StorageBackend:
    extra = dict(config.extra_config)
    missing = [k for k in ("module_path", "class_name") if not extra.get(k)]
    if missing:
        raise StorageConfigError(
            f"hicache_storage_backend='dynamic' needs hicache_storage_backend_extra_config "
            f"keys {missing} (module_path: importable module, class_name: a StorageBackend "
            "subclass in it)"
        )
    try:
        module = importlib.import_module(extra["module_path"])
    except ImportError as exc:
        raise StorageConfigError(
            f"hicache_storage_backend_extra_config.module_path={extra['module_path']!r} "
            f"cannot be imported: {exc}"
        ) from exc
    cls = getattr(module, extra["class_name"], None)
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise StorageConfigError(
            f"hicache_storage_backend_extra_config.class_name={extra['class_name']!r} is not "
            f"a StorageBackend subclass in {extra['module_path']!r}"
        )
    rest = {k: v for k, v in extra.items() if k not in LOADER_KEYS}
    return cls(dataclasses.replace(config, extra_config=rest))
