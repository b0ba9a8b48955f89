"""The L3 storage backend contract: one narrow batch interface, its capabilities and config.

Contract:
- One backend instance per process that uses it: each worker (TP rank) has
  one with its host pool registered (reads and writes address pool slots);
  the scheduler has one without a pool and only asks ``exists_prefix``.
  Instances in different processes, engines or machines sharing one store
  must see each other's pages.
- Seven verbs, all batches: ``read(ReadBatch)`` and ``write(WriteBatch)``
  (a list of bools, one per page), ``exists_prefix(keys)`` (how many keys
  exist consecutively from the first), ``delete(keys)`` (how many were
  there) and ``clear()``, ``retain(keys, until)``, ``answers()`` (the
  breaker's probe) and ``close()``. What a backend can do beyond them is one
  frozen ``Capabilities`` record, ``capabilities``, set by its constructor.
- Keys are page keys as 64-char hex strings (SGLang passes hash strings the
  same way). A backend stores each page under ``object_key(key)``, which
  appends ``StorageConfig.fingerprint``: pages of another model, dtype, host
  byte order, page size or TP rank never alias.
- Every stored page carries the header of ``integrity.py`` and every read
  verifies it: a page whose key, fingerprint, length or checksum does not
  match is a miss, reported with ``report.corrupt`` (and removed or
  quarantined where the backend can). A read never returns True for bytes
  it has not verified.
- Existence is a hint (a page may vanish before it is read); reads decide.
  Writes skip keys that already exist (cross-instance dedup, reported with
  ``report.skipped``). A successful write is not proof of residency.
- A backend may raise for a failing store; every backend runs behind its
  guard (tiers/l3/guard.py), the one place that turns such an exception into
  a miss, counts the calls and runs the breaker. A backend keeps no
  counters; it tells its guard what the results do not say on ``report``
  (tiers/l3/report.py). ``__init__`` raises ``StorageConfigError`` for bad
  configuration (the message names the key and the allowed values) and
  ``StorageUnavailable`` when the store cannot be reached at start. A
  backend's extra config is a ``Settings`` model next to it, read with
  ``validate_extra``.
- Span objects (``capabilities.spans``): a run of pages in one object under a
  span key (tiers/index/spans.py), each page's record verified on its own. A
  batch with ``spans`` reads or writes every page through its span object;
  existence and deletion of a span object go through ``exists_prefix`` and
  ``delete`` like a page's (a span key is a key).
- Thread-safety: a worker calls one backend from its I/O thread (and, where
  ``capabilities.concurrent_io``, from a few fetch helpers at once); the
  scheduler from its own thread (several at once where
  ``capabilities.concurrent_lookups``). Backends need not be re-entrant
  otherwise.
- A class written to SGLang's ``HiCacheStorage`` interface (``get``, ``set``,
  ``exists``...) is not a backend; the ``dynamic`` loader wraps it
  (tiers/l3/sglang_compat.py).
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch
from pydantic import ValidationError

from hicache.tiers.index.spans import SpanRef
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.report import Report
from hicache.tiers.settings import Settings, explain

# Bytes of a page in L3 follow the host pool's slot order; layouts whose
# slots hold the same order share L3 pages.
BYTE_ORDER = {"layer_first": "LBB", "page_first": "BLB", "page_first_direct": "LBB"}
# The connector config key whose value (less HiCache's own keys) a backend sees.
EXTRA_CONFIG = "hicache_storage_backend_extra_config"
SettingsT = TypeVar("SettingsT", bound=Settings)


class StorageConfigError(ValueError):
    """hicache_storage_backend or its extra config is invalid."""


class StorageUnavailable(RuntimeError):
    """The store could not be reached or set up."""


def validate_extra(extra: Mapping[str, Any], model: type[SettingsT], backend: str) -> SettingsT:
    """A backend's extra config (``StorageConfig.extra_config``) validated by ``model``.

    Raises StorageConfigError naming each bad key as
    ``hicache_storage_backend_extra_config.<key>`` with what it allows.
    """
    try:
        return model.model_validate(dict(extra))
    except ValidationError as exc:
        raise StorageConfigError(explain(
            exc, model, prefix=f"{EXTRA_CONFIG}.",
            unknown=f"{EXTRA_CONFIG} key(s) for the {backend} backend:",
        )) from None


@dataclass(frozen=True)
class StorageConfig:
    """What a backend needs to know about the engine (SGLang's HiCacheStorageConfig)."""

    tp_rank: int
    tp_size: int
    # namespace fingerprint (model, KV dtype, vLLM layout, page size, TP size)
    namespace: str
    # host pool layout: layer_first | page_first | page_first_direct
    mem_layout: str
    page_bytes: int
    # MLA: the latent pages are the same on every rank, so the fingerprint
    # (hence the object key) leaves the rank out: one shard shared by all.
    is_mla: bool = False
    model_name: str = ""
    # hicache_storage_backend_extra_config minus the keys HiCache consumes
    extra_config: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """16 bytes naming everything that must match for a stored page to be usable."""
        h = hashlib.sha256(b"hicache-l3-v1")
        # MLA pages are identical on every rank: one shard, shared by all ranks.
        rank = "mla" if self.is_mla else str(self.tp_rank)
        for part in (self.namespace, BYTE_ORDER.get(self.mem_layout, self.mem_layout),
                     str(self.page_bytes), rank, str(self.tp_size)):
            h.update(len(part).to_bytes(4, "little") + part.encode())
        return h.digest()[:16]

    @functools.cached_property
    def key_suffix(self) -> str:
        return self.fingerprint.hex()[:16]


@dataclass
class StorageStats:
    """Counters of one backend instance, kept by its guard (pages are whole pages)."""

    get_pages: int = 0
    get_hits: int = 0
    get_misses: int = 0
    corrupt_pages: int = 0
    set_pages: int = 0
    set_skipped_existing: int = 0
    set_failures: int = 0
    exists_queries: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    evicted_pages: int = 0
    # failures of the store (a call that raised, a failed transfer or RPC)
    errors: int = 0
    # calls the guard's open breaker answered at once, without the store
    refused_calls: int = 0
    # pages read straight from store memory this process holds (Mooncake: its own
    # segment), copied and checked in one pass instead of a transfer and a check
    pages_in_place: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the seven verbs (all False: a plain page store)."""

    # ``exists_prefix`` may run on several threads at once, beside the worker's reads
    # and writes: the scheduler then looks pages up in the background
    # (tiers/controller/probes.py). False keeps lookups on vLLM's scheduling thread.
    concurrent_lookups: bool = False
    # several ``read`` calls may run at once (into distinct slots): the worker then
    # reads fetches on a few threads (tiers/worker/l3_io.py ``FETCH_THREADS``).
    concurrent_io: bool = False
    # runs of pages as one object (``ReadBatch.spans`` / ``WriteBatch.spans``): the
    # scheduler then plans span objects of the ``object_mib`` setting.
    spans: bool = False
    # ``read`` honours ``ReadBatch.deadline`` page by page: the worker then hands
    # over large batches, one GIL hand-off each, without losing the fetch's deadline.
    timed: bool = False
    # ``write`` takes the checksums the store path left with the pool's slots
    # (host_pool.py ``checksums_of``) instead of a pass of its own: the worker then
    # computes them on its copy thread right after each store.
    pool_checksums: bool = False
    # ``answers()`` tells whether the store answers now: the guard runs a breaker with
    # it as the probe. False: no probe, the guard calls the backend every time.
    probe: bool = False


@dataclass(frozen=True)
class ReadBatch:
    """Pages to read into pool slots: ``keys[i]`` into ``slots[i]``."""

    keys: Sequence[str]
    slots: Sequence[int]
    # each page's place in its span object (only where ``capabilities.spans``)
    spans: Sequence[SpanRef] | None = None
    # ``time.monotonic()`` seconds after which no page is started: those pages are
    # False, neither hits nor misses (page by page where ``capabilities.timed``; the
    # guard checks it once before the call otherwise)
    deadline: float | None = None

    def __post_init__(self) -> None:
        _same_length(self.keys, self.slots, self.spans)


@dataclass(frozen=True)
class WriteBatch:
    """Pages to store from pool slots: ``slots[i]`` under ``keys[i]``."""

    keys: Sequence[str]
    slots: Sequence[int]
    # span objects to store the pages as (only where ``capabilities.spans``): the pages
    # of one object come in order, all of them; a page left False is stored by the
    # caller as a page object (not a failure)
    spans: Sequence[SpanRef] | None = None

    def __post_init__(self) -> None:
        _same_length(self.keys, self.slots, self.spans)


def _same_length(keys: Sequence[str], slots: Sequence[int],
                 spans: Sequence[SpanRef] | None) -> None:
    if len(keys) != len(slots) or (spans is not None and len(spans) != len(keys)):
        raise ValueError(f"a batch needs one slot (and span) per key: {len(keys)} keys, "
                         f"{len(slots)} slots, {'no' if spans is None else len(spans)} spans")


class StorageBackend(ABC):
    """Base class of every L3 backend: ``read``, ``write`` and ``exists_prefix`` to write."""

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.capabilities = Capabilities()
        self.pool: HostPagePool | None = None
        # what this backend tells its guard (tiers/l3/guard.py binds it); detached,
        # it keeps nothing
        self.report = Report()

    # ---- keys and the host pool ---------------------------------------------------------

    def object_key(self, key: str) -> str:
        """Name of ``key``'s page object in the store."""
        return f"{key}_{self.config.key_suffix}"

    @staticmethod
    def page_key_bytes(key: str) -> bytes:
        return bytes.fromhex(key)

    def register_host_pool(self, pool: HostPagePool) -> None:
        """Zero-copy backends register the pool's buffer with their transport here."""
        if pool.geometry.page_bytes != self.config.page_bytes:
            raise StorageConfigError(
                f"host pool pages are {pool.geometry.page_bytes} B, backend configured for "
                f"{self.config.page_bytes} B"
            )
        self.pool = pool

    def _require_pool(self) -> HostPagePool:
        if self.pool is None:
            raise RuntimeError("read/write need register_host_pool first")
        return self.pool

    def _read_staged(self, keys: Sequence[str], slots: Sequence[int], staging: torch.Tensor,
                     read_one: Callable[[str], bool]) -> list[bool]:
        """Pools whose slots are not contiguous (``layer_first``): each page read into
        ``staging`` by ``read_one(key)``, then copied into its slot."""
        pool = self._require_pool()
        results = []
        for key, slot in zip(keys, slots, strict=True):
            ok = read_one(key)
            if ok:
                pool.write_page(slot, staging)
            results.append(ok)
        return results

    # ---- the verbs ----------------------------------------------------------------------

    @abstractmethod
    def read(self, batch: ReadBatch) -> list[bool]:
        """Read and verify pages into pool slots; False per page not loaded."""

    @abstractmethod
    def write(self, batch: WriteBatch) -> list[bool]:
        """Store pages from pool slots (a page that exists already is kept: True);
        False per page not stored."""

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Number of keys that exist consecutively from the first."""

    def delete(self, keys: Sequence[str]) -> int:
        """Remove these pages (this rank's objects); how many were there. Used to flush a
        prefix; a backend without it makes prefix flushes of L3 fail with a clear error."""
        raise NotImplementedError(f"{type(self).__name__} cannot delete single pages")

    def clear(self) -> None:
        """Remove every page this backend can see (all namespaces it owns)."""
        raise NotImplementedError(f"{type(self).__name__} cannot clear its store")

    def retain(self, keys: Sequence[str], until: float) -> int:
        """Keep these pages (stored now or later) ahead of this backend's own eviction
        until ``until`` (seconds since the epoch; 0 ends it); how many it took on. A
        request's ``retain_s`` and the admin's pins reach L3 this way. Default: 0, the
        backend keeps nothing on request (Mooncake, NIXL, LMCache evict on their own)."""
        return 0

    def answers(self) -> bool:
        """Whether the store answers now: the breaker's probe where
        ``capabilities.probe``, called every half second while the breaker is open."""
        return True

    def close(self) -> None:
        """Release connections and registrations; the instance is unusable after."""
        return None
