"""File L3 backend: one checksummed file per page and rank, under a hashed fan-out, crash-safe.

Contract (on top of base.py's):
- Extra-config keys: ``FileExtraConfig`` (anything else is a
  ``StorageConfigError``). Directory: ``path``, else
  ``$HICACHE_FILE_STORAGE_DIR``, else ``/tmp/hicache``.
- Layout (tiers/l3/page_dir.py, shared with the NIXL backend): a page lives
  in ``<dir>/pages/<xx>/<object_key>.page``, ``xx`` the first two hex
  digits of its page key. A file is page_io.py's record: the ``integrity``
  header padded to 4 KiB, then the payload exactly as the host pool slot
  holds it. Files of another container layout are refused as corrupt
  misses, never misread.
- Span objects (batches with ``spans``, tiers/index/spans.py; the GIL-free
  batch path only): one file per span under its span key's
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
  the host slot, one byte past the end to catch a longer file), one
  ``close``, then the check. A batch updates the LRU index once. Where numba
  runs and slots are contiguous, a batch is one GIL-free call (native_io.py).
- ``verify`` (verify.py; default ``auto``): where those read checksums run.
  ``helper``: on a helper thread right behind the reads (chunk by chunk, the
  bytes still in the shared cache), so the reading thread only moves bytes.
  Writes hash on the writing thread either way.
- ``direct_io`` (default ``off``): ``on`` / ``auto`` read and write with
  O_DIRECT (page_io.py), for NVMe or GDS-style stores much larger than the
  page cache; ``auto`` where a probe at start shows the filesystem accepts
  it, ``on`` makes a refusal a ``StorageConfigError``. Pages the page cache
  holds it reads several times slower than buffered (docs/benchmarks-l3.md),
  hence off by default. With 4 KiB aligned slots and pages the batch path
  (spans, deadlines) runs with O_DIRECT too; a page it cannot move that way is
  retried in Python, which falls back to buffered I/O.
- Every read checks the header, its zero padding and the checksum; a
  mismatch, a short or long file or an unreadable file is a miss, counted as
  corrupt, and the file is moved to ``<dir>/quarantine/`` for inspection (not served again). A file
  that disappears between a lookup and a read is a plain miss.
- ``exists_prefix`` asks the filesystem, so engines (processes, hosts on a shared
  mount) sharing the directory see each other's pages at once.
- Capacity: ``capacity_gb`` (GB = 1e9 bytes; 0 = unlimited) and retention
  (``retain``), kept by capacity.py's ``PageIndex``, rebuilt from the
  directory at start: least-recently-used pages are deleted first when a
  write would exceed the capacity (the batch path makes room after its
  batch, the Python path before each page). Per instance: engines sharing a
  directory each enforce the limit and their retention on their own view.
- Layouts whose slots are not contiguous (``layer_first``) go through a
  staging page per page.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

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
    WriteBatch,
    validate_extra,
)
from hicache.tiers.l3.file import page_io
from hicache.tiers.l3.file.capacity import PageIndex
from hicache.tiers.l3.file.config import DEFAULT_DIR, DIR_ENV, GB, FileExtraConfig
from hicache.tiers.l3.file.page_io import (
    FILE_HEADER_BYTES,
    FILE_LAYOUT,
    MISSING,
    Buffers,
)
from hicache.tiers.l3.page_dir import PAGE_EXT, PageDirectory
from hicache.tiers.l3.verify import Verify
from hicache.tiers.l3.verify import helpers as verify_helpers

logger = logging.getLogger(__name__)

_NOT_READ = "not read: past the deadline"  # neither a hit nor a miss


class FileBackend(StorageBackend):
    """Pages as files under one directory; see the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        extra = validate_extra(config.extra_config, FileExtraConfig, "file")
        path = extra.path or os.environ.get(DIR_ENV) or DEFAULT_DIR
        self.dir = PageDirectory(path, PAGE_EXT, config.key_suffix,
                                 "hicache_storage_backend_extra_config.path")
        self.root, self.pages_dir = self.dir.root, self.dir.pages_dir
        self.tmp_dir, self.quarantine_dir = self.dir.tmp_dir, self.dir.quarantine_dir
        self.capacity_bytes = int(extra.capacity_gb * GB)
        self.fsync = extra.fsync
        self._fingerprint = config.fingerprint
        self._pages = self.dir.pages
        self._page_bytes = config.page_bytes
        self._file_bytes = FILE_HEADER_BYTES + config.page_bytes
        self._buffers = Buffers()
        self._pool_view: memoryview | None = None  # flat bytes of the pool, slot-major
        self._pool_addr = 0
        self._native_direct = False  # the batch path opens files with O_DIRECT
        # The same bytes for the GIL-free batch path (native_io.py), when it runs here.
        self._pool_np: np.ndarray | None = None
        self.direct_io = page_io.probe(self.tmp_dir, extra.direct_io)
        self.verify: Verify = extra.verify
        self._verify_helper: ThreadPoolExecutor | None = None
        self.index = PageIndex(self._pages, self.capacity_bytes, self.report_evicted)
        self.index.rebuild(self.dir.page_files())
        # stat() per page, the index under its lock: safe on any number of threads; reads
        # open their own file descriptor. Span files and deadlines need the GIL-free batch
        # path: contiguous slots (not layer_first), with O_DIRECT 4 KiB aligned ones, which
        # register_host_pool settles.
        self._contiguous = config.mem_layout != "layer_first"
        self.capabilities = Capabilities(concurrent_lookups=True, concurrent_io=True,
                                         spans=self._contiguous and native_io.available())

    def report_evicted(self, pages: int) -> None:
        self.report.evicted(pages)

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def retain(self, keys: Sequence[str], until: float) -> int:
        return self.index.retain([self._name(key) for key in keys], until)

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
        self._native_direct = self.direct_io and self._pool_view is not None and \
            native_io.direct_ok(self._pool_addr, self._page_bytes)
        if (self._pool_view is not None and native_io.available()
                and (not self.direct_io or self._native_direct)):
            native_io.warm_up()  # compile now, not in the first fetch
            self._pool_np = np.frombuffer(self._pool_view, np.uint8)
            if self._verify_helper is None:
                self._verify_helper = verify_helpers(self.verify, pool)
        native = self._pool_np is not None
        self.capabilities = replace(self.capabilities, timed=native,
                                    spans=self._contiguous and native)

    # ---- the verbs ------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            name = self._name(key)
            try:
                size = os.stat(self._pages + name).st_size
            except OSError:
                self.index.forget(name)
                return i
            self.index.touch(name, size)
        return len(keys)

    def read(self, batch: ReadBatch) -> list[bool]:
        self._require_pool()
        keys, slots = list(batch.keys), list(batch.slots)
        if batch.spans is not None:
            if self._pool_np is None or not keys:
                return [False] * len(keys)
            names, bases, ends = self._span_rows(list(batch.spans))
            return self._read_slots_native(keys, slots, batch.deadline, names=names,
                                           records=(bases, ends))
        if self._pool_np is not None:  # the whole batch without the GIL
            return self._read_slots_native(keys, slots, batch.deadline)
        if self._pool_view is not None:
            return self._read_pages(keys, self._slot_views(slots))
        staging = torch.empty(self._page_bytes, dtype=torch.uint8)  # layer_first
        view = self._tensor_view(staging)
        return self._read_staged(keys, slots, staging,
                                 lambda key: self._read_pages([key], [view])[0])

    def write(self, batch: WriteBatch) -> list[bool]:
        pool = self._require_pool()
        keys, slots = list(batch.keys), list(batch.slots)
        if batch.spans is not None:
            return self._write_spans(keys, slots, list(batch.spans))
        if self._pool_np is not None:
            return self._write_slots_native(keys, slots)
        if self._pool_view is not None:
            return self._write_pages(keys, self._slot_views(slots))
        return self._write_pages(keys, [self._tensor_view(pool.read_page(slot).contiguous())
                                        for slot in slots])

    @staticmethod
    def _tensor_view(t: torch.Tensor) -> tuple[memoryview, int]:
        return t.numpy().data.cast("B"), t.data_ptr()

    # ---- span objects (tiers/index/spans.py) -----------------------------------------

    def _span_rows(self, spans: list[SpanRef]) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Each page's span file name, record offset and the file's size."""
        names = [self._name(span.key.hex()) for span in spans]
        rec = self._file_bytes
        bases = np.array([span.index * rec for span in spans], np.int64)
        ends = np.array([span.count * rec for span in spans], np.int64)
        return names, bases, ends

    def _write_spans(self, keys: list[str], host_slots: list[int],
                     spans: list[SpanRef]) -> list[bool]:
        """One file per span: its pages' records (header padded to 4 KiB, payload)
        back to back, written to ``tmp/`` and renamed in once."""
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
        headers = self._header_rows(keys_r)
        last = np.array([s.index == s.count - 1 for s in spans_r], np.uint8)
        status = native_io.write_pages(
            native_io.path_rows([self.dir.temp_path(n, suffix) for n in names]),
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [host_slots[i] * self._page_bytes for i in rows], self._page_bytes, headers,
            integrity.CHECKSUM_AT, self.fsync, skip_existing=True, bases=bases, last=last,
            direct=self._native_direct)
        skipped = failed = 0
        for j, code in enumerate(status.tolist()):
            ok = code in (native_io.OK, native_io.SKIPPED)
            results[rows[j]] = ok
            skipped += code == native_io.SKIPPED
            failed += not ok
            if ok and last[j]:
                self.index.touch(names[j], spans_r[j].count * self._file_bytes)
        if failed:
            logger.warning("HiCache file L3: writing %d pages in span files failed; they "
                           "are stored page by page", failed)
        self.index.make_room(0)
        self.report.skipped(skipped)
        return results

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
        headers = native_io.aligned_rows(len(keys), FILE_HEADER_BYTES)  # O_DIRECT-ready
        expect = integrity.header_rows(page_keys, self._fingerprint, self._page_bytes,
                                       layout=FILE_LAYOUT, width=integrity.CHECKSUM_AT)
        bases, ends = records if records is not None else (None, None)
        status, sizes = native_io.read_pages(
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [s * self._page_bytes for s in slots], FILE_HEADER_BYTES, self._page_bytes,
            headers, expect, integrity.HEADER_BYTES, deadline, self._verify_helper,
            bases=bases, ends=ends, direct=self._native_direct)
        problems: list[str | None] = []
        for i, code in enumerate(status.tolist()):
            if code == native_io.NOT_READ:
                problems.append(_NOT_READ)
            elif code != native_io.MISSING:
                problems.append(page_io.batch_problem(
                    code, int(sizes[i]), bytes(headers[i, :integrity.HEADER_BYTES]),
                    page_keys[i], self._fingerprint))
            # Rare: tell a missing file from one that cannot be opened (a page file
            # O_DIRECT could not open is read again in Python, buffered if need be).
            elif not os.path.exists(self._pages + names[i]):
                problems.append(MISSING)
            elif self._native_direct and records is None:
                (payload, addr), = self._slot_views([slots[i]])
                problems.append(self._read_one(names[i], keys[i], payload, addr,
                                               self._buffers))
            else:
                problems.append("unreadable: open failed")
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
            if problem == MISSING:
                self.index.forget(name)
            else:
                corrupt += 1
                bad.setdefault(name, f"page {key[:16]}: {problem}")
        for name, problem in bad.items():
            hits.pop(name, None)
            self._quarantine(name, problem)
        if sizes is None:
            self.index.touch_all(list(hits), self._file_bytes)
        else:
            for name, size in hits.items():
                self.index.touch(name, size)
        self.report.corrupt(corrupt)
        self.report.not_started(not_read)
        return results

    def _read_one(self, name: str, key: str, payload: memoryview, addr: int,
                  buffers: Buffers) -> str | None:
        """Read page ``name`` into ``payload``: None when verified, ``MISSING`` when
        there is no such file, else why it is corrupt."""
        return page_io.read_page(self._pages + name, self.page_key_bytes(key),
                                 self._fingerprint, payload, addr, self._page_bytes,
                                 buffers, self.direct_io)

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
            self.index.make_room(self._file_bytes)
            error = self._write_one(name, path, header, payload, addr, buffers)
            if error is None:
                stored.append(name)
                results.append(True)
            else:
                logger.warning("HiCache file L3: writing page %s failed: %s", key[:16], error)
                failed += 1
                results.append(False)
        self.index.touch_all(stored, self._file_bytes)
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
        headers = self._header_rows(keys)
        status = native_io.write_pages(
            native_io.path_rows([self.dir.temp_path(n, suffix) for n in names]),
            native_io.path_rows([self._pages + n for n in names]), self._pool_np,
            [s * self._page_bytes for s in slots], self._page_bytes, headers,
            integrity.CHECKSUM_AT, self.fsync, skip_existing=True,
            direct=self._native_direct)
        results: list[bool] = []
        stored: list[str] = []
        skipped = failed = 0
        # Retried in Python: no sub-directory yet; with O_DIRECT, refused (-> buffered).
        retry = {native_io.RENAME_FAILED}
        if self._native_direct:
            retry |= {native_io.OPEN_FAILED, native_io.WRITE_FAILED}
        for i, code in enumerate(status.tolist()):
            error = None
            if code in retry:
                (payload, addr), = self._slot_views([slots[i]])
                header = integrity.pack_header(self.page_key_bytes(keys[i]),
                                               self._fingerprint, payload,
                                               layout=FILE_LAYOUT)
                error = self._write_one(names[i], self._pages + names[i], header, payload,
                                        addr, self._buffers)
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
        self.index.touch_all(stored, self._file_bytes)
        self.index.make_room(0)
        self._report_writes(skipped, failed)
        return results

    def _header_rows(self, keys: list[str]) -> np.ndarray:
        return page_io.header_rows([self.page_key_bytes(k) for k in keys],
                                   self._fingerprint, self._page_bytes, self._native_direct)

    def _report_writes(self, skipped: int, failed: int) -> None:
        self.report.skipped(skipped)
        if failed:
            self.report.failed(f"{failed} page writes", count=failed)

    def _write_one(self, name: str, path: str, header: bytes, payload: memoryview, addr: int,
                   buffers: Buffers) -> str | None:
        """Write the page to a temp file and rename it in; None on success, else the error."""
        return page_io.write_page(self.dir.temp_path(name), path, header, payload, addr,
                                  self._page_bytes, buffers, self.direct_io, self.fsync)

    # ---- maintenance -----------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        for key in keys:
            name = self._name(key)
            self.index.forget(name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._pages + name)
                deleted += 1
        return deleted

    def clear(self) -> None:
        self.dir.clear()
        self.index.clear()

    def close(self) -> None:
        # Reads whose helper job is cancelled checksum their pages themselves.
        if self._verify_helper is not None:
            self._verify_helper.shutdown(wait=False, cancel_futures=True)
            self._verify_helper = None

    # ---- helpers ----------------------------------------------------------------

    def _quarantine(self, name: str, reason: str) -> None:
        """Move a corrupt page aside (the caller reports it)."""
        self.index.forget(name)
        self.dir.quarantine(name, reason)

