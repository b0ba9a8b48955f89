"""L3 backend on a Mooncake Store cluster (``mooncake.store.MooncakeDistributedStore``).

Contract (on top of ``base.py``):
- Extra-config keys and their environment fallbacks: config.py.
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
  page_first_direct); batches are split into calls of ``ARENA_PAGES`` records.
  A span object (``batch_set_spans`` / ``batch_get_spans``, tiers/index/spans.py;
  slot-major pools) is its pages' records back to back, put whole in one
  multi-buffer call; a read takes any subset of its records (the others land
  in a registered scratch page). A bad record is a miss for its page only
  (counted corrupt); the object is then removed.
- Reads in place (local.py): objects whose replica lies in this
  instance's own mounted segment are copied into the slots and hashed in one
  pass (native_io ``copy_records``; ``verify`` = helper: hashed on a helper
  thread right behind the copy), counted in ``pages_in_place``; the others,
  and any that fail the check in place, go through Mooncake's get.
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hicache.tiers.index.spans import SpanRef, whole_spans
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import integrity, native_io
from hicache.tiers.l3.base import (
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    StorageUnavailable,
)
from hicache.tiers.l3.mooncake import local as mooncake_local
from hicache.tiers.l3.mooncake.config import MooncakeSettings
from hicache.tiers.l3.verify import helpers as verify_helpers

logger = logging.getLogger(__name__)

HEADER = integrity.HEADER_BYTES
DEFAULT_RPC_TIMEOUT_MS = "5000"
DEFAULT_SETUP_RETRIES = "2"
# Header slots per multi-buffer batch call; larger batches are chunked.
ARENA_PAGES = 256
# Mooncake ErrorCode values this backend distinguishes.
RC_OBJECT_NOT_FOUND = -704
RC_BUFFER_OVERFLOW = -600
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
# Clients abandoned by close() while the master was unreachable: never destroyed.
_ABANDONED: list[Any] = []


def _is_rpc_failure(rc: int) -> bool:
    """Mooncake's RPC error codes (RPC_FAIL -900, timeouts, ...): the master is unreachable."""
    return -999 <= rc <= -900


def _tcp_reachable(address: str, timeout_s: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


# A page's place in the store: its object's key, its record there and the object's
# number of records (a page object: record 0 of 1; a span object: tiers/index/spans.py).
Place = tuple[str, int, int]


def _objects(places: list[Place]) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Object key -> (its record count, [(record, page row)]), in first-seen order."""
    out: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for i, (okey, record, count) in enumerate(places):
        out.setdefault(okey, (count, []))[1].append((record, i))
    return out


def _header_rows(objects: dict[str, tuple[int, list[tuple[int, int]]]]) -> dict[str, int]:
    """Each object's first row in a header arena that holds all records of all objects."""
    rows, at = {}, 0
    for okey, (count, _) in objects.items():
        rows[okey] = at
        at += count
    return rows


def _chunks(places: list[Place]) -> list[tuple[int, int]]:
    """Cut a batch into calls: at most ``ARENA_PAGES`` records each (an object larger
    than that is a call of its own), objects never split, no place twice in a call
    (a page asked twice goes in the next call)."""
    out: list[tuple[int, int]] = []
    lo, records = 0, 0
    seen: set[Place] = set()
    objects: set[str] = set()
    for i, place in enumerate(places):
        okey, _, count = place
        new = okey not in objects
        if i > lo and (place in seen or new and records + count > ARENA_PAGES):
            out.append((lo, i))
            lo, records, seen, objects = i, 0, set(), set()
            new = True
        seen.add(place)
        if new:
            objects.add(okey)
            records += count
    if lo < len(places):
        out.append((lo, len(places)))
    return out


class MooncakeBackend(StorageBackend):
    """HiCache L3 pages as Mooncake Store objects (header || payload)."""

    # Mooncake's client takes calls from any thread (SGLang's prefetch and backup
    # threads share one); the breaker has its own lock and the staging
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
        return None if scratch is None else _ptr(scratch)

    def _staging_buffer(self) -> torch.Tensor | None:
        """This thread's one-object staging buffer (header slot + payload)."""
        return self._thread_buffer("staging_buffer", HEADER + self.config.page_bytes)

    def _ensure_segment(self) -> bool:
        """Mount this rank's share of the global segment once (before the first write)."""
        if self._mounted or self.settings.global_segment_size == 0:
            return True
        arena = self._arena() if native_io.available() else None
        probe = None if arena is None else (
            _ptr(arena[0]), f"hicache-segment-probe_{self.config.key_suffix}_{os.getpid()}")
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
            self._pool_base = _ptr(pool.buffer)
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
        self.report.failed(f"rc={rc}", down=_is_rpc_failure(rc) and not self._closed)

    def answers(self) -> bool:
        """The breaker's probe: one ``batch_is_exist`` that gets an answer."""
        rc = self._store.batch_is_exist([f"hicache-probe_{self.config.key_suffix}"])
        return bool(rc) and rc[0] >= 0

    @property
    def master_reachable(self) -> bool:
        """False while the guard's breaker is open (the master stopped answering)."""
        return not self.report.down

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

    def _wrong_size(self, okey: str, rc: int, size: int) -> bool:
        """After a failed read (e.g. TRANSFER_FAIL for an object shorter than the
        buffers): whether the object exists with a size other than ``size``."""
        if rc == RC_OBJECT_NOT_FOUND or _is_rpc_failure(rc):
            return False
        try:
            found = int(self._store.get_size(okey))
        except Exception:
            return False
        return found >= 0 and found != size

    def _remove_corrupt(self, okeys: list[str]) -> None:
        try:
            self._store.batch_remove(okeys, True)
        except Exception as exc:
            logger.warning("mooncake batch_remove raised: %s", exc)
            self.report.failed("batch_remove")

    def _read(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
              places: list[Place] | None = None) -> list[bool]:
        """Read pages into registered payload buffers (``ptrs``, same memory as
        ``payloads``), verifying each; ``places[i]``: page i's object and record there
        (default: its page object)."""
        places = places or [(self.object_key(k), 0, 1) for k in keys]
        results: list[bool] = []
        for lo, hi in _chunks(places):
            results += self._read_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi],
                                        places[lo:hi])
        return results

    def _read_chunk(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
                    places: list[Place]) -> list[bool]:
        n = len(keys)
        objects = _objects(places)  # object key -> its record count and pages there
        first = _header_rows(objects)  # object key -> its first header row
        arena = self._arena(sum(c for c, _ in objects.values())) if self._available() else None
        partial = any(count > len(pages) for count, pages in objects.values())
        scratch = self._scratch() if arena is not None and partial else 0
        if arena is None or scratch is None:
            return [False] * n
        base, headers = _ptr(arena[0]), arena[1]
        remote = list(objects)
        why_bad: dict[int, str | None] = {}  # page read whole -> why it is bad (None: good)
        if self._segment is not None:
            here: dict[int, int] = {}  # page -> checksum of its payload as copied
            remote = self._read_in_place(objects, first, base, ptrs, here)
            why_bad = self._checked(keys, here, headers, first, places)
            # An object with a page that failed its check in place is read again
            # through Mooncake, all of it: none of its pages counts from the copy in
            # place (that read may overwrite the slots, e.g. cut short).
            again = {places[i][0] for i, why in why_bad.items() if why is not None}
            for okey in again:
                for _, i in objects[okey][1]:
                    why_bad.pop(i, None)
            remote = [*remote, *sorted(again - set(remote))]
        failed_objects: dict[str, str] = {}
        if remote:
            arrived: dict[int, int] = {}  # page -> checksum of its payload as read
            self._read_through_mooncake(remote, objects, first, base, scratch, ptrs,
                                        payloads, arrived, failed_objects)
            why_bad.update(self._checked(keys, arrived, headers, first, places))
        results = [False] * n
        corrupt = dict(failed_objects)  # object -> why (its pages: misses)
        bad_pages = sum(1 for p in places if p[0] in failed_objects)
        for i, why in why_bad.items():
            if why is None:
                results[i] = True
            else:  # a miss for this page only; the object goes, the next store rewrites it
                logger.warning("mooncake page %s in object %s is corrupt (%s)", keys[i],
                               places[i][0], why)
                corrupt.setdefault(places[i][0], why)
                bad_pages += 1
        if corrupt:
            self.report.corrupt(bad_pages)
            self._remove_corrupt(list(corrupt))
        return results

    def _read_in_place(self, objects: dict[str, tuple[int, list[tuple[int, int]]]],
                       first: dict[str, int], base: int, ptrs: list[int],
                       arrived: dict[int, int]) -> list[str]:
        """Objects in this process's own segment: copied and hashed in one pass
        (local.py). Returns the objects to read through Mooncake."""
        assert self._segment is not None
        rec = HEADER + self.config.page_bytes
        okeys = list(objects)
        where = self._segment.addresses(self._store, okeys,
                                        [objects[o][0] * rec for o in okeys])
        remote = [o for o, at in zip(okeys, where, strict=True) if at == mooncake_local.ELSEWHERE]
        sources, hdrs, dests, pages = [], [], [], []
        for okey, at in zip(okeys, where, strict=True):
            if at > 0:
                for r, i in objects[okey][1]:
                    sources.append(at + r * rec)
                    hdrs.append(base + (first[okey] + r) * HEADER)
                    dests.append(ptrs[i])
                    pages.append(i)
        if pages:
            sums = native_io.copy_records(sources, hdrs, dests, HEADER, self.config.page_bytes,
                                          self._verify_helper)
            arrived.update(zip(pages, (int(x) for x in sums.tolist()), strict=True))
            self.report.in_place(len(pages))
        return remote

    def _read_through_mooncake(self, okeys: list[str],
                               objects: dict[str, tuple[int, list[tuple[int, int]]]],
                               first: dict[str, int], base: int, scratch: int,
                               ptrs: list[int], payloads: list[memoryview],
                               arrived: dict[int, int], failed: dict[str, str]) -> None:
        """Mooncake's multi-buffer get of whole objects: each record's header into the
        arena, its payload into the page's buffer (records not asked for: scratch)."""
        pb = self.config.page_bytes
        rec = HEADER + pb
        buffers, sizes = [], []
        for okey in okeys:
            count, pages = objects[okey]
            dest = dict(pages)
            row = base + first[okey] * HEADER
            buffers.append([a for r in range(count)
                            for a in (row + r * HEADER, ptrs[dest[r]] if r in dest else scratch)])
            sizes.append([HEADER, pb] * count)
        try:
            rcs = list(self._store.batch_get_into_multi_buffers(okeys, buffers, sizes))
        except Exception as exc:
            logger.warning("mooncake batch_get_into_multi_buffers raised: %s", exc)
            rcs = [-1] * len(okeys)
        whole: list[int] = []
        for okey, rc in zip(okeys, rcs, strict=True):
            size = objects[okey][0] * rec
            if rc == size:
                whole += [i for _, i in objects[okey][1]]
            elif (rc == RC_BUFFER_OVERFLOW or 0 <= rc < size
                  or self._wrong_size(okey, rc, size)):
                logger.warning("mooncake object %s has the wrong size (rc=%d)", okey, rc)
                failed[okey] = "wrong size"
            elif rc != RC_OBJECT_NOT_FOUND:
                self._failed(rc)
        if whole:  # every page read whole, hashed in one call without the GIL
            sums = integrity.checksums_at([ptrs[i] for i in whole],
                                          [payloads[i] for i in whole], pb)
            arrived.update(zip(whole, sums, strict=True))

    def _checked(self, keys: list[str], arrived: dict[int, int], headers: np.ndarray,
                 first: dict[str, int], places: list[Place]) -> dict[int, str | None]:
        """Header and checksum check of every page in ``arrived``: None when good, else
        why not."""
        if not arrived:
            return {}
        pages = list(arrived)
        rows = [first[places[i][0]] + places[i][1] for i in pages]
        why = integrity.check_headers(
            headers[:(max(rows) + 1) * HEADER].reshape(-1, HEADER)[rows],
            [self.page_key_bytes(keys[i]) for i in pages], self._fp, self.config.page_bytes,
            [arrived[i] for i in pages])
        return dict(zip(pages, why, strict=True))

    def _write(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
               known: list[int | None] | None = None,
               places: list[Place] | None = None) -> list[bool]:
        """Store pages from registered memory (``ptrs``, same memory as ``payloads``;
        ``known``: their checksums where the pool has them) into their objects
        (``places``: whole objects, records in order; default one per page); objects
        that exist already are skipped."""
        places = places or [(self.object_key(k), 0, 1) for k in keys]
        results: list[bool] = []
        for lo, hi in _chunks(places):
            results += self._write_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi],
                                         None if known is None else known[lo:hi],
                                         places[lo:hi])
        return results

    def _write_chunk(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
                     known: list[int | None] | None, places: list[Place]) -> list[bool]:
        n, pb = len(keys), self.config.page_bytes
        objects = _objects(places)
        usable = self._available() and self._ensure_segment()
        arena = self._arena(n) if usable else None
        if arena is None:
            return [False] * n
        base, headers = _ptr(arena[0]), arena[1]
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

    # ---- single pages ------------------------------------------------------------------

    def get(self, key: str, target: torch.Tensor) -> bool:
        staging = self._staging_buffer()
        if staging is None:
            return False
        payload = staging[HEADER:]
        if not self._read([key], [_ptr(payload)], [payload.numpy().data])[0]:
            return False
        target.view(-1).copy_(payload)
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        staging = self._staging_buffer()
        if staging is None:
            return False
        payload = staging[HEADER:]
        payload.copy_(value.reshape(-1))
        return self._write([key], [_ptr(payload)], [payload.numpy().data])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- batches -----------------------------------------------------------------------

    def batch_exists(self, keys: list[str]) -> int:
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

    # ---- span objects (tiers/index/spans.py) -------------------------------------------

    @property
    def supports_spans(self) -> bool:
        # Slot-major pools only (the records come straight from and into pool slots).
        return self.config.mem_layout != "layer_first"

    def batch_set_spans(self, keys: list[str], host_slots: list[int],
                        spans: list[SpanRef]) -> list[bool]:
        """One object per span: its pages' records (header, payload) back to back, put
        from the header arena and the pool slots in one multi-buffer call."""
        pool = self._require_pool()
        if pool.layout == "layer_first" or not keys:
            return [False] * len(keys)
        whole = whole_spans(spans)
        rows = [i for i in range(len(keys)) if whole[i]]
        results = [False] * len(keys)
        if rows:
            slots = [host_slots[i] for i in rows]
            ptrs, payloads = self._slots(slots)
            done = self._write([keys[i] for i in rows], ptrs, payloads, pool.checksums_of(slots),
                               [self._place(spans[i]) for i in rows])
            for i, ok in zip(rows, done, strict=True):
                results[i] = ok
        return results

    def batch_get_spans(self, keys: list[str], host_slots: list[int], spans: list[SpanRef],
                        deadline: float | None = None) -> list[bool]:
        """Each page's record of its span object. Mooncake has no deadline: a batch
        runs whole (``deadline`` is not looked at)."""
        pool = self._require_pool()
        if pool.layout == "layer_first" or not keys:
            return [False] * len(keys)
        if len(keys) != len(host_slots) or len(keys) != len(spans):
            raise ValueError("keys, host_slots and spans differ in length")
        ptrs, payloads = self._slots(host_slots)
        return self._read(keys, ptrs, payloads, [self._place(span) for span in spans])

    def _place(self, span: SpanRef) -> Place:
        return self.object_key(span.key.hex()), span.index, span.count

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
            self.report.failed("remove")
            return False
        return rc == 0

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
                self._store.unregister_buffer(_ptr(buf))
        self._buffers = []
        try:
            self._store.close()
        except Exception as exc:
            logger.warning("mooncake close raised: %s", exc)
