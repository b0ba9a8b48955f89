"""File L3 backend: one checksummed file per page and rank in a directory, crash-safe.

Contract (on top of base.py's):
- Extra-config keys: ``FileExtraConfig`` (anything else is a
  ``StorageConfigError``). Directory: ``path``, else
  ``$HICACHE_FILE_STORAGE_DIR``, else ``/tmp/hicache``. Pages live in ``<dir>/pages/<object_key>.page``:
  ``integrity`` header (page key, storage fingerprint, xxh3 checksum) then
  the payload exactly as the host pool slot holds it.
- Writes are atomic: the page is written to ``<dir>/tmp/`` under a name
  unique to this process and thread, then renamed into ``pages/``. A reader
  sees the whole page or none of it; a crash leaves at most a temp file,
  removed at the next start. Files are not fsync'ed (``fsync: true`` turns
  it on): after a power loss a torn page fails its checksum and is a miss.
- A page is one ``preadv`` / ``writev`` (header and payload straight from
  or into the host slot), then the xxh3 check. Overlapping reads of page
  i+1 with the check of page i on a helper thread measured no faster on 2
  cores (both are memory-bound), so batches are plain loops.
- Every read checks the header and checksum; a mismatch, a short file or
  an unreadable file is a miss, counted as corrupt, and the file is moved
  to ``<dir>/quarantine/`` for inspection (not served again). A file that
  disappears between ``exists`` and ``get`` is a plain miss.
- ``exists`` asks the filesystem, so engines (processes, hosts on a shared
  mount) sharing the directory see each other's pages at once.
- Capacity: ``capacity_gb`` (GB = 1e9 bytes; 0 = unlimited). The index of
  sizes and access order is rebuilt from the directory at start (oldest
  mtime first) and kept by this instance; when a write would exceed the
  capacity, least-recently-used pages are deleted first. Engines sharing a
  directory each enforce the limit on their own view (pages written by
  another engine are counted once seen through ``exists``/``get``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
from pydantic import Field, NonNegativeFloat

from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import (
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    validate_extra,
)
from hicache.tiers.settings import Settings

logger = logging.getLogger(__name__)

GB = 1_000_000_000
DIR_ENV = "HICACHE_FILE_STORAGE_DIR"
DEFAULT_DIR = "/tmp/hicache"


class FileExtraConfig(Settings):
    """The file backend's ``hicache_storage_backend_extra_config``."""

    path: str | None = Field(
        None, description=f"directory of the pages; empty or null = ${DIR_ENV}, "
        f"else {DEFAULT_DIR}")
    capacity_gb: NonNegativeFloat = Field(
        0, description="GB (1e9 bytes) the pages may take; 0 = unlimited")
    fsync: bool = Field(False, description="fsync every page file before it is renamed in")


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
        self.root = Path(path)
        self.pages_dir = self.root / "pages"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / "quarantine"
        try:
            for d in (self.pages_dir, self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageConfigError(
                f"hicache_storage_backend_extra_config.path={path!r} is not a usable "
                f"directory: {exc}"
            ) from exc
        self.capacity_bytes = int(extra.capacity_gb * GB)
        self.fsync = extra.fsync
        self._fingerprint = config.fingerprint
        self._file_bytes = integrity.HEADER_BYTES + config.page_bytes
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU order
        self._index_bytes = 0
        self._index_lock = threading.Lock()
        self._rebuild_index()

    # ---- index ------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Remove temp files of dead writers; index existing pages oldest first."""
        for stale in self.tmp_dir.glob("*.tmp"):
            if not _pid_alive(stale.name.split(".")[-3]):
                stale.unlink(missing_ok=True)
        entries = []
        for entry in os.scandir(self.pages_dir):
            if entry.name.endswith(".page"):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, entry.name, st.st_size))
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

    def _forget(self, name: str) -> None:
        with self._index_lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._index_bytes -= size

    def _make_room(self, need: int) -> None:
        if not self.capacity_bytes:
            return
        while True:
            with self._index_lock:
                if self._index_bytes + need <= self.capacity_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._index_bytes -= size
            (self.pages_dir / name).unlink(missing_ok=True)
            self._count(evicted_pages=1)

    @property
    def used_bytes(self) -> int:
        return self._index_bytes

    def _name(self, key: str) -> str:
        return f"{self.object_key(key)}.page"

    # ---- SGLang interface ------------------------------------------------------

    def exists(self, key: str) -> bool:
        self._count(exists_queries=1)
        name = self._name(key)
        try:
            size = (self.pages_dir / name).stat().st_size
        except OSError:
            self._forget(name)
            return False
        self._touch(name, size)
        return True

    def get(self, key: str, target: torch.Tensor) -> bool:
        start = time.perf_counter()
        payload = target.numpy().data.cast("B")
        return self._finish_get(key, payload, self._read_raw(key, payload), start)

    def set(self, key: str, value: torch.Tensor) -> bool:
        start = time.perf_counter()
        prepared = self._prepare_set(key, value)
        if prepared is None:
            return True
        return self._finish_set(key, self._write_raw(*prepared), value, start)

    # ---- the halves of a read / write ------------------------------------------------

    def _read_raw(self, key: str, payload: memoryview) -> tuple[str, bytes | None]:
        """("ok", header) when the file had exactly a header and a payload, else
        ("missing" | "unreadable" | "wrong size", None); the payload lands in ``payload``."""
        header = bytearray(integrity.HEADER_BYTES)
        try:
            fd = os.open(self.pages_dir / self._name(key), os.O_RDONLY)
        except FileNotFoundError:
            return "missing", None
        except OSError:
            return "unreadable", None
        try:
            got = os.preadv(fd, [header, payload, bytearray(1)], 0)
        except OSError:
            return "unreadable", None
        finally:
            os.close(fd)
        if got != len(header) + len(payload):
            return "wrong size", None
        return "ok", bytes(header)

    def _finish_get(self, key: str, target: memoryview,
                    read: tuple[str, bytes | None], start: float) -> bool:
        name = self._name(key)
        self._count(get_pages=1)
        status, header = read
        if status == "missing":
            self._forget(name)
            self._count(get_misses=1)
            return False
        if header is None:
            self._quarantine(name, status)
            return False
        reason = integrity.verify(header, self.page_key_bytes(key), self._fingerprint, target)
        if reason is not None:
            self._quarantine(name, reason)
            return False
        self._touch(name, self._file_bytes)
        self._count(get_hits=1, bytes_read=len(target),
                    read_seconds=time.perf_counter() - start)
        return True

    def _prepare_set(self, key: str, value: torch.Tensor) -> tuple[str, bytes, torch.Tensor] | None:
        """None when the page exists already; else what _write_raw needs."""
        name = self._name(key)
        if (self.pages_dir / name).exists():
            self._count(set_skipped_existing=1)
            self._touch(name, self._file_bytes)
            return None
        header = integrity.pack_header(self.page_key_bytes(key), self._fingerprint, value)
        self._make_room(self._file_bytes)
        return name, header, value

    def _write_raw(self, name: str, header: bytes, value: torch.Tensor) -> str | None:
        """Write the page atomically; None on success, else the error."""
        tmp = self.tmp_dir / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [header, value.numpy().data.cast("B")])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.pages_dir / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            return str(exc)
        return None

    def _finish_set(self, key: str, error: str | None, value: torch.Tensor,
                    start: float) -> bool:
        if error is not None:
            logger.warning("HiCache file L3: writing page %s failed: %s", key[:16], error)
            self._count(set_failures=1, errors=1)
            return False
        self._touch(self._name(key), self._file_bytes)
        self._count(set_pages=1, bytes_written=value.numel(),
                    write_seconds=time.perf_counter() - start)
        return True

    def delete(self, key: str) -> bool:
        name = self._name(key)
        self._forget(name)
        try:
            (self.pages_dir / name).unlink()
        except FileNotFoundError:
            return False
        return True

    def clear(self) -> None:
        for entry in os.scandir(self.pages_dir):
            if entry.name.endswith(".page"):
                Path(entry.path).unlink(missing_ok=True)
        with self._index_lock:
            self._index.clear()
            self._index_bytes = 0

    # ---- helpers ----------------------------------------------------------------

    def _quarantine(self, name: str, reason: str) -> None:
        self._forget(name)
        self._count(get_misses=1, corrupt_pages=1)
        dest = self.quarantine_dir / f"{name}.{int(time.time() * 1e6)}"
        try:
            os.replace(self.pages_dir / name, dest)
        except OSError:
            pass  # already gone (another engine quarantined or deleted it)
        logger.warning(
            "HiCache file L3: page %s is corrupt (%s); quarantined", name, reason
        )


def _pid_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
