"""File L3 backend: one checksummed file per page and rank, under a hashed fan-out, crash-safe.

Contract (on top of base.py's):
- Extra-config keys: ``FileExtraConfig`` (anything else is a
  ``StorageConfigError``). Directory: ``path``, else
  ``$HICACHE_FILE_STORAGE_DIR``, else ``/tmp/hicache``.
- Layout (tiers/l3/page_dir.py, shared with the NIXL backend): a page lives
  in ``<dir>/pages/<xx>/<object_key>.page``, ``xx``
  the first two hex digits of its page key (256 sub-directories, each made
  when a page is first renamed into it), so no directory holds more than
  about 1/256 of the pages. A file is the ``integrity`` header (page key,
  storage fingerprint, xxh3 checksum) zero-padded to ``FILE_HEADER_BYTES``
  (4 KiB), then the payload exactly as the host pool slot holds it: the
  payload starts 4 KiB aligned in the file, so page-cache copies are whole
  pages and O_DIRECT can move it straight into an aligned slot (4 KiB more
  per page on disk: 0.4% of a 1 MiB page). The header carries container
  layout ``FILE_LAYOUT`` (integrity.py ``version_of``): files of the earlier
  layout (128-byte header, flat ``pages/``) are refused as corrupt misses,
  never misread; the flat ones are never looked up, only counted towards
  the capacity (oldest, so evicted first) and removed by ``clear``.
- Span objects (``batch_set_spans`` / ``batch_get_spans``, tiers/index/spans.py;
  the GIL-free batch path only): one file per span under its span key's
  name, its pages' records (the 4 KiB header and the payload each) back to
  back, written and renamed in at once and read through one ``open``; each
  record is checked like a page file (its own key, fingerprint, checksum),
  and the file must be exactly its records long. A bad record is a miss for
  its page; the file is quarantined after the read that found it, so the
  next store writes it anew.
- Writes are atomic: the page is written to ``<dir>/tmp/`` under a name
  unique to this process and thread, then renamed into ``pages/<xx>/``. A
  reader sees the whole page or none of it; a crash leaves at most a temp
  file, removed at the next start. Files are not fsync'ed (``fsync: true``
  turns it on): after a power loss a torn page fails its checksum and is a
  miss.
- A read is one ``open``, one ``preadv`` (header, the payload straight into
  the host slot, and one byte past the end to catch a longer file), one
  ``close``, then the check (header, zero padding, xxh3 of the payload
  while it is still in the CPU cache). ``batch_get_v1`` / ``batch_set_v1``
  address pool slots through one flat view of the pool and update the
  counters and the LRU index once per batch, not per page. Where numba runs
  and slots are contiguous, a batch is one GIL-free call (native_io.py:
  reads in 256 KiB chunks, each hashed while in the CPU cache).
- ``verify`` (verify.py; default ``auto``): where those read checksums run.
  ``helper``: on a helper thread right behind the reads (chunk by chunk, the
  bytes still in the shared cache), so the reading thread only moves bytes:
  0.91-1.04x of a C reader of the same files against 0.75-0.87x inline
  (``make bench-l3``). Writes hash on the writing thread either way.
- ``direct_io`` (default ``off``): ``on`` / ``auto`` read and write with
  O_DIRECT, for NVMe or GDS-style stores much larger than the page cache.
  ``auto`` uses it where a probe at start shows the filesystem accepts it
  (else buffered, logged once); ``on`` makes a refusal a
  ``StorageConfigError``. A page goes straight between file and slot when
  the slot is 4 KiB aligned and the page a multiple of 4 KiB, else through
  an aligned per-thread bounce buffer (writes of pages that are not a
  multiple of 4 KiB stay buffered); an O_DIRECT open or read the filesystem
  refuses later falls back to buffered I/O for that page. Measured on this
  2-core VM (ext4 on a virtio disk, 1 MiB pages): of pages not in the page
  cache, O_DIRECT reads straight into 4 KiB-aligned slots (GPU hosts'
  pinned pools are page-aligned) ran at 1.0-1.3 GB/s against 0.45-0.65
  buffered, through the bounce buffer (CPU hosts' ``torch.empty`` pools
  are not aligned) no faster than buffered; pages the page cache holds it
  reads 5x slower than buffered (1.3 against 7-8 GB/s). Hence off by
  default.
- Every read checks the header, its zero padding and the checksum; a
  mismatch, a short or long file or an unreadable file is a miss, counted as corrupt, and the file is
  moved to ``<dir>/quarantine/`` for inspection (not served again). A file
  that disappears between ``exists`` and ``get`` is a plain miss.
- ``exists`` asks the filesystem, so engines (processes, hosts on a shared
  mount) sharing the directory see each other's pages at once.
- Capacity: ``capacity_gb`` (GB = 1e9 bytes; 0 = unlimited). The index of
  sizes and access order is rebuilt from ``pages/`` and its sub-directories
  at start (oldest mtime first) and kept by this instance; when a write
  would exceed the capacity, least-recently-used pages are deleted first.
  Engines sharing a directory each enforce the limit on their own view
  (pages written by another engine are counted once seen through
  ``exists``/``get``).
- Retention (``retain``: a request's ``retain_s``, an admin pin): a retained
  page, written before or after the call, is passed over by that eviction
  until its deadline (moved to the recent end instead): plain pages go
  first, even one just written by the batch path (which makes room after
  its batch; the Python path makes room before each page); only when every
  page is retained does the capacity win, oldest first. Kept per instance,
  like the index: another engine on the directory does not see it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, NonNegativeFloat

from hicache.tiers.index.spans import SpanRef, whole_spans
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import integrity, native_io
from hicache.tiers.l3.base import (
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    validate_extra,
)
from hicache.tiers.l3.page_dir import PageDirectory
from hicache.tiers.l3.verify import Verify, verify_field
from hicache.tiers.l3.verify import helpers as verify_helpers
from hicache.tiers.settings import Settings

logger = logging.getLogger(__name__)

GB = 1_000_000_000
DIR_ENV = "HICACHE_FILE_STORAGE_DIR"
DEFAULT_DIR = "/tmp/hicache"
# The integrity header, zero-padded: payloads start 4 KiB aligned in the file.
FILE_HEADER_BYTES = 4096
# integrity.py container layout of these files (1: header padded to FILE_HEADER_BYTES).
FILE_LAYOUT = 1
# Retention entries kept before the expired ones are dropped.
RETAINED_PRUNE_AT = 1 << 16
# Address and length alignment of O_DIRECT transfers (covers 512 B and 4 KiB sectors).
DIRECT_ALIGN = 4096
# Not on every platform (macOS): the probe then finds no O_DIRECT.
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
DirectIO = Literal["off", "auto", "on"]

_PADDING = bytes(FILE_HEADER_BYTES - integrity.HEADER_BYTES)
_MISSING = "missing"
_NOT_READ = "not read: past the deadline"  # neither a hit nor a miss


class FileExtraConfig(Settings):
    """The file backend's ``hicache_storage_backend_extra_config``."""

    path: str | None = Field(
        None, description=f"directory of the pages; empty or null = ${DIR_ENV}, "
        f"else {DEFAULT_DIR}")
    capacity_gb: NonNegativeFloat = Field(
        0, description="GB (1e9 bytes) the pages may take; 0 = unlimited")
    fsync: bool = Field(False, description="fsync every page file before it is renamed in")
    direct_io: DirectIO = Field(
        "off", description="O_DIRECT page I/O for NVMe / GDS-style stores larger than the "
        "page cache: off; auto = where the filesystem accepts it; on = required")
    verify: Verify = verify_field()


class _Buffers(threading.local):
    """One thread's scratch buffers (batches may run on several threads)."""

    def __init__(self) -> None:
        self.header = bytearray(FILE_HEADER_BYTES)
        self.tail = bytearray(1)
        self.direct: memoryview | None = None  # page-aligned, made on first O_DIRECT use


class FileBackend(StorageBackend):
    """Pages as files under one directory; see the module docstring."""

    # stat() per page, the index under its lock: safe on any number of threads;
    # reads open their own file descriptor.
    concurrent_lookups = True
    concurrent_io = True

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        extra = validate_extra(config.extra_config, FileExtraConfig, "file")
        path = extra.path or os.environ.get(DIR_ENV) or DEFAULT_DIR
        self.dir = PageDirectory(path, ".page", config.key_suffix,
                                 "hicache_storage_backend_extra_config.path")
        self.root, self.pages_dir = self.dir.root, self.dir.pages_dir
        self.tmp_dir, self.quarantine_dir = self.dir.tmp_dir, self.dir.quarantine_dir
        self.capacity_bytes = int(extra.capacity_gb * GB)
        self.fsync = extra.fsync
        self._fingerprint = config.fingerprint
        self._pages = self.dir.pages
        self._page_bytes = config.page_bytes
        self._file_bytes = FILE_HEADER_BYTES + config.page_bytes
        self._buffers = _Buffers()
        self._pool_view: memoryview | None = None  # flat bytes of the pool, slot-major
        self._pool_addr = 0
        # The same bytes for the GIL-free batch path (native_io.py), when it runs here.
        self._pool_np: np.ndarray | None = None
        self.direct_io = self._probe_direct(extra.direct_io)
        self.verify: Verify = extra.verify
        self._verify_helper: ThreadPoolExecutor | None = None
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU order
        self._index_bytes = 0
        self._index_lock = threading.Lock()
        self._retained: dict[str, float] = {}  # file name -> keep until (epoch seconds)
        self._rebuild_index()

    # ---- O_DIRECT ----------------------------------------------------------------

    def _probe_direct(self, mode: DirectIO) -> bool:
        """Whether pages use O_DIRECT: ``mode`` and what the filesystem accepts."""
        if mode == "off":
            return False
        probe = self.tmp_dir / f"direct-probe.{os.getpid()}.{threading.get_ident()}.tmp"
        block = mmap.mmap(-1, DIRECT_ALIGN)
        try:
            if not _O_DIRECT:
                raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
            try:
                if os.pwrite(fd, block, 0) != DIRECT_ALIGN:
                    raise OSError(errno.EIO, "short O_DIRECT write")
                os.preadv(fd, [block], 0)
            finally:
                os.close(fd)
        except OSError as exc:
            if mode == "on":
                raise StorageConfigError(
                    f"hicache_storage_backend_extra_config.direct_io='on' but "
                    f"{self.root} does not accept O_DIRECT ({exc}); allowed values: "
                    "'off', 'auto' (O_DIRECT where accepted), 'on'") from None
            logger.info("HiCache file L3: %s does not accept O_DIRECT (%s); buffered I/O",
                        self.root, exc)
            return False
        finally:
            probe.unlink(missing_ok=True)
            block.close()
        return True

    def _direct_buffer(self, buffers: _Buffers) -> memoryview:
        """This thread's page-aligned bounce buffer: header, payload, one block past it."""
        if buffers.direct is None:
            size = FILE_HEADER_BYTES + _round_up(self._page_bytes) + DIRECT_ALIGN
            buffers.direct = memoryview(mmap.mmap(-1, size))
        return buffers.direct

    # ---- index ------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index existing pages oldest first."""
        entries = []
        for name, path in self.dir.page_files():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, name, st.st_size))
        with self._index_lock:
            self._index.clear()
            self._index_bytes = 0
            for _, name, size in sorted(entries):
                self._index[name] = size
                self._index_bytes += size

    def _touch(self, name: str, size: int) -> None:
        with self._index_lock:
            old = self._index.pop(name, None)
            self._index_bytes += size - (old or 0)
            self._index[name] = size

    def _touch_all(self, names: list[str]) -> None:
        """``_touch`` of whole pages, under one lock."""
        if not names:
            return
        size = self._file_bytes
        with self._index_lock:
            index = self._index
            for name in names:
                old = index.pop(name, None)
                self._index_bytes += size - (old or 0)
                index[name] = size

    def _forget(self, name: str) -> None:
        with self._index_lock:
            self._retained.pop(name, None)
            size = self._index.pop(name, None)
            if size is not None:
                self._index_bytes -= size

    def retain(self, keys: list[str], until: float) -> int:
        with self._index_lock:
            for key in keys:
                if until > 0:
                    name = self._name(key)
                    self._retained[name] = max(until, self._retained.get(name, 0.0))
                else:
                    self._retained.pop(self._name(key), None)
            if len(self._retained) > RETAINED_PRUNE_AT:
                now = time.time()
                self._retained = {n: t for n, t in self._retained.items() if t > now}
        return len(keys) if until > 0 else 0

    def _make_room(self, need: int) -> None:
        if not self.capacity_bytes:
            return
        now = time.time()
        passes = len(self._index)  # retained pages passed over at most once each
        while True:
            with self._index_lock:
                if self._index_bytes + need <= self.capacity_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                if passes > 0 and self._retained.get(name, 0.0) > now:
                    passes -= 1
                    self._index[name] = size  # kept: to the recent end
                    continue
                self._retained.pop(name, None)
                self._index_bytes -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._pages + name)
            self.report.evicted(1)

    @property
    def used_bytes(self) -> int:
        return self._index_bytes

    def _name(self, key: str) -> str:
        """``key``'s file, relative to ``pages_dir``: ``<xx>/<object_key>.page``."""
        return self.dir.name(key)

    def page_path(self, key: str) -> Path:
        """The file that holds page ``key`` (whether or not it exists)."""
        return self.pages_dir / self._name(key)

    # ---- host pool ------------------------------------------------------------------

    def register_host_pool(self, pool: HostPagePool) -> None:
        super().register_host_pool(pool)
        # Layouts whose slots are contiguous (page_first, page_first_direct): slot s is
        # bytes [s * page_bytes, (s + 1) * page_bytes) of the buffer.
        buf = pool.buffer
        if pool.page_view(0) is not None and buf.is_contiguous():
            self._pool_view = buf.view(-1).numpy().data.cast("B")
            self._pool_addr = buf.data_ptr()
        else:
            self._pool_view = None
        self._pool_np = None
        if self._pool_view is not None and not self.direct_io and native_io.available():
            native_io.warm_up()  # compile now, not in the first fetch
            self._pool_np = np.frombuffer(self._pool_view, np.uint8)
            if self._verify_helper is None:
                self._verify_helper = verify_helpers(self.verify, pool)

    # ---- SGLang interface ------------------------------------------------------

    def exists(self, key: str) -> bool:
        name = self._name(key)
        try:
            size = os.stat(self._pages + name).st_size
        except OSError:
            self._forget(name)
            return False
        self._touch(name, size)
        return True

    def get(self, key: str, target: torch.Tensor) -> bool:
        payload = target.numpy().data.cast("B")
        return self._read_pages([key], [(payload, target.data_ptr())])[0]

    def set(self, key: str, value: torch.Tensor) -> bool:
        payload = value.numpy().data.cast("B")
        return self._write_pages([key], [(payload, value.data_ptr())])[0]

    @property
    def timed_batches(self) -> bool:
        # The GIL-free path reads up to a deadline; a subclass with its own
        # batch_get_v1 is asked the SGLang way.
        return self._pool_np is not None and type(self).batch_get_v1 is FileBackend.batch_get_v1

    def batch_get_until(self, keys: list[str], host_slots: list[int],
                        deadline: float | None) -> list[bool]:
        """``batch_get_v1`` that starts no page after ``deadline``
        (``time.monotonic()`` seconds): those are False, not misses. Only while
        ``timed_batches``."""
        self._require_pool()
        assert self._pool_np is not None, "batch_get_until needs timed_batches"
        return self._read_slots_native(keys, host_slots, deadline)

    def batch_get_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        self._require_pool()
        if self._pool_np is not None:  # the whole batch without the GIL
            return self._read_slots_native(keys, host_slots)
        if self._pool_view is None:  # layer_first: through a staging page each
            return super().batch_get_v1(keys, host_slots)
        return self._read_pages(keys, self._slot_views(host_slots))

    def batch_set_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        self._require_pool()
        if self._pool_np is not None:
            return self._write_slots_native(keys, host_slots)
        if self._pool_view is None:
            return super().batch_set_v1(keys, host_slots)
        return self._write_pages(keys, self._slot_views(host_slots))

    # ---- span objects (tiers/index/spans.py) -----------------------------------------

    @property
    def supports_spans(self) -> bool:
        # Through the GIL-free batch path only: contiguous slots, buffered I/O. A worker
        # whose pool is not contiguous answers False per page (stored page by page).
        return (self.config.mem_layout != "layer_first" and not self.direct_io
                and native_io.available())

    def _span_rows(self, spans: list[SpanRef]) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Each page's span file name, record offset and the file's size."""
        names = [self._name(span.key.hex()) for span in spans]
        rec = self._file_bytes
        bases = np.array([span.index * rec for span in spans], np.int64)
        ends = np.array([span.count * rec for span in spans], np.int64)
        return names, bases, ends

    def batch_set_spans(self, keys: list[str], host_slots: list[int],
                        spans: list[SpanRef]) -> list[bool]:
        """One file per span: its pages' records (header padded to 4 KiB, payload)
        back to back, written to ``tmp/`` and renamed in once."""
        self._require_pool()
        if self._pool_np is None or not keys:
            return [False] * len(keys)
        whole = whole_spans(spans)
        rows = [i for i in range(len(keys)) if whole[i]]
        results = [False] * len(keys)
        if not rows:
            return results
        keys_r = [keys[i] for i in rows]
        spans_r = [spans[i] for i in rows]
        names, bases, _ = self._span_rows(spans_r)
        for name in dict.fromkeys(names):
            self.dir.make_dir(name)
        suffix = self.dir.temp_suffix()
        headers = integrity.header_rows([self.page_key_bytes(k) for k in keys_r],
                                        self._fingerprint, self._page_bytes,
                                        layout=FILE_LAYOUT, width=FILE_HEADER_BYTES)
        last = np.array([s.index == s.count - 1 for s in spans_r], np.uint8)
        status = native_io.write_pages(
            native_io.path_rows([self.dir.temp_path(n, suffix) for n in names]),
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [host_slots[i] * self._page_bytes for i in rows], self._page_bytes, headers,
            integrity.CHECKSUM_AT, self.fsync, skip_existing=True, bases=bases, last=last)
        skipped = failed = 0
        for j, code in enumerate(status.tolist()):
            ok = code in (native_io.OK, native_io.SKIPPED)
            results[rows[j]] = ok
            skipped += code == native_io.SKIPPED
            failed += not ok
            if ok and last[j]:
                self._touch(names[j], spans_r[j].count * self._file_bytes)
        if failed:
            logger.warning("HiCache file L3: writing %d pages in span files failed; they "
                           "are stored page by page", failed)
        self._make_room(0)
        self.report.skipped(skipped)
        return results

    def batch_get_spans(self, keys: list[str], host_slots: list[int], spans: list[SpanRef],
                        deadline: float | None = None) -> list[bool]:
        """Each page's record of its span file, through one ``open`` per file and
        every check of ``batch_get_v1``. A bad record is a miss for its page; the
        file is then quarantined after this read (the good records of it were
        served), so the next store writes it anew."""
        self._require_pool()
        if self._pool_np is None or not keys:
            return [False] * len(keys)
        names, bases, ends = self._span_rows(spans)
        return self._read_slots_native(keys, host_slots, deadline, names=names,
                                       records=(bases, ends))

    def _slot_views(self, slots: list[int]) -> list[tuple[memoryview, int]]:
        view, base, size = self._pool_view, self._pool_addr, self._page_bytes
        assert view is not None
        return [(view[s * size:(s + 1) * size], base + s * size) for s in slots]

    # ---- reads ------------------------------------------------------------------------

    def _read_pages(self, keys: list[str], targets: list[tuple[memoryview, int]]) -> list[bool]:
        """Read and verify each page into its (view, address); index and report once."""
        buffers = self._buffers
        problems = [self._read_one(self._name(key), key, payload, addr, buffers)
                    for key, (payload, addr) in zip(keys, targets, strict=True)]
        return self._settle_reads(keys, problems)

    def _read_slots_native(self, keys: list[str], slots: list[int],
                           deadline: float | None = None, names: list[str] | None = None,
                           records: tuple[np.ndarray, np.ndarray] | None = None,
                           ) -> list[bool]:
        """``_read_pages`` into pool slots: reads and every check in one GIL-free call.
        ``names`` and ``records``: the pages are records of span files (their names,
        record offsets and file sizes)."""
        assert self._pool_np is not None
        names = names or [self._name(key) for key in keys]
        page_keys = [self.page_key_bytes(k) for k in keys]
        headers = np.empty((len(keys), FILE_HEADER_BYTES), np.uint8)
        expect = integrity.header_rows(page_keys, self._fingerprint, self._page_bytes,
                                       layout=FILE_LAYOUT, width=integrity.CHECKSUM_AT)
        bases, ends = records if records is not None else (None, None)
        status, sizes = native_io.read_pages(
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [s * self._page_bytes for s in slots], FILE_HEADER_BYTES, self._page_bytes,
            headers, expect, integrity.HEADER_BYTES, deadline, self._verify_helper,
            bases=bases, ends=ends)
        problems: list[str | None] = []
        for i, code in enumerate(status.tolist()):
            if code == native_io.OK:
                problems.append(None)
            elif code == native_io.NOT_READ:
                problems.append(_NOT_READ)
            elif code == native_io.MISSING:
                # Rare: tell a missing file from one that cannot be opened.
                exists = os.path.exists(self._pages + names[i])
                problems.append("unreadable: open failed" if exists else _MISSING)
            elif code == native_io.UNREADABLE:
                problems.append("unreadable: read failed")
            elif code == native_io.WRONG_SIZE:
                problems.append(f"wrong size ({int(sizes[i])} bytes read)")
            elif code == native_io.BAD_PADDING:
                problems.append("header padding is not zero")
            elif code == native_io.BAD_CHECKSUM:
                problems.append("checksum mismatch")
            else:  # the header's own words for which field differs
                problems.append(integrity.verify(
                    bytes(headers[i, :integrity.HEADER_BYTES]), page_keys[i],
                    self._fingerprint, b"", layout=FILE_LAYOUT) or "header mismatch")
        if records is not None:
            return self._settle_reads(keys, problems, names, records[1])
        return self._settle_reads(keys, problems, names)

    def _settle_reads(self, keys: list[str], problems: list[str | None],
                      names: list[str] | None = None,
                      sizes: np.ndarray | None = None) -> list[bool]:
        """Index, quarantine and report for a batch of reads (None: verified);
        ``sizes``: the files' sizes, where they are span files (several pages each;
        a file with a bad record is quarantined once its good records were read)."""
        results: list[bool] = []
        hits: dict[str, int] = {}
        bad: dict[str, str] = {}
        corrupt = not_read = 0
        for i, (key, problem) in enumerate(zip(keys, problems, strict=True)):
            name = names[i] if names is not None else self._name(key)
            if problem is None:
                hits[name] = self._file_bytes if sizes is None else int(sizes[i])
                results.append(True)
                continue
            results.append(False)
            if problem == _NOT_READ:
                not_read += 1
                continue
            if problem == _MISSING:
                self._forget(name)
            else:
                corrupt += 1
                bad.setdefault(name, f"page {key[:16]}: {problem}")
        for name, problem in bad.items():
            hits.pop(name, None)
            self._quarantine(name, problem)
        if sizes is None:
            self._touch_all(list(hits))
        else:
            for name, size in hits.items():
                self._touch(name, size)
        self.report.corrupt(corrupt)
        self.report.not_started(not_read)
        return results

    def _read_one(self, name: str, key: str, payload: memoryview, addr: int,
                  buffers: _Buffers) -> str | None:
        """Read page ``name`` into ``payload``: None when verified, ``_MISSING`` when
        there is no such file, else why it is corrupt."""
        header: memoryview | bytearray
        if self.direct_io:
            got = self._read_direct(name, payload, addr, buffers)
        else:
            got = None
        if got is None:
            header = buffers.header
            try:
                fd = os.open(self._pages + name, os.O_RDONLY)
            except FileNotFoundError:
                return _MISSING
            except OSError as exc:
                return f"unreadable: {exc}"
            try:
                size = os.preadv(fd, [header, payload, buffers.tail], 0)
            except OSError as exc:
                return f"unreadable: {exc}"
            finally:
                os.close(fd)
        else:
            size, header = got
            if size < 0:
                return _MISSING
        if size != self._file_bytes:
            return f"wrong size ({size} bytes read)"
        problem = integrity.verify(header, self.page_key_bytes(key), self._fingerprint,
                                   payload, layout=FILE_LAYOUT)
        if problem is None and header[integrity.HEADER_BYTES:] != _PADDING:
            problem = "header padding is not zero"
        return problem

    def _read_direct(self, name: str, payload: memoryview, addr: int,
                     buffers: _Buffers) -> tuple[int, memoryview] | None:
        """(bytes read, header) through O_DIRECT, (-1, _) when there is no file, None
        when the filesystem refused it (the caller reads buffered)."""
        scratch = self._direct_buffer(buffers)
        header = scratch[:FILE_HEADER_BYTES]
        try:
            fd = os.open(self._pages + name, os.O_RDONLY | _O_DIRECT)
        except FileNotFoundError:
            return -1, header
        except OSError:
            return None
        size = self._page_bytes
        straight = addr % DIRECT_ALIGN == 0 and size % DIRECT_ALIGN == 0
        try:
            if straight:  # header, payload into the slot, one block past the end
                tail = scratch[FILE_HEADER_BYTES + size:FILE_HEADER_BYTES + size + DIRECT_ALIGN]
                got = os.preadv(fd, [header, payload, tail], 0)
            else:  # all of it into the bounce buffer, then the payload into the slot
                got = os.preadv(fd, [scratch], 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        if not straight and got == self._file_bytes:
            payload[:] = scratch[FILE_HEADER_BYTES:FILE_HEADER_BYTES + size]
        return got, header

    # ---- writes -------------------------------------------------------------------------

    def _write_pages(self, keys: list[str], values: list[tuple[memoryview, int]]) -> list[bool]:
        """Store each (view, address) as its page unless it exists; index and report once."""
        buffers = self._buffers
        results: list[bool] = []
        stored: list[str] = []
        skipped = failed = 0
        for key, (payload, addr) in zip(keys, values, strict=True):
            name = self._name(key)
            path = self._pages + name
            if os.path.exists(path):
                skipped += 1
                stored.append(name)
                results.append(True)
                continue
            header = integrity.pack_header(self.page_key_bytes(key), self._fingerprint,
                                           payload, layout=FILE_LAYOUT)
            self._make_room(self._file_bytes)
            error = self._write_one(name, path, header, payload, addr, buffers)
            if error is None:
                stored.append(name)
                results.append(True)
            else:
                logger.warning("HiCache file L3: writing page %s failed: %s", key[:16], error)
                failed += 1
                results.append(False)
        self._touch_all(stored)
        self._report_writes(skipped, failed)
        return results

    def _write_slots_native(self, keys: list[str], slots: list[int]) -> list[bool]:
        """``_write_pages`` from pool slots: every page not stored yet checksummed,
        written and renamed in, in one GIL-free call. Room is made after the batch (the
        pages just written are the most recent): a capacity may be exceeded by one
        batch while it is written."""
        assert self._pool_np is not None
        names = [self._name(key) for key in keys]
        suffix = self.dir.temp_suffix()
        headers = integrity.header_rows([self.page_key_bytes(k) for k in keys],
                                        self._fingerprint, self._page_bytes,
                                        layout=FILE_LAYOUT, width=FILE_HEADER_BYTES)
        status = native_io.write_pages(
            native_io.path_rows([self.dir.temp_path(n, suffix) for n in names]),
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [s * self._page_bytes for s in slots], self._page_bytes, headers,
            integrity.CHECKSUM_AT, self.fsync, skip_existing=True)
        results: list[bool] = []
        stored: list[str] = []
        skipped = failed = 0
        for i, code in enumerate(status.tolist()):
            error = None
            if code == native_io.RENAME_FAILED:  # first page of its sub-directory
                offset = slots[i] * self._page_bytes
                view = self._pool_view
                assert view is not None
                error = self._write_one(names[i], self._pages + names[i],
                                        bytes(headers[i, :integrity.HEADER_BYTES]),
                                        view[offset:offset + self._page_bytes],
                                        self._pool_addr + offset, self._buffers)
            elif code == native_io.SKIPPED:
                skipped += 1
            elif code != native_io.OK:
                error = "write failed" if code == native_io.WRITE_FAILED \
                    else "could not create the temp file"
            if error is None:
                stored.append(names[i])
            else:
                logger.warning("HiCache file L3: writing page %s failed: %s", keys[i][:16],
                               error)
                failed += 1
            results.append(error is None)
        self._touch_all(stored)
        self._make_room(0)
        self._report_writes(skipped, failed)
        return results

    def _report_writes(self, skipped: int, failed: int) -> None:
        self.report.skipped(skipped)
        if failed:
            self.report.failed(f"{failed} page writes", count=failed)

    def _write_one(self, name: str, path: str, header: bytes, payload: memoryview, addr: int,
                   buffers: _Buffers) -> str | None:
        """Write the page to a temp file and rename it in; None on success, else the error."""
        tmp = self.dir.temp_path(name)
        try:
            if not (self.direct_io and self._write_direct(tmp, header, payload, addr, buffers)):
                self._write_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                 [header, _PADDING, payload])
            try:
                os.replace(tmp, path)
            except FileNotFoundError:  # first page of its sub-directory
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            return str(exc)
        return None

    def _write_file(self, tmp: str, flags: int, chunks: list[Any]) -> None:
        fd = os.open(tmp, flags, 0o644)
        try:
            want = sum(len(c) for c in chunks)
            done = os.writev(fd, chunks)
            if done != want:
                raise OSError(errno.EIO, f"short write ({done} of {want} bytes)")
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _write_direct(self, tmp: str, header: bytes, payload: memoryview, addr: int,
                      buffers: _Buffers) -> bool:
        """Write ``tmp`` with O_DIRECT; False when the page or filesystem does not allow
        it (the caller writes buffered)."""
        size = self._page_bytes
        if size % DIRECT_ALIGN:
            return False
        scratch = self._direct_buffer(buffers)
        scratch[:integrity.HEADER_BYTES] = header
        scratch[integrity.HEADER_BYTES:FILE_HEADER_BYTES] = _PADDING
        if addr % DIRECT_ALIGN == 0:
            chunks = [scratch[:FILE_HEADER_BYTES], payload]
        else:
            scratch[FILE_HEADER_BYTES:FILE_HEADER_BYTES + size] = payload
            chunks = [scratch[:FILE_HEADER_BYTES + size]]
        try:
            self._write_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, chunks)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return False
        return True

    # ---- maintenance -----------------------------------------------------------------

    def delete(self, key: str) -> bool:
        name = self._name(key)
        self._forget(name)
        try:
            os.unlink(self._pages + name)
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> None:
        self.dir.clear()
        with self._index_lock:
            self._index.clear()
            self._index_bytes = 0
            self._retained.clear()

    def close(self) -> None:
        # Reads whose helper job is cancelled checksum their pages themselves.
        if self._verify_helper is not None:
            self._verify_helper.shutdown(wait=False, cancel_futures=True)
            self._verify_helper = None

    # ---- helpers ----------------------------------------------------------------

    def _quarantine(self, name: str, reason: str) -> None:
        """Move a corrupt page aside (the caller reports it)."""
        self._forget(name)
        self.dir.quarantine(name, reason)


def _round_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
