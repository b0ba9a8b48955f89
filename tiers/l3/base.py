"""The L3 storage backend interface (SGLang ``HiCacheStorage``-compatible) and its config.

Contract:
- One backend instance per process that uses it: each worker (TP rank) has
  one with its host pool registered (zero-copy ``batch_get_v1`` /
  ``batch_set_v1`` address pool slots); the scheduler has one without a pool
  and only asks ``batch_exists``. Instances in different processes, engines
  or machines sharing one store must see each other's pages.
- Keys passed in are page keys as 64-char hex strings (SGLang passes hash
  strings the same way). A backend stores each page under
  ``object_key(key)``, which appends ``StorageConfig.fingerprint``: pages of
  another model, dtype, host byte order, page size or TP rank never alias.
- Every stored page carries the header of ``integrity.py`` and every read
  verifies it: a page whose key, fingerprint, length or checksum does not
  match is a miss, reported with ``report.corrupt`` (and removed or
  quarantined where the backend can). A read never returns True for bytes
  it has not verified.
- ``batch_exists`` returns how many keys exist consecutively from the start.
  Existence is a hint (a page may vanish before it is read); reads decide.
- Writes skip keys that already exist (cross-instance dedup). A successful
  ``set`` is not proof of residency (stores may evict).
- Methods never raise for an unavailable or failing store: they return
  False / 0 and report the failure (``report.failed``; ``down=True`` when the
  store stopped answering). Counters, the breaker and the never-raise rule for
  backends that do raise live in the guard every backend runs behind
  (tiers/l3/guard.py, tiers/l3/report.py); a backend keeps none. A backend
  whose store can go away offers ``answers()``, the breaker's probe.
  ``__init__`` raises ``StorageConfigError``
  for bad configuration (message names the key and the allowed values) and
  ``StorageUnavailable`` when the store cannot be reached at start. A
  backend's extra config is a ``Settings`` model next to it, read with
  ``validate_extra``.
- Span objects (optional, ``supports_spans``): a run of pages in one object
  under a span key (tiers/index/spans.py), each page's record verified on
  its own; existence and deletion of a span object go through the same
  ``batch_exists`` / ``delete`` as pages (a span key is a key).
- ``retain(keys, until)`` asks a backend to keep pages ahead of its own
  eviction until a deadline; a backend that cannot returns 0 (the default).
- Thread-safety: a worker calls one backend from one I/O thread; the
  scheduler from its own thread. Backends need not be re-entrant.
"""

from __future__ import annotations

import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

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


class StorageBackend(ABC):
    """Base class of every L3 backend; subclasses implement get / set / exists."""

    # True when ``batch_exists`` may run on several threads at once, beside the
    # worker's reads and writes: the scheduler then looks pages up in the
    # background (tiers/controller/probes.py). False keeps lookups on vLLM's
    # scheduling thread, one at a time.
    concurrent_lookups: ClassVar[bool] = False
    # True when several ``batch_get_v1`` calls may run at once (into distinct
    # slots): the worker then reads fetches on a few threads
    # (tiers/worker/l3_io.py ``FETCH_THREADS``). False: one at a time.
    concurrent_io: ClassVar[bool] = False
    # True when ``batch_set_v1`` takes the checksums the store path left with the
    # pool's slots (host_pool.py ``checksums_of``) instead of a pass of its own:
    # the worker then computes them on its copy thread right after each store.
    # False where the write hashes as it copies anyway (the file batch path).
    uses_pool_checksums: ClassVar[bool] = False

    @property
    def supports_spans(self) -> bool:
        """True when the backend stores runs of pages as one object (``batch_set_spans``
        / ``batch_get_spans``; tiers/index/spans.py): the scheduler then plans span
        objects of the ``object_mib`` setting. False (the default, and any third-party
        backend): one object per page."""
        return False

    def batch_set_spans(self, keys: list[str], host_slots: list[int],
                        spans: list[SpanRef]) -> list[bool]:
        """Store pages from pool slots as span objects: ``spans[i]`` is page ``i``'s
        place; the pages of one object come in order, all of them (index 0 to count
        - 1). Each page's record carries its own header (key, fingerprint, checksum).
        An object that exists already is kept (True). False per page not stored (the
        caller stores those as page objects). Only called where ``supports_spans``."""
        raise NotImplementedError

    def batch_get_spans(self, keys: list[str], host_slots: list[int], spans: list[SpanRef],
                        deadline: float | None = None) -> list[bool]:
        """Read pages from their span objects into pool slots, each record verified on
        its own: a bad record is a miss for its page only (counted corrupt), a missing
        object a plain miss. ``deadline`` as ``batch_get_until``. Only called where
        ``supports_spans``."""
        raise NotImplementedError

    @property
    def timed_batches(self) -> bool:
        """True when the backend has ``batch_get_until(keys, host_slots, deadline)``:
        ``batch_get_v1`` that starts no page once ``deadline`` (``time.monotonic()``
        seconds) has passed (those pages are False, not misses). The worker then hands
        over large batches, one GIL hand-off each, without losing the fetch's deadline
        (tiers/worker/l3_io.py). Backends whose batches run without the GIL offer it
        (file: tiers/l3/native_io.py)."""
        return False

    def batch_get_until(self, keys: list[str], host_slots: list[int],
                        deadline: float | None) -> list[bool]:
        """See ``timed_batches``; only called where that is True."""
        raise NotImplementedError

    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.pool: HostPagePool | None = None
        # what this backend tells its guard (tiers/l3/guard.py binds it); detached,
        # it keeps nothing
        self.report = Report()

    # ---- keys ---------------------------------------------------------------

    def object_key(self, key: str) -> str:
        """Name of ``key``'s page object in the store."""
        return f"{key}_{self.config.key_suffix}"

    @staticmethod
    def page_key_bytes(key: str) -> bytes:
        return bytes.fromhex(key)

    # ---- host pool ----------------------------------------------------------

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
            raise RuntimeError("batch_get_v1/batch_set_v1 need register_host_pool first")
        return self.pool

    # ---- single pages (SGLang: get / set / exists) ---------------------------

    @abstractmethod
    def get(self, key: str, target: torch.Tensor) -> bool:
        """Read page ``key`` into ``target`` (1-D uint8 CPU tensor of page_bytes), verified."""

    @abstractmethod
    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` (1-D uint8 CPU tensor of page_bytes) as page ``key``."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether page ``key`` is (probably) stored."""

    # ---- batches --------------------------------------------------------------

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        return [self.set(k, v) for k, v in zip(keys, values, strict=True)]

    def batch_exists(self, keys: list[str]) -> int:
        """Number of keys that exist consecutively from the first."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        """Read pages straight into host pool slots; False per page not loaded.

        Default: through ``get`` on the slot's contiguous page view, or a
        staging page for layouts whose slots are not contiguous.
        """
        pool = self._require_pool()
        results = []
        for key, slot in zip(keys, host_slots, strict=True):
            view = pool.page_view(slot)
            if view is not None:
                results.append(self.get(key, view))
                continue
            staging = torch.empty(pool.geometry.page_bytes, dtype=torch.uint8)
            ok = self.get(key, staging)
            if ok:
                pool.write_page(slot, staging)
            results.append(ok)
        return results

    def batch_set_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        """Store pages straight from host pool slots; False per page not stored."""
        pool = self._require_pool()
        values = [pool.read_page(slot) for slot in host_slots]
        return self.batch_set(keys, values)

    # ---- maintenance ----------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove page ``key`` (this rank's object); True if it was there.

        Used to flush a prefix. Not part of SGLang's interface: a third-party
        backend without it makes prefix flushes of L3 fail with a clear error.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot delete single pages")

    def batch_delete(self, keys: list[str]) -> int:
        """Remove these pages; returns how many were there."""
        return sum(1 for key in keys if self.delete(key))

    def retain(self, keys: list[str], until: float) -> int:
        """Keep these pages (stored now or later) ahead of this backend's own eviction
        until ``until`` (seconds since the epoch; 0 ends it); how many it took on. A
        request's ``retain_s`` and the admin's pins reach L3 this way. Default: 0, the
        backend keeps nothing on request (Mooncake, NIXL, LMCache evict on their own)."""
        return 0

    def clear(self) -> None:
        """Remove every page this backend can see (all namespaces it owns)."""
        return None

    def stats(self) -> StorageStats:
        """This instance's counters: kept by the guard (``GuardedBackend.stats``); a
        backend used without one has none (all zero)."""
        return StorageStats()

    @property
    def reachable(self) -> bool:
        """False while calls fail fast: the guard's breaker is open
        (``GuardedBackend.reachable``); a backend used without one has no breaker."""
        return True

    def answers(self) -> bool:
        """Whether the store answers now: the guard's breaker probe, called every half
        second while the breaker is open. Override it where a store can go away (the
        default, kept, means "no probe": the guard then calls the backend every time)."""
        return True

    def close(self) -> None:
        """Release connections and registrations; the instance is unusable after."""
        return None
