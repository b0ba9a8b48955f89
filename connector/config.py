"""HiCache configuration: parse and validate ``kv_connector_extra_config``.

Contract: ``HiCacheConfig.from_extra_config(dict)`` either returns a frozen,
fully validated config or raises ``HiCacheConfigError`` whose message names
the offending key and its allowed values. Names follow SGLang's server flags
where the concept is shared (``--hicache-ratio`` -> ``hicache_ratio``).
Keys of features that are not implemented yet are rejected as unknown rather
than silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
STORAGE_BACKENDS = ("file", "mooncake", "nixl", "dynamic")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Keys of hicache_storage_backend_extra_config that HiCache itself consumes
# (SGLang's names and defaults, v0.5.12); the rest goes to the backend.
PREFETCH_KEYS: dict[str, float] = {
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 2.0,
    "prefetch_timeout_per_ki_token": 0.1,
    "prefetch_timeout_max": 30.0,
}


class HiCacheConfigError(ValueError):
    """A ``kv_connector_extra_config`` entry is unknown or has a bad value."""


@dataclass(frozen=True)
class HiCacheConfig:
    """Effective HiCache settings; one field per accepted extra-config key."""

    # Tokens per cached page; a multiple of vLLM's block size. None = block size.
    page_size: int | None = None
    # L2 host pool size as a multiple of the L1 (vLLM KV cache) size; used
    # when hicache_size is 0.
    hicache_ratio: float = 2.0
    # L2 host pool size in GB (1e9 bytes) per TP rank; 0 = use hicache_ratio.
    hicache_size: float = 0.0
    # When pages are copied L1 -> L2: write_through copies every full page as
    # soon as its KV is computed; write_through_selective once
    # hicache_write_through_threshold requests have computed it; write_back
    # when its request finishes (its blocks become evictable in vLLM's cache).
    hicache_write_policy: str = "write_through"
    # Requests that must compute a page before write_through_selective keeps it.
    hicache_write_through_threshold: int = 2
    # Byte layout of the L2 host pool (see tiers/l2/host_pool.py): layer_first,
    # page_first or page_first_direct; SGLang's current default is page_first.
    hicache_mem_layout: str = "page_first"
    # How bytes move between L1 and L2: kernel = one GPU copy kernel over many
    # pages and layers; direct = one slice copy per contiguous run and layer.
    # On CPU both resolve to the direct path. Default direct until the GPU
    # kernel ships (SGLang's default is kernel).
    hicache_io_backend: str = "direct"
    # What vLLM does when a load fails: recompute the affected tokens
    # (default; a cache miss costs time, never correctness) or fail the request.
    # Sets vLLM's kv_transfer_config.kv_load_failure_policy.
    hicache_load_failure_policy: str = "recompute"
    # L3: file | mooncake | nixl | dynamic; None = no L3.
    hicache_storage_backend: str | None = None
    # Backend settings (a JSON object or its string), plus HiCache's own
    # prefetch_threshold (tokens) and prefetch_timeout_{base,per_ki_token,max} (s).
    hicache_storage_backend_extra_config: dict[str, Any] = field(default_factory=dict)
    # How long a request waits for its L3 pages: best_effort = what arrived
    # by the next engine step; wait_complete = all of them; timeout = until
    # min(max, base + per_ki_token * tokens / 1024) seconds.
    hicache_storage_prefetch_policy: str = "timeout"
    # Admin HTTP endpoint in the scheduler process (0 = off). With several
    # engine cores (data parallel) core i listens on port + i.
    hicache_admin_host: str = "127.0.0.1"
    hicache_admin_port: int = 8790
    # Bearer token for the admin endpoint (else $HICACHE_ADMIN_TOKEN).
    hicache_admin_token: str | None = None

    @classmethod
    def allowed_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.allowed_keys()))
        if unknown:
            raise HiCacheConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for HiCacheConnector; "
                f"allowed keys: {sorted(cls.allowed_keys())}"
            )
        values: dict[str, Any] = {}
        if extra.get("page_size") is not None:
            values["page_size"] = _positive_int(extra, "page_size")
        if "hicache_write_through_threshold" in extra:
            values["hicache_write_through_threshold"] = _positive_int(
                extra, "hicache_write_through_threshold"
            )
        for key in ("hicache_ratio", "hicache_size"):
            if key in extra:
                values[key] = _number(extra, key)
        if values.get("hicache_ratio", 1.0) <= 0:
            raise HiCacheConfigError(
                f"hicache_ratio must be > 0 (got {values['hicache_ratio']!r})"
            )
        if values.get("hicache_size", 0.0) < 0:
            raise HiCacheConfigError(
                f"hicache_size must be >= 0 GB; 0 means 'use hicache_ratio' "
                f"(got {values['hicache_size']!r})"
            )
        for key, allowed in (
            ("hicache_write_policy", WRITE_POLICIES),
            ("hicache_mem_layout", MEM_LAYOUTS),
            ("hicache_io_backend", IO_BACKENDS),
            ("hicache_load_failure_policy", LOAD_FAILURE_POLICIES),
            ("hicache_storage_prefetch_policy", PREFETCH_POLICIES),
        ):
            if key in extra:
                values[key] = _choice(extra, key, allowed)
        if extra.get("hicache_storage_backend") is not None:
            values["hicache_storage_backend"] = _choice(
                extra, "hicache_storage_backend", STORAGE_BACKENDS
            )
        if "hicache_admin_port" in extra:
            port = extra["hicache_admin_port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise HiCacheConfigError(
                    f"hicache_admin_port must be an integer in [0, 65535]; 0 turns the admin "
                    f"endpoint off (got {port!r})"
                )
            values["hicache_admin_port"] = port
        for key in ("hicache_admin_host", "hicache_admin_token"):
            if extra.get(key) is not None:
                if not isinstance(extra[key], str) or not extra[key]:
                    raise HiCacheConfigError(f"{key} must be a non-empty string (got {extra[key]!r})")
                values[key] = extra[key]
        if "hicache_storage_backend_extra_config" in extra:
            values["hicache_storage_backend_extra_config"] = _storage_extra(
                extra["hicache_storage_backend_extra_config"]
            )
        return cls(**values)

    def prefetch_setting(self, key: str) -> float:
        """prefetch_threshold / prefetch_timeout_* with SGLang's defaults."""
        return float(self.hicache_storage_backend_extra_config.get(key, PREFETCH_KEYS[key]))

    def backend_extra_config(self) -> dict[str, Any]:
        """The extra config the storage backend sees (HiCache's own keys removed)."""
        return {k: v for k, v in self.hicache_storage_backend_extra_config.items()
                if k not in PREFETCH_KEYS}

    def resolved_page_size(self, block_size: int) -> int:
        """Page size in tokens for an engine whose KV block holds ``block_size`` tokens."""
        page_size = self.page_size or block_size
        if page_size % block_size:
            raise HiCacheConfigError(
                f"page_size must be a multiple of vLLM's block size {block_size} "
                f"(got page_size={page_size}); allowed: {block_size}, {2 * block_size}, "
                f"{4 * block_size}, ..."
            )
        return page_size

    def resolved_data_plane(self, *, cuda: bool) -> tuple[str, str, list[str]]:
        """(layout, io backend, notes) after SGLang's compatibility rules.

        - kernel IO needs a GPU: on CPU it becomes direct (same best CPU path).
        - page_first + direct on a GPU -> page_first_direct (SGLang's rule: a
          page_first page is one tiny fragment per block and layer for
          cudaMemcpyAsync). On CPU, page_first stays: slice copies handle its
          strides as well as anything would.
        - page_first_direct + kernel -> direct (SGLang v0.5.12's rule).
        """
        layout, io, notes = self.hicache_mem_layout, self.hicache_io_backend, []
        if io == "kernel" and not cuda:
            io = "direct"
            notes.append("hicache_io_backend=kernel needs CUDA; using direct copies on CPU")
        if layout == "page_first" and io == "direct" and cuda:
            layout = "page_first_direct"
            notes.append("hicache_mem_layout=page_first with direct IO -> page_first_direct")
        if layout == "page_first_direct" and io == "kernel":
            io = "direct"
            notes.append("hicache_mem_layout=page_first_direct -> hicache_io_backend=direct")
        return layout, io, notes

    def to_dict(self) -> dict[str, Any]:
        """Every setting; the admin token is never included (only whether one is set)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hicache_admin_token"] = "<set>" if self.hicache_admin_token else None
        return d


def _storage_extra(value: Any) -> dict[str, Any]:
    key = "hicache_storage_backend_extra_config"
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise HiCacheConfigError(f"{key} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise HiCacheConfigError(f"{key} must be a JSON object (got {value!r})")
    for name in PREFETCH_KEYS:
        if name in value:
            number = value[name]
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0:
                raise HiCacheConfigError(
                    f"{key}.{name} must be a number >= 0 (got {number!r})"
                )
    return dict(value)


def _positive_int(extra: dict[str, Any], key: str) -> int:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HiCacheConfigError(f"{key} must be a positive integer (got {value!r})")
    return value


def _number(extra: dict[str, Any], key: str) -> float:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HiCacheConfigError(f"{key} must be a number (got {value!r})")
    return float(value)


def _choice(extra: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = extra[key]
    if value not in allowed:
        raise HiCacheConfigError(
            f"{key}={value!r} is not supported; allowed values: {list(allowed)}"
        )
    return value
