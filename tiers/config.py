"""HiCache configuration: parse and validate ``kv_connector_extra_config``.

Contract: ``HiCacheConfig.from_extra_config(dict)`` either returns a frozen,
fully validated config (a pydantic model: strict types, unknown keys
rejected) or raises ``HiCacheConfigError`` whose message names the
offending key, what it allows and the bad value. Each field's type is the
one statement of what it accepts: the policy, layout, io-backend and
storage-backend names are ``Literal`` types defined where they are
implemented. Names follow SGLang's server flags where the concept is shared
(``--hicache-ratio`` -> ``hicache_ratio``). Keys of features that are not
implemented yet are rejected as unknown rather than silently ignored. The
admin token is a ``SecretStr``: it shows in no repr, log or ``to_dict``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    SecretStr,
    ValidationError,
    field_validator,
)

from hicache.kernels.io_backend import IoBackendName
from hicache.tiers.controller.policies import (
    EvictionPolicyName,
    L3AdmissionName,
    PrefetchPolicyName,
    PrefetchSettings,
    WritePolicyName,
)
from hicache.tiers.index.kv_groups import KVGroups
from hicache.tiers.l2.geometry import MemLayoutName
from hicache.tiers.l3.factory import StorageBackendName
from hicache.tiers.settings import Settings, explain
from hicache.tiers.worker.helper_cpus import check_setting

# vLLM's kv_transfer_config.kv_load_failure_policy values.
LoadFailurePolicyName = Literal["recompute", "fail"]


class HiCacheConfigError(ValueError):
    """A ``kv_connector_extra_config`` entry is unknown or has a bad value."""


class StorageExtraConfig(PrefetchSettings):
    """``hicache_storage_backend_extra_config``: HiCache's own prefetch keys
    (tiers/controller/policies.py) and ``object_mib``; every other key goes to the
    storage backend."""

    model_config = ConfigDict(extra="allow")

    object_mib: NonNegativeFloat = Field(
        1.0, description="MiB an L3 object may hold: runs of pages of a request are "
        "stored as one object of up to this size where the backend can (file); 0 = one "
        "object per page")


# Keys of hicache_storage_backend_extra_config that HiCache consumes, with their defaults.
PREFETCH_KEYS: dict[str, float] = {
    name: field.default for name, field in StorageExtraConfig.model_fields.items()
}
NonEmptyStr = Annotated[str, Field(min_length=1)]


class HiCacheConfig(Settings):
    """Effective HiCache settings; one field per accepted extra-config key."""

    page_size: PositiveInt | None = Field(
        None, description="tokens per cached page, a multiple of vLLM's block size; "
        "null = the block size")
    hicache_ratio: float = Field(
        2.0, gt=0, description="L2 host pool size as a multiple of the L1 (vLLM KV cache) "
        "size; used when hicache_size is 0")
    hicache_size: float = Field(
        0.0, ge=0, description="L2 host pool size in GB (1e9 bytes) per TP rank; "
        "0 = use hicache_ratio")
    # write_through copies every full page as soon as its KV is computed;
    # write_through_selective once hicache_write_through_threshold requests have
    # computed it; write_back when its request finishes (its blocks become
    # evictable in vLLM's cache).
    hicache_write_policy: WritePolicyName = Field(
        "write_through", description="when pages are copied L1 -> L2")
    hicache_write_through_threshold: PositiveInt = Field(
        2, description="requests that must compute a page before write_through_selective "
        "keeps it")
    # all: every page L2 stores is backed up to L3; reused: a page once a second
    # request uses it (recomputes it, or finds it in L2), and every page of a request
    # with retain_s. The default is the trace replays' choice (docs/benchmarks-trace.md,
    # "Back up what will return").
    hicache_l3_admission: L3AdmissionName = Field(
        "all", description="which pages L2 stores are backed up to L3")
    # Pages L2 holds and L3 lacks (L3 flushed or attached at run time, a failed
    # backup) are backed up in the background, hottest first, while the workers'
    # L3 I/O is idle (tiers/controller/catch_up.py).
    hicache_l3_catch_up_pages: NonNegativeInt = Field(
        64, description="pages L2 holds and L3 lacks that may be queued for backup at "
        "once, while L3 I/O is idle; 0 = back up only what L2 newly stores")
    # lru: leaf-first LRU within the priority classes; tlru: within a class, each
    # conversation's last hicache_tlru_tail_tokens first (tiers/controller/policies.py).
    hicache_eviction_policy: EvictionPolicyName = Field(
        "lru", description="which L2 pages make room: lru, or tlru (each conversation's "
        "tail first, whose loss a returning turn recomputes within its TTFT budget)")
    hicache_tlru_tail_tokens: PositiveInt = Field(
        2048, description="tlru: tokens at the end of a conversation it evicts first (about "
        "what a returning turn may recompute on top of its new tokens within its TTFT "
        "budget)")
    # SGLang's current default is page_first.
    hicache_mem_layout: MemLayoutName = Field(
        "page_first", description="byte layout of the L2 host pool")
    # kernel = one GPU copy kernel over many pages and layers; direct = one slice
    # copy per contiguous run and layer. On CPU both resolve to the direct path.
    # Default direct until the GPU kernel ships (SGLang's default is kernel).
    hicache_io_backend: IoBackendName = Field(
        "direct", description="how bytes move between L1 and L2")
    # recompute: a cache miss costs time, never correctness.
    hicache_load_failure_policy: LoadFailurePolicyName = Field(
        "recompute", description="what vLLM does when a load fails (sets vLLM's "
        "kv_transfer_config.kv_load_failure_policy)")
    hicache_storage_backend: StorageBackendName | None = Field(
        None, description="the L3 store; null = no L3")
    hicache_storage_backend_extra_config: StorageExtraConfig = Field(
        default_factory=StorageExtraConfig,
        description="backend settings (a JSON object or its string) plus HiCache's "
        "prefetch_threshold (tokens) and prefetch_timeout_{base,per_ki_token,max} (s)")
    # How long a request waits for its L3 pages: best_effort = not at all (what
    # is in L2 when it is scheduled; a fetch at admission: what arrived by the
    # next engine step); wait_complete = until all arrived; timeout = up to
    # min(max, base + per_ki_token * tokens / 1024) seconds.
    hicache_storage_prefetch_policy: PrefetchPolicyName = Field(
        "timeout", description="how long a request waits for its L3 pages")
    hicache_retain_max_share: float = Field(
        0.5, gt=0, le=1, description="share of the L2 pool that pinned pages (a request's "
        "retain_s, the admin's POST /pin) may hold")
    # A request's L3 pages are read into L2 while it waits in vLLM's queue
    # (tiers/controller/prefetches.py); off = only once vLLM admits it.
    hicache_prefetch_at_arrival: bool = Field(
        True, description="prefetch a new request's L3 pages into L2 while it waits "
        "to be scheduled")
    # A step's L1 -> L2 stores finish during later steps (tiers/worker/core.py);
    # false = each step waits for its own, which measured faster on a CPU
    # (the copy thread takes a core from the next forward pass; docs/concepts.md
    # "Stores across steps"); not yet measured on a GPU. Always off for
    # sliding-window and Mamba models, whose blocks change while a request runs.
    hicache_async_stores: bool = Field(
        False, description="let L1 -> L2 stores finish during later engine steps "
        "(full-attention models)")
    # Where the worker's L3 threads run (tiers/worker/helper_cpus.py).
    hicache_helper_cpus: str = Field(
        "auto", description="CPUs of HiCache's L3 and copy threads in each worker: 'auto' "
        "(on a CPU engine, cores no forward pass uses, else the forward pass's cores "
        "other than its forward thread's, backing up between passes; none on a GPU "
        "engine), 'inherit' (the forward thread's), or a CPU list such as '2-3,6'")
    hicache_admin_host: NonEmptyStr = Field(
        "127.0.0.1", description="address of the admin HTTP endpoint")
    hicache_admin_port: int = Field(
        8790, ge=0, le=65535, description="port of the admin HTTP endpoint in the "
        "scheduler process; 0 turns it off; engine core i (data parallel) listens on port + i")
    hicache_admin_token: Annotated[SecretStr, Field(min_length=1)] | None = Field(
        None, description="bearer token for the admin endpoint (else $HICACHE_ADMIN_TOKEN)")

    @field_validator("hicache_helper_cpus")
    @classmethod
    def _helper_cpus_known(cls, value: str) -> str:
        return check_setting(value)

    @field_validator("hicache_admin_host", mode="before")
    @classmethod
    def _null_host_is_default(cls, value: Any) -> Any:
        return cls.model_fields["hicache_admin_host"].default if value is None else value

    @field_validator("hicache_storage_backend_extra_config", mode="before")
    @classmethod
    def _json_string_is_an_object(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None

    @classmethod
    def allowed_keys(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> HiCacheConfig:
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise HiCacheConfigError(explain(
                exc, cls, unknown="kv_connector_extra_config key(s) for HiCacheConnector:",
            )) from None

    def prefetch_setting(self, key: str) -> float:
        """prefetch_threshold / prefetch_timeout_* with SGLang's defaults; object_mib."""
        return float(getattr(self.hicache_storage_backend_extra_config, key))

    def prefetch_settings(self) -> dict[str, float]:
        """Every key of ``PREFETCH_KEYS`` with its value (the scheduler's settings)."""
        return {key: self.prefetch_setting(key) for key in PREFETCH_KEYS}

    def backend_extra_config(self) -> dict[str, Any]:
        """The extra config the storage backend sees (HiCache's own keys removed)."""
        return dict(self.hicache_storage_backend_extra_config.model_extra or {})

    def check_groups(self, groups: KVGroups) -> None:
        """Refuse a setting this engine's KV-cache groups (kv_groups.py) cannot serve."""
        if groups.aligned and self.hicache_write_policy != "write_through":
            # vLLM hands a Mamba "align" state to a connector only in the step that
            # computes it (stores.py): write_back stores when the request ends, and
            # write_through_selective mostly when a later request hits vLLM's own
            # cache, both after the hand-off.
            raise HiCacheConfigError(
                f"hicache_write_policy {self.hicache_write_policy!r} would store the pages "
                f"of a model with Mamba layers in vLLM's 'align' cache mode (prefix caching "
                f"on) without their state checkpoints, so no request could load them; "
                f"allowed here: 'write_through' (or run with --no-enable-prefix-caching)")

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
        layout: str = self.hicache_mem_layout
        io: str = self.hicache_io_backend
        notes: list[str] = []
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
        """Every setting as given (plain JSON values); the admin token is never
        included, only whether one is set."""
        d = self.model_dump(exclude={"hicache_admin_token", "hicache_storage_backend_extra_config"})
        d["hicache_storage_backend_extra_config"] = \
            self.hicache_storage_backend_extra_config.model_dump(exclude_unset=True)
        d["hicache_admin_token"] = "<set>" if self.hicache_admin_token is not None else None
        return {name: d[name] for name in self.allowed_keys()}
