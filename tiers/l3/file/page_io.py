"""The file backend's page record and its Python I/O of one page: buffered, or O_DIRECT.

Contract:
- A page file is the record of tiers/l3/page_dir.py (shared with the NIXL
  backend): the ``integrity`` header zero-padded to ``FILE_HEADER_BYTES``
  (4 KiB), then the payload.
- ``Buffers``: one thread's scratch (header, one byte past the end, the
  page-aligned bounce buffer made on first O_DIRECT use).
- ``probe(dir, mode)``: whether ``dir`` takes O_DIRECT (``mode`` ``auto``:
  False where refused, logged; ``on``: a refusal is a ``StorageConfigError``
  naming ``direct_io``; ``off``: False without asking).
- ``read_direct`` / ``write_direct``: one page through O_DIRECT, straight
  between file and slot when the slot is 4 KiB aligned and the page a
  multiple of 4 KiB, else through the bounce buffer. None / False when the
  filesystem refused it (the caller goes buffered for that page).
- ``header_rows(keys, fingerprint, page_bytes, direct)``: the batch path's file
  headers, one ``FILE_HEADER_BYTES`` row per page (the write fills in checksums),
  aligned for O_DIRECT when ``direct``.
- ``batch_problem(code, size, header, key, fingerprint)``: why native_io's batch
  read failed a page, in ``read_page``'s words (None for ``OK``).
- ``write_file(tmp, flags, chunks, fsync)``: one ``writev`` of ``chunks``
  (``OSError`` on a short write), fsync'ed when asked.
- ``read_page``: one page file into ``payload``, checked (size, header, zero
  padding, checksum): None when verified, ``MISSING`` when there is no such
  file, else why it is corrupt. ``write_page``: one page to its temp file,
  renamed into place (its sub-directory made on first use); None or the
  error.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Literal

from hicache.tiers.l3 import integrity, native_io
from hicache.tiers.l3.base import StorageConfigError
from hicache.tiers.l3.page_dir import FILE_HEADER_BYTES, FILE_LAYOUT, PADDING

logger = logging.getLogger(__name__)

# Address and length alignment of O_DIRECT transfers (covers 512 B and 4 KiB sectors).
DIRECT_ALIGN = 4096
# Not on every platform (macOS): the probe then finds no O_DIRECT.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
DirectIO = Literal["off", "auto", "on"]
MISSING = "missing"


class Buffers(threading.local):
    """One thread's scratch buffers (batches may run on several threads)."""

    def __init__(self) -> None:
        self.header = bytearray(FILE_HEADER_BYTES)
        self.tail = bytearray(1)
        self.direct: memoryview | None = None  # page-aligned, made on first O_DIRECT use

    def bounce(self, page_bytes: int) -> memoryview:
        """The page-aligned bounce buffer: header, payload, one block past it."""
        if self.direct is None:
            size = FILE_HEADER_BYTES + round_up(page_bytes) + DIRECT_ALIGN
            self.direct = memoryview(mmap.mmap(-1, size))
        return self.direct


def probe(tmp_dir: Path, mode: DirectIO) -> bool:
    """Whether pages use O_DIRECT: ``mode`` and what the filesystem of ``tmp_dir``
    accepts."""
    if mode == "off":
        return False
    path = tmp_dir / f"direct-probe.{os.getpid()}.{threading.get_ident()}.tmp"
    block = mmap.mmap(-1, DIRECT_ALIGN)
    try:
        if not O_DIRECT:
            raise OSError(errno.EINVAL, "this platform has no O_DIRECT")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
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
                f"{tmp_dir.parent} does not accept O_DIRECT ({exc}); allowed values: "
                "'off', 'auto' (O_DIRECT where accepted), 'on'") from None
        logger.info("HiCache file L3: %s does not accept O_DIRECT (%s); buffered I/O",
                    tmp_dir.parent, exc)
        return False
    finally:
        path.unlink(missing_ok=True)
        block.close()
    return True


def read_direct(path: str, payload: memoryview, addr: int, page_bytes: int,
                buffers: Buffers) -> tuple[int, memoryview] | None:
    """(bytes read, header) through O_DIRECT, (-1, _) when there is no file, None when
    the filesystem refused it (the caller reads buffered)."""
    scratch = buffers.bounce(page_bytes)
    header = scratch[:FILE_HEADER_BYTES]
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except FileNotFoundError:
        return -1, header
    except OSError:
        return None
    straight = addr % DIRECT_ALIGN == 0 and page_bytes % DIRECT_ALIGN == 0
    end = FILE_HEADER_BYTES + page_bytes
    try:
        if straight:  # header, payload into the slot, one block past the end
            got = os.preadv(fd, [header, payload, scratch[end:end + DIRECT_ALIGN]], 0)
        else:  # all of it into the bounce buffer, then the payload into the slot
            got = os.preadv(fd, [scratch], 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not straight and got == end:
        payload[:] = scratch[FILE_HEADER_BYTES:end]
    return got, header


def write_file(tmp: str, flags: int, chunks: list[Any], fsync: bool) -> None:
    fd = os.open(tmp, flags, 0o644)
    try:
        want = sum(len(c) for c in chunks)
        done = os.writev(fd, chunks)
        if done != want:
            raise OSError(errno.EIO, f"short write ({done} of {want} bytes)")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(tmp: str, header: bytes, payload: memoryview, addr: int, page_bytes: int,
                 buffers: Buffers, fsync: bool) -> bool:
    """Write ``tmp`` with O_DIRECT; False when the page or filesystem does not allow it
    (the caller writes buffered)."""
    if page_bytes % DIRECT_ALIGN:
        return False
    scratch = buffers.bounce(page_bytes)
    scratch[:integrity.HEADER_BYTES] = header
    scratch[integrity.HEADER_BYTES:FILE_HEADER_BYTES] = PADDING
    if addr % DIRECT_ALIGN == 0:
        chunks = [scratch[:FILE_HEADER_BYTES], payload]
    else:
        scratch[FILE_HEADER_BYTES:FILE_HEADER_BYTES + page_bytes] = payload
        chunks = [scratch[:FILE_HEADER_BYTES + page_bytes]]
    try:
        write_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, chunks, fsync)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


def round_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def read_page(path: str, key: bytes, fingerprint: bytes, payload: memoryview, addr: int,
              page_bytes: int, buffers: Buffers, direct: bool) -> str | None:
    """See the module docstring."""
    header: memoryview | bytearray
    got = read_direct(path, payload, addr, page_bytes, buffers) if direct else None
    if got is None:
        header = buffers.header
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return MISSING
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
            return MISSING
    if size != FILE_HEADER_BYTES + page_bytes:
        return f"wrong size ({size} bytes read)"
    problem = integrity.verify(header, key, fingerprint, payload, layout=FILE_LAYOUT)
    if problem is None and header[integrity.HEADER_BYTES:] != PADDING:
        problem = "header padding is not zero"
    return problem


def header_rows(keys: list[bytes], fingerprint: bytes, page_bytes: int,
                direct: bool) -> Any:
    """See the module docstring."""
    rows = integrity.header_rows(keys, fingerprint, page_bytes, layout=FILE_LAYOUT,
                                 width=FILE_HEADER_BYTES)
    return native_io.aligned(rows) if direct else rows


def batch_problem(code: int, size: int, header: bytes, key: bytes,
                  fingerprint: bytes) -> str | None:
    """See the module docstring (``MISSING`` and ``NOT_READ`` are the caller's)."""
    words = {native_io.OK: None, native_io.UNREADABLE: "unreadable: read failed",
             native_io.WRONG_SIZE: f"wrong size ({size} bytes read)",
             native_io.BAD_PADDING: "header padding is not zero",
             native_io.BAD_CHECKSUM: "checksum mismatch"}
    if code in words:
        return words[code]
    # BAD_HEADER: the header's own words for which field differs
    return integrity.verify(header, key, fingerprint, b"", layout=FILE_LAYOUT) \
        or "header mismatch"


def write_page(tmp: str, path: str, header: bytes, payload: memoryview, addr: int,
               page_bytes: int, buffers: Buffers, direct: bool, fsync: bool) -> str | None:
    """See the module docstring."""
    try:
        if not (direct and write_direct(tmp, header, payload, addr, page_bytes, buffers, fsync)):
            write_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, [header, PADDING, payload],
                       fsync)
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
