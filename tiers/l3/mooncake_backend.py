"""L3 backend on a Mooncake Store cluster (``mooncake.store.MooncakeDistributedStore``).

Contract (on top of ``base.py``):
- Extra-config keys, SGLang's names (``MooncakeExtraConfig``; anything else is a
  ``StorageConfigError`` naming the key and the allowed keys); each falls back
  to the environment variable SGLang documents (``ENV_VARS``), then to a default:
    ``master_server_address``  ``MOONCAKE_MASTER``            required, "host:port"
    ``local_hostname``         ``MOONCAKE_LOCAL_HOSTNAME``    "localhost"
    ``metadata_server``        ``MOONCAKE_TE_META_DATA_SERVER`` "P2PHANDSHAKE"
    ``global_segment_size``    ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` "4gb" (int bytes or
                               "<n>[kb|mb|gb|tb]", binary units); each TP rank
                               contributes ``global_segment_size // tp_size``
    ``local_buffer_size``      (no env)                       "16mb"
    ``protocol``               ``MOONCAKE_PROTOCOL``          "tcp" (tcp | rdma)
    ``device_name``            ``MOONCAKE_DEVICE``            "" (auto); a JSON object
                               maps TP rank -> device, as SGLang allows
- One Mooncake client per instance, set up with a global segment of 0 bytes
  (this checks the master: unreachable -> ``StorageUnavailable``). The
  instance's share of the global segment is mounted when it first needs to
  write: at ``register_host_pool`` (workers) or at the first ``set``. The
  scheduler's instance, which only asks ``batch_exists``, contributes no
  memory.
- One object per page, named ``object_key(key)``: the 128-byte integrity
  header followed by the payload, written and read with Mooncake's
  multi-buffer batch calls (header from/into a registered header arena,
  payload straight from/into the registered host pool slot for page_first /
  page_first_direct); batches are split into calls of ``ARENA_PAGES`` pages.
  ``get`` / ``set`` on other tensors (layer_first through the base class) go
  through a registered one-object staging buffer. A write takes each slot's
  checksum from the pool where the store path computed it (host_pool.py),
  else computes it. Arenas and staging buffers
  are per calling thread, so I/O threads may share one instance. Every
  read checks the object size and ``integrity.verify``; a mismatch is a miss
  counted in ``corrupt_pages`` and the object is force-removed. The pool
  slot of a failed read holds garbage and is reported False.
- Writes ask ``batch_is_exist`` first and skip existing objects (counted in
  ``set_skipped_existing``; the page counts as stored). Mooncake may evict
  any object at any time; a successful set is not residency.
- Failures never raise from get / set / exists / batch_* / clear. Bounded
  time: a master that hangs is bounded by ``MC_RPC_TIMEOUT_MS`` (set to
  5000 ms here when the environment does not set it; Mooncake's default is
  30 s). A dead master costs Mooncake ~4.3 s per call (its RPC client pool
  retries the connect ~3 times, 1 s apart; not configurable in 0.3.13), so
  the first RPC failure (codes -900..-999) trips a breaker: every call then
  fails at once (counted in ``errors``) while a background thread probes the
  master every ``PROBE_INTERVAL_S`` and closes the breaker when it answers.
  So after a master dies, at most one call per instance takes up to ~4.5 s
  (or ``MC_RPC_TIMEOUT_MS``); the rest return within microseconds.
- ``MC_STORE_CLIENT_SETUP_RETRIES`` defaults to 2 here (Mooncake: 20, about
  90 s against a dead master) and ``__init__`` checks the master's TCP port
  first, so an unreachable master fails ``__init__`` within seconds. When the
  local hostname is loopback and ``MC_TCP_BIND_ADDRESS`` is unset, it is set
  to 127.0.0.1 so the client advertises loopback addresses.
- ``close`` unregisters buffers and closes the client (~1 s: Mooncake
  joins its threads). Mooncake's close blocks 10-20 s holding the GIL when
  the master is gone (it tries to unmount the segment), so with the breaker
  open or the master's port closed the client is abandoned instead (kept
  alive until process exit, never destroyed; the master reclaims its
  segment when the client's heartbeats stop). Mooncake's own exit handler
  then still joins that client's heartbeat thread, so such a process takes
  ~10 s longer to exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import BeforeValidator, Field, field_validator

from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import (
    EXTRA_CONFIG,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    StorageUnavailable,
    validate_extra,
)
from hicache.tiers.settings import Settings

logger = logging.getLogger(__name__)

HEADER = integrity.HEADER_BYTES
# extra-config key -> the environment variable SGLang documents as its fallback
ENV_VARS: dict[str, str] = {
    "master_server_address": "MOONCAKE_MASTER",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
}
DEFAULT_RPC_TIMEOUT_MS = "5000"
DEFAULT_SETUP_RETRIES = "2"
PROBE_INTERVAL_S = 0.5
# Header slots per multi-buffer batch call; larger batches are chunked.
ARENA_PAGES = 256
# Mooncake ErrorCode values this backend distinguishes.
RC_OBJECT_NOT_FOUND = -704
RC_BUFFER_OVERFLOW = -600
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
# Clients abandoned by close() while the master was unreachable: never destroyed.
_ABANDONED: list[Any] = []


def _is_rpc_failure(rc: int) -> bool:
    """Mooncake's RPC error codes (RPC_FAIL -900, timeouts, ...): the master is unreachable."""
    return -999 <= rc <= -900


def _to_bytes(value: Any) -> int:
    """Bytes from an int or a string like ``"4gb"`` / ``"512MB"`` / ``"1048576"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", value.lower())
        if m:
            return int(m.group(1)) * _UNITS[m.group(2)]
    raise ValueError("not a size; allowed values: a non-negative int of bytes or a string "
                     "like '4gb', '512mb', '64kb'")


def parse_size(key: str, value: Any) -> int:
    """``_to_bytes`` for extra-config ``key``; StorageConfigError naming it if not a size."""
    try:
        return _to_bytes(value)
    except ValueError as exc:
        raise StorageConfigError(f"{EXTRA_CONFIG}.{key}={value!r}: {exc}") from None


ByteSize = Annotated[int, BeforeValidator(_to_bytes)]
_SIZE = "int bytes or '<n>[kb|mb|gb|tb]' (binary units)"


def _env(key: str) -> str:
    return f"env {ENV_VARS[key]}"


class MooncakeExtraConfig(Settings):
    """The mooncake backend's ``hicache_storage_backend_extra_config`` (SGLang's keys),
    after the environment fallbacks of ``ENV_VARS``."""

    master_server_address: str = Field(
        pattern=r"^[^\s:]+:\d{1,5}$",
        description=f"'host:port' of a running mooncake_master; {_env('master_server_address')}")
    local_hostname: str = Field(
        "localhost", min_length=1,
        description=f"address this client advertises; {_env('local_hostname')}")
    metadata_server: str = Field(
        "P2PHANDSHAKE", min_length=1,
        description=f"transfer-engine metadata server; {_env('metadata_server')}")
    global_segment_size: ByteSize = Field(
        4 << 30, description=f"memory the engine contributes to the store, split over its TP "
        f"ranks: {_SIZE}; {_env('global_segment_size')}")
    local_buffer_size: ByteSize = Field(16 << 20, description=f"client buffer: {_SIZE}")
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description=f"transfer protocol; {_env('protocol')}")
    device_name: str = Field(
        "", description="device name, '' (auto) or a JSON object mapping TP rank to "
        f"device name; {_env('device_name')}")

    @field_validator("device_name")
    @classmethod
    def _json_object_if_braced(cls, value: str) -> str:
        if value.strip().startswith("{"):
            try:
                if not isinstance(json.loads(value), dict):
                    raise ValueError
            except ValueError:
                raise ValueError("starts with '{' but is not a JSON object") from None
        return value


@dataclass(frozen=True)
class MooncakeSettings:
    """The resolved client settings of one backend instance (one TP rank)."""

    master_server_address: str
    local_hostname: str
    metadata_server: str
    # this rank's share of the engine's global segment, in bytes
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    # this rank's device ('' = auto)
    device_name: str

    @classmethod
    def from_config(cls, config: StorageConfig) -> MooncakeSettings:
        raw = {k: v for k, v in config.extra_config.items() if v is not None}
        for key, env in ENV_VARS.items():
            if key not in raw and os.environ.get(env):
                raw[key] = os.environ[env]
        extra = validate_extra(raw, MooncakeExtraConfig, "mooncake")
        device = extra.device_name
        if device.strip().startswith("{"):
            device = str(json.loads(device).get(str(config.tp_rank), ""))
        return cls(extra.master_server_address, extra.local_hostname, extra.metadata_server,
                   extra.global_segment_size // max(config.tp_size, 1), extra.local_buffer_size,
                   extra.protocol, device)


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


class MooncakeBackend(StorageBackend):
    """HiCache L3 pages as Mooncake Store objects (header || payload)."""

    # Mooncake's client takes calls from any thread (SGLang's prefetch and backup
    # threads share one); our breaker state is under _lock and the staging
    # buffers are per thread. A dead master then costs a probe thread its
    # timeout, not vLLM's scheduling thread.
    concurrent_lookups = True
    concurrent_io = True

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.settings = MooncakeSettings.from_config(config)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StorageConfigError(
                "hicache_storage_backend='mooncake' needs the mooncake package "
                "(pip install mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine "
                f"on CUDA hosts): {exc}"
            ) from exc
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", DEFAULT_RPC_TIMEOUT_MS)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", DEFAULT_SETUP_RETRIES)
        if self.settings.local_hostname in _LOOPBACK:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        s = self.settings
        if not _tcp_reachable(s.master_server_address):
            raise StorageUnavailable(
                f"mooncake master {s.master_server_address} is not reachable "
                "(hicache_storage_backend_extra_config.master_server_address / MOONCAKE_MASTER)"
            )
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(s.local_hostname, s.metadata_server, 0, s.local_buffer_size,
                               s.protocol, s.device_name, s.master_server_address)
        if rc != 0:
            raise StorageUnavailable(
                f"mooncake store setup failed (rc={rc}) against master "
                f"{s.master_server_address}, metadata {s.metadata_server!r}"
            )
        self._fp = config.fingerprint
        self._lock = threading.Lock()  # breaker state and registrations
        self._down = False
        self._closed = False
        self._probe: threading.Thread | None = None
        self._mounted = False
        # registered buffers, kept alive until close: host pool, per-thread header
        # arenas (one 128-byte header per page of a batch call) and staging pages
        self._buffers: list[torch.Tensor] = []
        self._local = threading.local()
        self._pool_base = 0
        self._pool_rows: np.ndarray | None = None

    # ---- setup helpers ------------------------------------------------------------

    uses_pool_checksums = True

    def _register(self, t: torch.Tensor, what: str) -> bool:
        try:
            rc = self._store.register_buffer(_ptr(t), t.numel() * t.element_size())
        except Exception as exc:
            logger.warning("mooncake register_buffer of the %s raised: %s", what, exc)
            rc = -1
        if rc != 0:
            logger.warning("mooncake register_buffer of the %s failed (rc=%s)", what, rc)
            self._count(errors=1)
            return False
        with self._lock:
            self._buffers.append(t)
        return True

    def _arena(self) -> tuple[torch.Tensor, np.ndarray] | None:
        """This thread's registered header arena (calls from several threads never share)."""
        arena = getattr(self._local, "arena", None)
        if arena is None:
            arena = torch.zeros(ARENA_PAGES * HEADER, dtype=torch.uint8)
            if not self._register(arena, "header arena"):
                return None
            self._local.arena = arena
        return arena, arena.numpy()

    def _staging_buffer(self) -> torch.Tensor | None:
        """This thread's registered one-object staging buffer (header slot + payload)."""
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = torch.zeros(HEADER + self.config.page_bytes, dtype=torch.uint8)
            if not self._register(staging, "staging buffer"):
                return None
            self._local.staging = staging
        return staging

    def _ensure_segment(self) -> bool:
        """Mount this rank's share of the global segment once (before the first write)."""
        if self._mounted or self.settings.global_segment_size == 0:
            return True
        try:
            res = self._store.allocate_and_mount_segment(self.settings.global_segment_size,
                                                         self.settings.protocol)
        except Exception as exc:
            logger.warning("mooncake allocate_and_mount_segment raised: %s", exc)
            self._count(errors=1)
            return False
        rc = int(res.get("ret", -1)) if isinstance(res, dict) else -1
        if rc != 0:
            logger.warning("mooncake allocate_and_mount_segment(%d) failed: %s",
                           self.settings.global_segment_size, res)
            self._failed(rc)
            return False
        self._mounted = True
        return True

    def register_host_pool(self, pool: HostPagePool) -> None:
        super().register_host_pool(pool)
        if not self._register(pool.buffer, "host pool"):
            raise StorageUnavailable("mooncake could not register the host pool buffer")
        if pool.layout != "layer_first":  # slot-major: slot s is bytes [s*pb, (s+1)*pb)
            self._pool_base = _ptr(pool.buffer)
            self._pool_rows = pool.buffer.numpy().reshape(pool.geometry.num_slots, -1)
        if not self._ensure_segment():
            raise StorageUnavailable(
                f"mooncake could not mount a {self.settings.global_segment_size}-byte segment "
                "(hicache_storage_backend_extra_config.global_segment_size)"
            )

    # ---- breaker ---------------------------------------------------------------------

    def _available(self) -> bool:
        """False (and an error counted) while the master is known to be unreachable."""
        if self._closed or self._down:
            self._count(errors=1)
            return False
        return True

    def _failed(self, rc: int) -> None:
        """Count a failure; an RPC failure trips the breaker and starts the prober."""
        self._count(errors=1)
        if not _is_rpc_failure(rc):
            return
        with self._lock:
            if self._down or self._closed:
                return
            self._down = True
            logger.warning("mooncake master %s unreachable (rc=%d); L3 calls fail fast until it "
                           "answers again", self.settings.master_server_address, rc)
            self._probe = threading.Thread(target=self._probe_loop, name="mooncake-probe",
                                           daemon=True)
            self._probe.start()

    def _probe_loop(self) -> None:
        probe_key = f"hicache-probe_{self.config.key_suffix}"
        while not self._closed:
            time.sleep(PROBE_INTERVAL_S)
            if self._closed:
                return
            try:
                rc = self._store.batch_is_exist([probe_key])
            except Exception:
                continue
            if rc and rc[0] >= 0:
                with self._lock:
                    self._down = False
                logger.warning("mooncake master %s answers again",
                               self.settings.master_server_address)
                return

    @property
    def master_reachable(self) -> bool:
        """False while the breaker is open (the master stopped answering)."""
        return not self._down

    # ---- the store calls (never raise) ------------------------------------------------

    def _exist_flags(self, okeys: list[str]) -> list[int] | None:
        """batch_is_exist: 1 / 0 per key, or None when the query failed."""
        try:
            flags = list(self._store.batch_is_exist(okeys))
        except Exception as exc:
            logger.warning("mooncake batch_is_exist raised: %s", exc)
            self._count(errors=1)
            return None
        bad = [f for f in flags if f < 0]
        if bad or len(flags) != len(okeys):
            self._failed(bad[0] if bad else -1)
            return None
        return flags

    def _wrong_size(self, okey: str, rc: int) -> bool:
        """After a failed read (e.g. TRANSFER_FAIL for an object shorter than the
        buffers): whether the object exists with a size other than a page's."""
        if rc == RC_OBJECT_NOT_FOUND or _is_rpc_failure(rc):
            return False
        try:
            size = int(self._store.get_size(okey))
        except Exception:
            return False
        return size >= 0 and size != HEADER + self.config.page_bytes

    def _remove_corrupt(self, okeys: list[str]) -> None:
        try:
            self._store.batch_remove(okeys, True)
        except Exception as exc:
            logger.warning("mooncake batch_remove raised: %s", exc)
            self._count(errors=1)

    def _read(self, keys: list[str], ptrs: list[int], payloads: list[memoryview]) -> list[bool]:
        """Read pages into registered payload buffers (``ptrs``, same memory as
        ``payloads``), verifying each."""
        results: list[bool] = []
        for lo in range(0, len(keys), ARENA_PAGES):
            hi = lo + ARENA_PAGES
            results += self._read_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi])
        return results

    def _read_chunk(self, keys: list[str], ptrs: list[int],
                    payloads: list[memoryview]) -> list[bool]:
        n, pb = len(keys), self.config.page_bytes
        self._count(get_pages=n)
        if not self._available():
            self._count(get_misses=n)
            return [False] * n
        arena = self._arena()
        if arena is None:
            self._count(get_misses=n)
            return [False] * n
        base, headers = _ptr(arena[0]), arena[1]
        okeys = [self.object_key(k) for k in keys]
        t0 = time.perf_counter()
        try:
            rcs = list(self._store.batch_get_into_multi_buffers(
                okeys, [[base + i * HEADER, p] for i, p in enumerate(ptrs)],
                [[HEADER, pb]] * n))
        except Exception as exc:
            logger.warning("mooncake batch_get_into_multi_buffers raised: %s", exc)
            rcs = [-1] * n
        whole = [i for i, rc in enumerate(rcs) if rc == HEADER + pb]
        # Every page read whole, checked in one batch (checksums without the GIL).
        checked = dict(zip(whole, integrity.check_headers(
            headers[:n * HEADER].reshape(n, HEADER)[whole],
            [self.page_key_bytes(keys[i]) for i in whole], self._fp, pb,
            integrity.checksums_at([ptrs[i] for i in whole], [payloads[i] for i in whole],
                                   pb)), strict=True)) if whole else {}
        results, corrupt = [], []
        for i, rc in enumerate(rcs):
            if rc == HEADER + pb:
                why = checked[i]
                if why is None:
                    results.append(True)
                    continue
                logger.warning("mooncake page %s is corrupt (%s); removed", okeys[i], why)
                corrupt.append(okeys[i])
            elif rc == RC_BUFFER_OVERFLOW or 0 <= rc < HEADER + pb or self._wrong_size(okeys[i], rc):
                logger.warning("mooncake page %s has the wrong size (rc=%d); removed",
                               okeys[i], rc)
                corrupt.append(okeys[i])
            elif rc != RC_OBJECT_NOT_FOUND:
                self._failed(rc)
            results.append(False)
        if corrupt:
            self._count(corrupt_pages=len(corrupt))
            self._remove_corrupt(corrupt)
        hits = sum(results)
        self._count(get_hits=hits, get_misses=n - hits, bytes_read=hits * pb,
                    read_seconds=time.perf_counter() - t0)
        return results

    def _write(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
               known: list[int | None] | None = None) -> list[bool]:
        """Store pages from registered memory (``ptrs``, same memory as ``payloads``;
        ``known``: their checksums where the pool has them); skip existing ones."""
        results: list[bool] = []
        for lo in range(0, len(keys), ARENA_PAGES):
            hi = lo + ARENA_PAGES
            results += self._write_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi],
                                         None if known is None else known[lo:hi])
        return results

    def _write_chunk(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
                     known: list[int | None] | None = None) -> list[bool]:
        n, pb = len(keys), self.config.page_bytes
        arena = self._arena() if self._available() and self._ensure_segment() else None
        if arena is None:
            self._count(set_failures=n)
            return [False] * n
        base, headers = _ptr(arena[0]), arena[1]
        t0 = time.perf_counter()
        okeys = [self.object_key(k) for k in keys]
        flags = self._exist_flags(okeys)
        if flags is None:
            self._count(set_failures=n)
            return [False] * n
        results = [bool(f) for f in flags]
        todo: list[int] = []
        first: dict[str, int] = {}
        for i, ok in enumerate(results):
            if not ok and okeys[i] not in first:  # a key twice in one batch: write once
                first[okeys[i]] = i
                todo.append(i)
        skipped = n - len(todo)
        if todo:  # every header of the batch, checksums in one call without the GIL
            rows = integrity.header_rows([self.page_key_bytes(keys[i]) for i in todo],
                                         self._fp, pb, width=HEADER)
            digests = integrity.checksums_at(
                [ptrs[i] for i in todo], [payloads[i] for i in todo], pb,
                None if known is None else [known[i] for i in todo])
            at = integrity.CHECKSUM_AT
            rows[:, at:at + 8] = np.asarray(digests, "<u8").view(np.uint8).reshape(-1, 8)
            headers[:len(todo) * HEADER] = rows.reshape(-1)
        stored = 0
        if todo:
            try:
                rcs = list(self._store.batch_put_from_multi_buffers(
                    [okeys[i] for i in todo],
                    [[base + j * HEADER, ptrs[i]] for j, i in enumerate(todo)],
                    [[HEADER, pb]] * len(todo)))
            except Exception as exc:
                logger.warning("mooncake batch_put_from_multi_buffers raised: %s", exc)
                rcs = [-1] * len(todo)
            for i, rc in zip(todo, rcs, strict=True):
                if rc == 0:
                    results[i] = True
                    stored += 1
                else:
                    self._failed(rc)
        for i in range(n):  # duplicates in the batch follow their first occurrence
            if not results[i] and okeys[i] in first and first[okeys[i]] != i:
                results[i] = results[first[okeys[i]]]
        self._count(set_pages=stored, set_skipped_existing=skipped,
                    set_failures=n - sum(results), bytes_written=stored * pb,
                    write_seconds=time.perf_counter() - t0)
        return results

    # ---- single pages ------------------------------------------------------------------

    def get(self, key: str, target: torch.Tensor) -> bool:
        staging = self._staging_buffer()
        if staging is None:
            self._count(get_pages=1, get_misses=1)
            return False
        payload = staging[HEADER:]
        if not self._read([key], [_ptr(payload)], [payload.numpy().data])[0]:
            return False
        target.view(-1).copy_(payload)
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        staging = self._staging_buffer()
        if staging is None:
            self._count(set_failures=1)
            return False
        payload = staging[HEADER:]
        payload.copy_(value.reshape(-1))
        return self._write([key], [_ptr(payload)], [payload.numpy().data])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- batches -----------------------------------------------------------------------

    def batch_exists(self, keys: list[str]) -> int:
        self._count(exists_queries=len(keys))
        if not keys or not self._available():
            return 0
        flags = self._exist_flags([self.object_key(k) for k in keys])
        if flags is None:
            return 0
        for i, f in enumerate(flags):
            if f != 1:
                return i
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        pool = self._require_pool()
        if pool.layout == "layer_first":
            return super().batch_get_v1(keys, host_slots)
        if len(keys) != len(host_slots):
            raise ValueError("keys and host_slots differ in length")
        ptrs, payloads = self._slots(host_slots)
        return self._read(keys, ptrs, payloads)

    def batch_set_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        pool = self._require_pool()
        if pool.layout == "layer_first":
            return super().batch_set_v1(keys, host_slots)
        if len(keys) != len(host_slots):
            raise ValueError("keys and host_slots differ in length")
        ptrs, payloads = self._slots(host_slots)
        return self._write(keys, ptrs, payloads, pool.checksums_of(host_slots))

    def _slots(self, host_slots: list[int]) -> tuple[list[int], list[memoryview]]:
        """Addresses and byte views of pool slots (page_first layouts: slot-major pages)."""
        rows = self._pool_rows
        assert rows is not None
        base, pb = self._pool_base, self.config.page_bytes
        return [base + s * pb for s in host_slots], [memoryview(rows[s]) for s in host_slots]

    # ---- maintenance ---------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        if not self._available():
            return False
        try:
            rc = self._store.remove(self.object_key(key), True)
        except Exception as exc:  # noqa: BLE001 - a failing store is reported, not raised
            logger.warning("mooncake remove raised: %s", exc)
            self._count(errors=1)
            return False
        return rc == 0

    def clear(self) -> None:
        if not self._available():
            return
        try:
            rc = self._store.remove_all(True)
        except Exception as exc:
            logger.warning("mooncake remove_all raised: %s", exc)
            self._count(errors=1)
            return
        if rc < 0:
            self._failed(rc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            down = self._down
        if down or not _tcp_reachable(self.settings.master_server_address, timeout_s=1.0):
            # Mooncake's close would block 10-20 s (holding the GIL) trying to unmount
            # from a dead master; keep the client alive until process exit instead.
            _ABANDONED.append((self._store, self._buffers))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))
            return
        for buf in self._buffers:
            with contextlib.suppress(Exception):
                self._store.unregister_buffer(_ptr(buf))
        self._buffers = []
        try:
            self._store.close()
        except Exception as exc:
            logger.warning("mooncake close raised: %s", exc)
