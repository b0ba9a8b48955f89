"""L3 backend that moves pages between the host pool and files through a NIXL agent.

Contract (on top of ``base.py``):
- One NIXL agent per instance, with the plugin named by extra-config
  ``plugin`` (default ``POSIX``). The plugin must load and support FILE and
  DRAM memory; otherwise ``__init__`` raises ``StorageConfigError`` naming
  the key, the requested plugin and the plugins the agent has.
- Extra-config keys (``NixlExtraConfig``; anything else is a ``StorageConfigError``):
    ``plugin``         NIXL plugin name (POSIX, GDS, GDS_MT, ...).
    ``plugin_params``  dict of plugin init parameters, passed to
                       ``create_backend`` as strings (POSIX: ``use_uring``,
                       ``use_aio``, ``use_posix_aio``, ...); names are checked
                       against the plugin's own parameter list.
    ``path``           directory of page files (default env
                       ``HICACHE_NIXL_STORAGE_DIR``, else ``/tmp/hicache_nixl``).
    ``xfer_timeout_s`` deadline of one batch transfer (default 5 s); a
                       transfer past it or failing makes its pages misses.
    ``max_batch_pages`` pages per NIXL transfer request (default 256).
- One file per page and rank in the page directory and record format the
  file backend uses (tiers/l3/page_dir.py): ``<path>/pages/<xx>/<object_key>.page``,
  the integrity header zero-padded to 4 KiB, then the payload; a file and a
  NIXL backend on one directory share pages.
  Writes go to ``<path>/tmp/`` and are renamed into place, so readers see
  whole pages or nothing. Every read checks the file size and
  ``integrity.verify``; a mismatch is a miss reported corrupt and the file is
  moved to ``<path>/quarantine/`` unless a fresh copy replaced it meanwhile.
- Zero copy: the registered pool buffer is the DRAM side of the transfer for
  layouts whose slots are contiguous (page_first, page_first_direct); a
  small registered header buffer holds the headers. Other layouts
  (layer_first) go through a registered one-page staging buffer.
- An I/O problem is a miss (False, or a shorter count), reported (``report.failed``; the guard
  counts it in ``errors``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import Field, PositiveFloat, PositiveInt

from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import (
    Capabilities,
    ReadBatch,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    WriteBatch,
    validate_extra,
)
from hicache.tiers.l3.page_dir import FILE_HEADER_BYTES, FILE_LAYOUT, PAGE_EXT, PageDirectory
from hicache.tiers.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_PLUGIN = "POSIX"
DEFAULT_DIR = "/tmp/hicache_nixl"
DIR_ENV = "HICACHE_NIXL_STORAGE_DIR"
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_BATCH = 256
HDR = FILE_HEADER_BYTES  # the record's header region (tiers/l3/page_dir.py)


class NixlExtraConfig(Settings):
    """The nixl backend's ``hicache_storage_backend_extra_config``."""

    plugin: str = Field(DEFAULT_PLUGIN, min_length=1,
                        description="NIXL plugin name (POSIX, GDS, GDS_MT, ...)")
    plugin_params: dict[str, Any] = Field(
        default_factory=dict, description="plugin init parameters, passed as strings")
    path: str | None = Field(
        None, description=f"directory of the page files; empty or null = ${DIR_ENV}, "
        f"else {DEFAULT_DIR}")
    xfer_timeout_s: PositiveFloat = Field(
        DEFAULT_TIMEOUT_S, description="deadline of one batch transfer, in seconds")
    max_batch_pages: PositiveInt = Field(
        DEFAULT_MAX_BATCH, description="pages per NIXL transfer request")


class _Page:
    """One page of a batch: its key, file, and where its payload lives in DRAM."""

    __slots__ = ("key", "path", "addr", "view", "fd", "tmp", "ok", "digest")

    def __init__(self, key: str, path: str, addr: int, view: torch.Tensor,
                 digest: int | None = None) -> None:
        self.key = key
        self.path = path
        self.addr = addr
        self.view = view
        self.digest = digest  # the payload's checksum, where the host pool knows it
        self.fd = -1
        self.tmp = ""
        self.ok = False


class NixlBackend(StorageBackend):
    """Page files written and read by a NIXL agent (POSIX plugin by default)."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        extra = validate_extra(config.extra_config, NixlExtraConfig, "nixl")
        self.plugin = extra.plugin
        self.path = extra.path or os.environ.get(DIR_ENV) or DEFAULT_DIR
        self.timeout_s = extra.xfer_timeout_s
        self.max_batch = extra.max_batch_pages
        params = extra.plugin_params
        self.dir = PageDirectory(self.path, PAGE_EXT, config.key_suffix,
                                 "hicache_storage_backend_extra_config.path")
        # Lookups stat() the page files, never the agent: safe on probe threads.
        # Transfers take the backend's lock: safe from several threads, one at a time.
        # Headers are packed per page in Python: a checksum the pool has saves its pass.
        self.capabilities = Capabilities(concurrent_lookups=True, concurrent_io=True,
                                         pool_checksums=True)

        self._lock = threading.Lock()
        self._name = f"hicache-nixl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = self._make_agent({str(k): str(v) for k, v in params.items()})
        self._regs: list[Any] = []
        self._pool_reg: Any = None
        self._pool_span = (0, 0)
        # Headers of one transfer request, registered once.
        self._headers = torch.zeros(self.max_batch * HDR, dtype=torch.uint8)
        self._regs.append(self._register_dram(self._headers))
        self._staging: torch.Tensor | None = None
        # timed-out requests still running: (xfer handle, file registration, fds)
        self._parked: list[tuple[Any, Any, list[int]]] = []
        self._closed = False

    # ---- setup ----------------------------------------------------------------

    def _make_agent(self, params: dict[str, str]) -> Any:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise StorageConfigError(
                "hicache_storage_backend='nixl' needs the nixl package "
                f"(pip install nixl==1.5.1): {exc}"
            ) from exc
        agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        available = list(agent.get_plugin_list())
        if self.plugin not in available:
            raise StorageConfigError(
                f"hicache_storage_backend_extra_config.plugin={self.plugin!r} is not a NIXL "
                f"plugin on this host; available plugins: {available}"
            )
        allowed = agent.get_plugin_params(self.plugin)
        bad = sorted(set(params) - set(allowed))
        if bad:
            raise StorageConfigError(
                f"hicache_storage_backend_extra_config.plugin_params keys {bad} are not "
                f"parameters of plugin {self.plugin!r}; allowed: {sorted(allowed)}"
            )
        try:
            agent.create_backend(self.plugin, params)
        except Exception as exc:  # nixl raises its own error types from C++
            raise StorageConfigError(
                f"hicache_storage_backend_extra_config.plugin={self.plugin!r} failed to load "
                f"({type(exc).__name__}: {exc}); available plugins: {available}"
            ) from exc
        mems = set(agent.get_backend_mem_types(self.plugin))
        if not {"FILE_SEG", "DRAM_SEG"} <= mems:
            raise StorageConfigError(
                f"hicache_storage_backend_extra_config.plugin={self.plugin!r} supports "
                f"{sorted(mems)}; the nixl backend needs FILE_SEG and DRAM_SEG (file plugins "
                f"such as POSIX, GDS, GDS_MT); available plugins: {available}"
            )
        return agent

    def _register_dram(self, tensor: torch.Tensor) -> Any:
        desc = [(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0, "")]
        return self._agent.register_memory(desc, "DRAM", backends=[self.plugin])

    def register_host_pool(self, pool: HostPagePool) -> None:
        super().register_host_pool(pool)
        with self._lock:
            if self._pool_reg is not None:
                self._agent.deregister_memory(self._pool_reg, backends=[self.plugin])
            self._pool_reg = self._register_dram(pool.buffer)
            self._pool_span = (pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.nbytes)

    def _staging_page(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.config.page_bytes, dtype=torch.uint8)
            self._regs.append(self._register_dram(self._staging))
        return self._staging

    # ---- paths ----------------------------------------------------------------

    def _file(self, key: str) -> str:
        return self.dir.path(self.dir.name(key))

    # ---- the verbs ------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self._file(key)):
                return i
        return len(keys)

    def read(self, batch: ReadBatch) -> list[bool]:
        pool = self._require_pool()
        keys, slots = list(batch.keys), list(batch.slots)
        with self._lock:
            if self._closed:
                return [False] * len(keys)
            if pool.page_view(0) is not None:
                return self._chunked(self._read, self._slot_pages(pool, keys, slots))
            staging = self._staging_page()  # layer_first: through the registered staging page
            return self._read_staged(keys, slots, staging, lambda key: self._read(
                [_Page(key, self._file(key), staging.data_ptr(), staging)])[0])

    def write(self, batch: WriteBatch) -> list[bool]:
        pool = self._require_pool()
        keys, slots = list(batch.keys), list(batch.slots)
        results = [True] * len(keys)
        with self._lock:
            if self._closed:
                return [False] * len(keys)
            todo = [i for i, key in enumerate(keys) if not self._skip_existing(key)]
            if pool.page_view(0) is not None:
                pages = self._slot_pages(pool, [keys[i] for i in todo], [slots[i] for i in todo])
                done = self._chunked(self._write, pages)
            else:  # layer_first: through the registered staging page
                staging = self._staging_page()
                done = []
                for i in todo:
                    staging.copy_(pool.read_page(slots[i]).reshape(-1))
                    done += self._write([_Page(keys[i], self._file(keys[i]),
                                               staging.data_ptr(), staging)])
        for i, ok in zip(todo, done, strict=True):
            results[i] = ok
        return results

    def _slot_pages(self, pool: HostPagePool, keys: list[str], slots: list[int]) -> list[_Page]:
        pages = []
        for key, slot, digest in zip(keys, slots, pool.checksums_of(slots), strict=True):
            view = pool.page_view(slot)
            assert view is not None
            pages.append(_Page(key, self._file(key), view.data_ptr(), view, digest))
        return pages

    def _chunked(self, fn: Callable[[list[_Page]], list[bool]], pages: list[_Page]) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(pages), self.max_batch):
            out.extend(fn(pages[start:start + self.max_batch]))
        return out

    def _skip_existing(self, key: str) -> bool:
        if os.path.exists(self._file(key)):
            self.report.skipped(1)
            return True
        return False

    # ---- transfers ----------------------------------------------------------------

    def _read(self, pages: list[_Page]) -> list[bool]:
        """Read up to ``max_batch`` pages (header + payload) in one transfer, then verify."""
        size = HDR + self.config.page_bytes
        live: list[_Page] = []
        try:
            for page in pages:
                try:
                    page.fd = os.open(page.path, os.O_RDONLY)
                    file_size = os.fstat(page.fd).st_size
                except OSError:
                    continue  # not stored (or removed since exists): a clean miss
                if file_size != size:
                    self._quarantine_page(page, "file size is not header + page")
                    continue
                live.append(page)
            if live and self._transfer("READ", live):
                page_key = self.page_key_bytes
                fp = self.config.fingerprint
                for i, page in enumerate(live):
                    header = self._headers[i * HDR:(i + 1) * HDR]
                    reason = integrity.verify(header[:integrity.HEADER_BYTES],
                                              page_key(page.key), fp, page.view,
                                              layout=FILE_LAYOUT)
                    if reason is None and bool(header[integrity.HEADER_BYTES:].any()):
                        reason = "header padding is not zero"
                    if reason is None:
                        page.ok = True
                    else:
                        self._quarantine_page(page, reason)
        finally:
            for page in pages:
                if page.fd >= 0:
                    os.close(page.fd)
                    page.fd = -1
        return [p.ok for p in pages]

    def _write(self, pages: list[_Page]) -> list[bool]:
        """Write up to ``max_batch`` pages to temporary files in one transfer, then rename."""
        fp = self.config.fingerprint
        live: list[_Page] = []
        slots: list[int] = []  # header slot of each live page (its index in ``pages``)
        try:
            for i, page in enumerate(pages):
                try:
                    head = integrity.pack_header(self.page_key_bytes(page.key), fp, page.view,
                                                 digest=page.digest, layout=FILE_LAYOUT)
                    row = self._headers[i * HDR:(i + 1) * HDR]
                    row[:integrity.HEADER_BYTES].copy_(
                        torch.frombuffer(bytearray(head), dtype=torch.uint8))
                    row[integrity.HEADER_BYTES:].zero_()
                    name = self.dir.name(page.key)
                    self.dir.make_dir(name)
                    page.tmp = self.dir.temp_path(name)
                    page.fd = os.open(page.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                except (OSError, ValueError) as exc:
                    logger.warning("nixl backend: cannot prepare %s: %s", page.path, exc)
                    self.report.failed("prepare")
                    continue
                live.append(page)
                slots.append(i)
            if live and self._transfer("WRITE", live, header_index=slots):
                for page in live:
                    os.close(page.fd)
                    page.fd = -1
                    try:
                        os.replace(page.tmp, page.path)
                        page.ok = True
                    except OSError as exc:
                        logger.warning("nixl backend: rename to %s failed: %s", page.path, exc)
                        self.report.failed("rename")
        finally:
            for page in pages:
                if page.fd >= 0:
                    os.close(page.fd)
                    page.fd = -1
                if page.tmp and not page.ok:
                    with contextlib.suppress(OSError):
                        os.unlink(page.tmp)
        return [p.ok for p in pages]

    def _transfer(self, op: str, pages: list[_Page], header_index: list[int] | None = None
                  ) -> bool:
        """One NIXL request moving header + payload of every page; False on error or timeout.

        A request past its deadline is not cancelled by NIXL (release returns
        while I/O may still run), so it is parked with its file descriptors
        and registrations; no new request starts until parked ones finished,
        which keeps late bytes out of buffers in use.
        """
        if not self._drain_parked():
            self.report.failed("timed-out requests still running")
            return False
        agent = self._agent
        n = self.config.page_bytes
        idx = header_index or list(range(len(pages)))
        hbase = self._headers.data_ptr()
        file_reg = None
        handle = None
        try:
            file_reg = agent.register_memory(
                [(0, HDR + n, p.fd, "") for p in pages], "FILE", backends=[self.plugin])
            dram: list[tuple[int, int, int]] = []
            files: list[tuple[int, int, int]] = []
            for i, page in zip(idx, pages, strict=True):
                dram += [(hbase + i * HDR, HDR, 0), (page.addr, n, 0)]
                files += [(0, HDR, page.fd), (HDR, n, page.fd)]
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(dram, "DRAM"), agent.get_xfer_descs(files, "FILE"),
                self._name, backends=[self.plugin])
            state = self._wait(handle, agent.transfer(handle))
            if state == "PROC":
                logger.warning("nixl backend: %s of %d pages timed out after %.3f s",
                               op, len(pages), self.timeout_s)
                self.report.failed(f"{op} timed out")
                self._parked.append((handle, file_reg, [p.fd for p in pages]))
                for page in pages:
                    page.fd = -1
                handle = file_reg = None
                return False
            if state != "DONE":
                logger.warning("nixl backend: %s of %d pages ended in state %s",
                               op, len(pages), state)
                self.report.failed(f"{op} ended in state {state}")
                return False
            return True
        except Exception as exc:  # nixl errors are C++ exceptions of several types
            logger.warning("nixl backend: %s of %d pages failed: %s", op, len(pages), exc)
            self.report.failed(f"{op} failed")
            return False
        finally:
            self._release(handle, file_reg, [])

    def _wait(self, handle: Any, state: str) -> str:
        """Poll ``handle`` until it leaves PROC or ``xfer_timeout_s`` passed."""
        deadline = time.monotonic() + self.timeout_s
        while state == "PROC" and time.monotonic() <= deadline:
            state = self._agent.check_xfer_state(handle)
        return state

    def _drain_parked(self) -> bool:
        """Finish timed-out requests (waiting up to the deadline each); True when none is left."""
        still: list[tuple[Any, Any, list[int]]] = []
        for handle, file_reg, fds in self._parked:
            try:
                state = self._wait(handle, "PROC")
            except Exception:  # a failed request is finished too
                state = "ERR"
            if state == "PROC":
                still.append((handle, file_reg, fds))
            else:
                self._release(handle, file_reg, fds)
        self._parked = still
        if still:
            logger.warning("nixl backend: %d timed-out request(s) still running; no new I/O",
                           len(still))
        return not still

    def _release(self, handle: Any, file_reg: Any, fds: list[int]) -> None:
        if handle is not None:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)
        if file_reg is not None:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(file_reg, backends=[self.plugin])
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _quarantine_page(self, page: _Page, reason: str) -> None:
        """Count ``page`` as corrupt and move its file aside (unless it was replaced)."""
        self.report.corrupt(1)
        self.dir.quarantine(self.dir.name(page.key), reason, page.fd)

    # ---- maintenance ------------------------------------------------------------

    def delete(self, keys: Sequence[str]) -> int:
        deleted = 0
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(key))
                deleted += 1
        return deleted

    def clear(self) -> None:
        """Remove every page file and quarantined file in the directory."""
        self.dir.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._drain_parked():
                # Buffers a request may still write must outlive it: leak rather than free.
                logger.error("nixl backend: closing with I/O in flight; keeping its buffers")
                return
            for reg in [*self._regs, self._pool_reg]:
                if reg is not None:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg, backends=[self.plugin])
            self._regs = []
            self._pool_reg = None
            self._pool_span = (0, 0)
            self._agent = None  # drops the agent and its plugin

