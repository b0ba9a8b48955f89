"""L3 backend on a Mooncake Store cluster (``mooncake.store.MooncakeDistributedStore``).

Contract (on top of ``base.py``):
- Extra-config keys and their environment fallbacks: config.py.
- One Mooncake client per instance, set up with a global segment of 0 bytes
  (this checks the master: unreachable -> ``StorageUnavailable``). The
  instance's share of the global segment is mounted when it first needs to
  write: at ``register_host_pool`` (workers) or at the first write. The
  scheduler's instance, which only asks ``exists_prefix``, contributes no
  memory.
- One object per page, named ``object_key(key)``: the 128-byte integrity
  header followed by the payload, written and read with Mooncake's
  multi-buffer batch calls (header from/into a registered header arena,
  payload straight from/into the registered host pool slot for page_first /
  page_first_direct); batches are split into calls of ``ARENA_PAGES`` records.
  A span object (batches with ``spans``, tiers/index/spans.py; slot-major
  pools) is its pages' records back to back, put whole in one
  multi-buffer call; a read takes any subset of its records (the others land
  in a registered scratch page). A bad record is a miss for its page only
  (counted corrupt); the object is then removed.
- Reads (reads.py), in place (local.py) where objects whose replica lies in this
  instance's own mounted segment are copied into the slots and hashed in one
  pass (native_io ``copy_records``; ``verify`` = helper: hashed on a helper
  thread right behind the copy), counted in ``pages_in_place``; the others,
  and any that fail the check in place, go through Mooncake's get.
  Pools that are not slot-major (``layer_first``) go through a registered
  one-page staging buffer. A write takes each slot's
  checksum from the pool where the store path computed it (host_pool.py),
  else computes it. Arenas and staging buffers
  are per calling thread, so I/O threads may share one instance. Every
  read checks the object size and ``integrity.verify``; a mismatch is a miss
  counted in ``corrupt_pages`` and the object is force-removed. The pool
  slot of a failed read holds garbage and is reported False.
- Writes ask ``batch_is_exist`` first and skip existing objects (counted in
  ``set_skipped_existing``; the page counts as stored). Mooncake may evict
  any object at any time; a successful set is not residency.
- Store calls are caught here and reported (``report.failed``). Bounded
  time: a master that hangs is bounded by ``MC_RPC_TIMEOUT_MS`` (set to
  5000 ms here when the environment does not set it; Mooncake's default is
  30 s). A dead master costs Mooncake ~4.3 s per call (its RPC client pool
  retries the connect ~3 times, 1 s apart; not configurable in 0.3.13), so
  the first RPC failure (codes -900..-999) is reported ``down`` and the
  guard's breaker opens (tiers/l3/guard.py): every call then fails at once
  (counted in ``refused_calls``) while a background thread probes the master
  (``answers``) every half second and closes the breaker when it answers.
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
import logging
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hicache.tiers.index.spans import SpanRef, whole_spans
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import integrity, native_io
from hicache.tiers.l3.base import (
    Capabilities,
    ReadBatch,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    StorageUnavailable,
    WriteBatch,
)
from hicache.tiers.l3.mooncake import local as mooncake_local
from hicache.tiers.l3.mooncake.config import MooncakeSettings
from hicache.tiers.l3.mooncake.reads import RecordReads
from hicache.tiers.l3.mooncake.records import (
    ARENA_PAGES,
    HEADER,
    Place,
    chunks,
    group_objects,
    is_rpc_failure,
    ptr,
)
from hicache.tiers.l3.verify import helpers as verify_helpers

logger = logging.getLogger(__name__)

DEFAULT_RPC_TIMEOUT_MS = "5000"
DEFAULT_SETUP_RETRIES = "2"
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
# Clients abandoned by close() while the master was unreachable: never destroyed.
_ABANDONED: list[Any] = []


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeBackend(RecordReads, StorageBackend):
    """HiCache L3 pages as Mooncake Store objects (header || payload)."""

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
        self._lock = threading.Lock()  # registrations and close
        self._closed = False
        self._mounted = False
        # registered buffers, kept alive until close: host pool, per-thread header
        # arenas (one 128-byte header per page of a batch call) and staging pages
        self._buffers: list[torch.Tensor] = []
        self._local = threading.local()
        self._pool_base = 0
        self._pool_rows: np.ndarray | None = None
        # where this instance's own segment lies, once mounted (local.py)
        self._segment: mooncake_local.LocalSegment | None = None
        self._verify_helper: ThreadPoolExecutor | None = None
        # Mooncake's client takes calls from any thread (SGLang's prefetch and backup
        # threads share one); the breaker has its own lock and the staging buffers are
        # per thread. A dead master then costs a probe thread its timeout, not vLLM's
        # scheduling thread. Span objects: slot-major pools only (records come straight
        # from and into pool slots). Writes take the checksums the pool has.
        self.capabilities = Capabilities(
            concurrent_lookups=True, concurrent_io=True, probe=True, pool_checksums=True,
            spans=config.mem_layout != "layer_first")

    # ---- setup helpers ------------------------------------------------------------

    def _register(self, t: torch.Tensor, what: str) -> bool:
        try:
            rc = self._store.register_buffer(ptr(t), t.numel() * t.element_size())
        except Exception as exc:
            logger.warning("mooncake register_buffer of the %s raised: %s", what, exc)
            rc = -1
        if rc != 0:
            logger.warning("mooncake register_buffer of the %s failed (rc=%s)", what, rc)
            self.report.failed("register_buffer")
            return False
        with self._lock:
            self._buffers.append(t)
        return True

    def _thread_buffer(self, name: str, nbytes: int) -> torch.Tensor | None:
        """This thread's registered buffer ``name`` of at least ``nbytes`` bytes (made,
        or made larger, on first need; calls from several threads never share one)."""
        buf = getattr(self._local, name, None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            if not self._register(buf, name):
                return None
            setattr(self._local, name, buf)
        return buf

    def _arena(self, rows: int = ARENA_PAGES) -> tuple[torch.Tensor, np.ndarray] | None:
        """This thread's header arena of at least ``rows`` headers."""
        arena = self._thread_buffer("header_arena", max(rows, ARENA_PAGES) * HEADER)
        return None if arena is None else (arena, arena.numpy())

    def _scratch(self) -> int | None:
        """This thread's page of scratch: where the records of a span object that a read
        does not want land (their bytes are ignored)."""
        scratch = self._thread_buffer("scratch_page", self.config.page_bytes)
        return None if scratch is None else ptr(scratch)

    def _staging_buffer(self) -> torch.Tensor | None:
        """This thread's one-object staging buffer (header slot + payload)."""
        return self._thread_buffer("staging_buffer", HEADER + self.config.page_bytes)

    def _ensure_segment(self) -> bool:
        """Mount this rank's share of the global segment once (before the first write)."""
        if self._mounted or self.settings.global_segment_size == 0:
            return True
        arena = self._arena() if native_io.available() else None
        probe = None if arena is None else (
            ptr(arena[0]), f"hicache-segment-probe_{self.config.key_suffix}_{os.getpid()}")
        try:
            res, self._segment = mooncake_local.LocalSegment.mount(
                self._store, self.settings.global_segment_size, self.settings.protocol, probe)
        except Exception as exc:
            logger.warning("mooncake allocate_and_mount_segment raised: %s", exc)
            self.report.failed("allocate_and_mount_segment")
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
            self._pool_base = ptr(pool.buffer)
            self._pool_rows = pool.buffer.numpy().reshape(pool.geometry.num_slots, -1)
        if native_io.available():
            native_io.warm_up()  # compile now, not in the first fetch
            if self._verify_helper is None:
                self._verify_helper = verify_helpers(self.settings.verify, pool)
        if not self._ensure_segment():
            raise StorageUnavailable(
                f"mooncake could not mount a {self.settings.global_segment_size}-byte segment "
                "(hicache_storage_backend_extra_config.global_segment_size)"
            )

    # ---- the guard's breaker (tiers/l3/guard.py) -------------------------------------

    def _available(self) -> bool:
        """False while the master is known to be unreachable (the guard's breaker is
        open) or the backend is closed: a batch that is under way stops calling it."""
        return not (self._closed or self.report.down)

    def _failed(self, rc: int) -> None:
        """Report a failure; an RPC failure says the master is down (the breaker opens)."""
        self.report.failed(f"rc={rc}", down=is_rpc_failure(rc) and not self._closed)

    def answers(self) -> bool:
        """The breaker's probe: one ``batch_is_exist`` that gets an answer."""
        rc = self._store.batch_is_exist([f"hicache-probe_{self.config.key_suffix}"])
        return bool(rc) and rc[0] >= 0

    # ---- the store calls (never raise) ------------------------------------------------

    def _exist_flags(self, okeys: list[str]) -> list[int] | None:
        """batch_is_exist: 1 / 0 per key, or None when the query failed."""
        try:
            flags = list(self._store.batch_is_exist(okeys))
        except Exception as exc:
            logger.warning("mooncake batch_is_exist raised: %s", exc)
            self.report.failed("batch_is_exist")
            return None
        bad = [f for f in flags if f < 0]
        if bad or len(flags) != len(okeys):
            self._failed(bad[0] if bad else -1)
            return None
        return flags

    def _remove_corrupt(self, okeys: list[str]) -> None:
        try:
            self._store.batch_remove(okeys, True)
        except Exception as exc:
            logger.warning("mooncake batch_remove raised: %s", exc)
            self.report.failed("batch_remove")

    def _write(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
               known: list[int | None] | None = None,
               places: list[Place] | None = None) -> list[bool]:
        """Store pages from registered memory (``ptrs``, same memory as ``payloads``;
        ``known``: their checksums where the pool has them) into their objects
        (``places``: whole objects, records in order; default one per page); objects
        that exist already are skipped."""
        places = places or [(self.object_key(k), 0, 1) for k in keys]
        results: list[bool] = []
        for lo, hi in chunks(places):
            results += self._write_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi],
                                         None if known is None else known[lo:hi],
                                         places[lo:hi])
        return results

    def _write_chunk(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
                     known: list[int | None] | None, places: list[Place]) -> list[bool]:
        n, pb = len(keys), self.config.page_bytes
        objects = group_objects(places)
        usable = self._available() and self._ensure_segment()
        arena = self._arena(n) if usable else None
        if arena is None:
            return [False] * n
        base, headers = ptr(arena[0]), arena[1]
        okeys = list(objects)
        flags = self._exist_flags(okeys)
        if flags is None:
            return [False] * n
        todo = [o for o, f in zip(okeys, flags, strict=True) if not f]
        pages = [i for o in todo for _, i in objects[o][1]]
        stored: set[str] = {o for o, f in zip(okeys, flags, strict=True) if f}
        skipped = sum(len(objects[o][1]) for o in stored)
        if pages:  # every header of the batch, checksums in one call without the GIL
            rows = integrity.header_rows([self.page_key_bytes(keys[i]) for i in pages],
                                         self._fp, pb, width=HEADER)
            digests = integrity.checksums_at(
                [ptrs[i] for i in pages], [payloads[i] for i in pages], pb,
                None if known is None else [known[i] for i in pages])
            at = integrity.CHECKSUM_AT
            rows[:, at:at + 8] = np.asarray(digests, "<u8").view(np.uint8).reshape(-1, 8)
            headers[:len(pages) * HEADER] = rows.reshape(-1)
            row = dict(zip(pages, range(len(pages)), strict=True))
            try:
                rcs = list(self._store.batch_put_from_multi_buffers(
                    todo,
                    [[a for _, i in objects[o][1] for a in (base + row[i] * HEADER, ptrs[i])]
                     for o in todo],
                    [[HEADER, pb] * len(objects[o][1]) for o in todo]))
            except Exception as exc:
                logger.warning("mooncake batch_put_from_multi_buffers raised: %s", exc)
                rcs = [-1] * len(todo)
            for okey, rc in zip(todo, rcs, strict=True):
                if rc == 0:
                    stored.add(okey)
                else:
                    self._failed(rc)
        self.report.skipped(skipped)
        return [p[0] in stored for p in places]

    # ---- the verbs -----------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if not keys or not self._available():
            return 0
        flags = self._exist_flags([self.object_key(k) for k in keys])
        if flags is None:
            return 0
        for i, f in enumerate(flags):
            if f != 1:
                return i
        return len(keys)

    def read(self, batch: ReadBatch) -> list[bool]:
        """Pages from their objects (span objects: each page's record). Mooncake has no
        deadline: a batch runs whole."""
        pool = self._require_pool()
        keys = list(batch.keys)
        if pool.layout == "layer_first":
            if batch.spans is not None:
                return [False] * len(keys)
            staging = self._staging_buffer()
            if staging is None:
                return [False] * len(keys)
            payload = staging[HEADER:]
            return self._read_staged(keys, batch.slots, payload, lambda key: self._read(
                [key], [ptr(payload)], [payload.numpy().data])[0])
        ptrs, payloads = self._slots(batch.slots)
        places = None if batch.spans is None else [self._place(sp) for sp in batch.spans]
        return self._read(keys, ptrs, payloads, places)

    def write(self, batch: WriteBatch) -> list[bool]:
        """Page objects, or one object per span: its pages' records (header, payload)
        back to back, put from the header arena and the pool slots in one call."""
        pool = self._require_pool()
        keys, slots = list(batch.keys), list(batch.slots)
        if pool.layout == "layer_first":
            if batch.spans is not None:
                return [False] * len(keys)
            return [self._write_staged(key, slot) for key, slot in zip(keys, slots,
                                                                       strict=True)]
        if batch.spans is None:
            ptrs, payloads = self._slots(slots)
            return self._write(keys, ptrs, payloads, pool.checksums_of(slots))
        whole = whole_spans(batch.spans)
        rows = [i for i in range(len(keys)) if whole[i]]
        results = [False] * len(keys)
        if rows:
            picked = [slots[i] for i in rows]
            ptrs, payloads = self._slots(picked)
            done = self._write([keys[i] for i in rows], ptrs, payloads,
                               pool.checksums_of(picked),
                               [self._place(batch.spans[i]) for i in rows])
            for i, ok in zip(rows, done, strict=True):
                results[i] = ok
        return results

    def _write_staged(self, key: str, slot: int) -> bool:
        staging = self._staging_buffer()
        if staging is None:
            return False
        payload = staging[HEADER:]
        payload.copy_(self._require_pool().read_page(slot).reshape(-1))
        return self._write([key], [ptr(payload)], [payload.numpy().data])[0]

    def _place(self, span: SpanRef) -> Place:
        return self.object_key(span.key.hex()), span.index, span.count

    def _slots(self, host_slots: Sequence[int]) -> tuple[list[int], list[memoryview]]:
        """Addresses and byte views of pool slots (page_first layouts: slot-major pages)."""
        rows = self._pool_rows
        assert rows is not None
        base, pb = self._pool_base, self.config.page_bytes
        return [base + s * pb for s in host_slots], [memoryview(rows[s]) for s in host_slots]

    # ---- maintenance ---------------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        for key in keys:
            if not self._available():
                break
            try:
                rc = self._store.remove(self.object_key(key), True)
            except Exception as exc:  # noqa: BLE001 - a failing store is reported, not raised
                logger.warning("mooncake remove raised: %s", exc)
                self.report.failed("remove")
                break
            deleted += rc == 0
        return deleted

    def clear(self) -> None:
        if not self._available():
            return
        try:
            rc = self._store.remove_all(True)
        except Exception as exc:
            logger.warning("mooncake remove_all raised: %s", exc)
            self.report.failed("remove_all")
            return
        if rc < 0:
            self._failed(rc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            down = self.report.down
        if self._verify_helper is not None:  # a read whose job is cancelled hashes itself
            self._verify_helper.shutdown(wait=False, cancel_futures=True)
            self._verify_helper = None
        if down or not _tcp_reachable(self.settings.master_server_address, timeout_s=1.0):
            # Mooncake's close would block 10-20 s (holding the GIL) trying to unmount
            # from a dead master; keep the client alive until process exit instead.
            _ABANDONED.append((self._store, self._buffers))
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._store))
            return
        for buf in self._buffers:
            with contextlib.suppress(Exception):
                self._store.unregister_buffer(ptr(buf))
        self._buffers = []
        try:
            self._store.close()
        except Exception as exc:
            logger.warning("mooncake close raised: %s", exc)
