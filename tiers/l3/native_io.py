"""Batch page I/O, checksums and header checks that run without the GIL (numba, ``nogil``).

A batch of L3 pages is handed over once: the calling thread releases the GIL for the
whole batch (opening, reading or writing, renaming and closing every file,
checksumming every payload and checking every header), so vLLM's Python loop in the
same process neither waits for it nor makes it wait at every system call. Each time a
thread gives the GIL up beside a busy thread, it waits up to the interpreter's switch
interval (5 ms) to get it back: that is why the checks happen here too, not in NumPy
afterwards (NumPy releases the GIL in its loops over larger arrays). libc's
``open``/``pread``/``preadv``/``pwritev``/``fsync``/``rename``/``access``/``close`` and xxHash's
XXH3-64, one-shot and streaming (the C library inside the ``xxhash`` package this
project already uses for page checksums: digests are those of
``xxhash.xxh3_64_intdigest``, so pages stored before stay valid) are called straight
from compiled code.

Contract:
- ``available()``: numba imports, and libc's functions and ``XXH3_64bits`` were found
  (Linux). Without it callers use their Python paths; nothing here is required.
- ``checksums(buf, offsets, length)``: ``xxh3_64`` of ``buf[o:o + length]`` for each
  ``o``; ``checksums_at(addresses, length)`` the same at raw addresses.
- ``read_pages(paths, dest, offsets, head, length, headers, expect, pad_from)``: for
  each row of ``paths`` (a NUL-terminated path in a uint8 row): the file's first
  ``head`` bytes go to ``headers[i, :head]``, the next ``length`` bytes to
  ``dest[offsets[i]:][:length]`` (the header and the payload's first chunk in one
  ``preadv``: with O_DIRECT one I/O). Returns (``status``, ``sizes``) per page: ``OK`` when
  the file is exactly ``head + length`` bytes, its header starts with ``expect[i]``
  (``CHECKSUM_AT`` bytes), the little-endian uint64 after that prefix is the
  ``xxh3_64`` of the payload read, and header bytes ``[pad_from, head)`` are zero;
  else the first failed check: ``MISSING`` (could not be opened), ``UNREADABLE``,
  ``WRONG_SIZE`` (``sizes[i]``: bytes found, up to one past the expected size),
  ``BAD_HEADER``, ``BAD_CHECKSUM``, ``BAD_PADDING``. Failed pages' slots hold
  whatever was read: the caller must not use them. With ``deadline``
  (``time.monotonic()`` seconds), no page is started once it has passed: those are
  ``NOT_READ``. With ``helper`` (an executor), the payloads are hashed on one of its
  threads while this one reads: the reader publishes each page's bytes chunk by chunk
  (``progress``, release stores), the helper hashes right behind it (acquire loads),
  and whichever side claims the batch first (a compare-and-swap) hashes it: a helper
  that has not started when the reads are done finds its job claimed and leaves it,
  so a read never waits for a thread that is busy elsewhere. Same results either way.
  Records of multi-page files (span objects, tiers/index/spans.py): ``bases[i]`` is
  the row's record offset in its file (header there, payload right after it) and
  ``ends[i]`` where the file must end (the one-past probe reads there); consecutive
  rows of one file share one ``open``.
- ``write_pages(tmp_paths, paths, src, offsets, length, headers, sum_at, fsync,
  skip_existing)``: for each row: ``SKIPPED`` when ``skip_existing`` and ``paths[i]``
  exists; else the ``xxh3_64`` of ``src[offsets[i]:][:length]`` goes little-endian
  into ``headers[i, sum_at:sum_at + 8]``, the header row and the payload are written
  to ``tmp_paths[i]`` (created, truncated, mode 0644), fsynced when asked, closed and
  renamed to ``paths[i]``: ``OK``, or ``OPEN_FAILED``, ``WRITE_FAILED``,
  ``RENAME_FAILED`` (e.g. the destination's folder does not exist yet); a failure
  removes the temp file. With ``bases`` and ``last``, rows ``i..j`` (``last[j]``
  set) are the records of one file (its paths: row j's), written at those offsets
  and renamed in once; every row of a file gets the file's status.
- ``direct=True`` (``read_pages``, ``write_pages``): every file is opened with
  ``O_DIRECT``, so the bytes move between storage and the caller's memory without
  the page cache. Headers (``aligned_rows``/``aligned``), payload addresses, ``head``,
  ``length`` and record offsets must be ``DIRECT_ALIGN``-aligned (``direct_ok``
  says whether a pool's slots are), else ``ValueError`` before any I/O; a file system
  that refuses O_DIRECT fails the page (``MISSING`` / ``OPEN_FAILED``), and the
  caller retries it its own way. The one-past-the-end probe reads a whole block.
- ``copy_records(sources, header_dests, dests, head, length, helper)``: records in
  this process's memory (e.g. a Mooncake segment it mounted) copied out, header and
  payload, with each payload's ``xxh3_64`` computed in the same pass (or by
  ``helper`` right behind it, as in ``read_pages``).
- ``path_rows(paths)``: the uint8 rows these functions take.
- The kernels themselves: native_kernels.py.
- ``warm_up()``: compile everything now. Compiled once per process (the C functions'
  addresses are no constants across processes, so numba's disk cache cannot keep it),
  on first use otherwise.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from hicache.tiers.l3.native_kernels import (  # the status codes are this module's contract
    BAD_CHECKSUM,
    BAD_HEADER,
    BAD_PADDING,
    MISSING,
    NOT_READ,
    OK,
    OPEN_FAILED,
    RENAME_FAILED,
    SKIPPED,
    UNREADABLE,
    WRITE_FAILED,
    WRONG_SIZE,
    libc,
    xxh3,
    xxh3_stream,
)
from hicache.tiers.l3.native_kernels import kernels as _kernels

__all__ = ["BAD_CHECKSUM", "BAD_HEADER", "BAD_PADDING", "DIRECT_ALIGN", "MISSING", "NOT_READ",
           "OK", "OPEN_FAILED", "RENAME_FAILED", "SKIPPED", "UNREADABLE", "WRITE_FAILED",
           "WRONG_SIZE", "aligned", "aligned_rows", "available", "checksums", "checksums_at",
           "copy_records", "direct_ok", "path_rows", "read_pages", "warm_up", "write_pages"]

# Bytes read (and hashed while in the CPU cache) at a time: 256 KiB measured best of
# 256 KiB - 1 MiB for 2 and 8 MiB pages.
READ_CHUNK = 256 << 10
# Address, length and file offset alignment of O_DIRECT transfers (512 B and 4 KiB
# sectors); no O_DIRECT on this platform: 0.
DIRECT_ALIGN = 4096
# Bytes one pwritev of write_pages moves at most: Linux moves at most 2 GiB - 4 KiB in
# one call, and a short write would fail the whole file.
WRITE_CALL_BYTES = 1 << 30
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


@functools.cache
def available() -> bool:
    """Whether the compiled batch paths can run here."""
    if os.name != "posix":
        return False
    try:
        import numba  # noqa: F401

        libc()
        xxh3()
        xxh3_stream()
        _kernels()
    except Exception:  # noqa: BLE001 - no numba, libc or xxhash symbol: Python paths
        return False
    return True


def path_rows(paths: Sequence[str]) -> np.ndarray:
    """Paths as NUL-terminated uint8 rows (the form the batch functions take)."""
    raw = [os.fsencode(p) for p in paths]
    width = max((len(r) for r in raw), default=0) + 1
    joined = b"".join(r.ljust(width, b"\0") for r in raw)
    return np.frombuffer(joined, np.uint8).reshape(len(raw), width).copy()


@functools.cache
def warm_up() -> None:
    """Compile every batch function now, once per process, not on the first page.
    ``read_pages`` and ``write_pages`` return before their kernels on an empty batch,
    so they write and read one small page in a temporary folder (unaligned, without
    ``O_DIRECT``: the kernels take the same types either way)."""
    buf = np.zeros(8, np.uint8)
    none = np.zeros(0, np.int64)
    _kernels()["follow_hashes"](np.zeros(0, np.uint64), 1, none, np.zeros(0, np.uint64),
                                np.zeros(2, np.int64))
    checksums(buf, none, 1)
    checksums_at(np.zeros(0, np.uint64), 1)
    copy_records([], [], [], 1, 1)
    head, length = 16, 8
    page = np.arange(2 * length, dtype=np.uint8)
    headers = aligned_rows(1, head)
    with tempfile.TemporaryDirectory(prefix="hicache-native-io-") as d:
        paths = path_rows([os.path.join(d, "page")])
        write_pages(path_rows([os.path.join(d, "page.tmp")]), paths, page,
                    np.zeros(1, np.int64), length, headers, 0)
        read_pages(paths, page, np.full(1, length, np.int64), head, length,
                   aligned_rows(1, head), np.zeros((1, 0), np.uint8), head)


def checksums(buf: Any, offsets: Any, length: int) -> np.ndarray:
    result: np.ndarray = _kernels()["checksums"](_flat(buf), np.asarray(offsets, np.int64),
                                                 int(length))
    return result


def checksums_at(addresses: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    """``xxh3_64`` of ``length`` bytes at each address (memory the caller owns and keeps
    alive through the call: host pool slots, registered buffers)."""
    result: np.ndarray = _kernels()["checksums_at"](np.asarray(addresses, np.uint64),
                                                    int(length))
    return result


def copy_records(sources: Sequence[int], header_dests: Sequence[int],
                 dests: Sequence[int], head: int, length: int,
                 helper: Executor | None = None) -> np.ndarray:
    """Copy records (``head`` header bytes, then ``length`` payload bytes) from memory
    at ``sources`` (this process's own, alive through the call): each header to
    ``header_dests[i]``, each payload to ``dests[i]``, and return the ``xxh3_64`` of
    every payload as copied, hashed chunk by chunk while in the CPU cache: one pass
    over the bytes, where a copy and then a check would be two. ``helper``: hash on
    one of its threads right behind the copy (as ``read_pages``)."""
    kernels = _kernels()
    n = len(sources)
    dest = np.asarray(dests, np.uint64)
    digests = np.zeros(n, np.uint64)
    ctl = np.zeros(2, np.int64)
    progress = _start_helper(helper, dest, length, digests, ctl)
    kernels["copy_records"](np.asarray(sources, np.uint64), np.asarray(header_dests, np.uint64),
                            dest, int(head), int(length), READ_CHUNK, progress, digests, ctl)
    return digests


def _start_helper(helper: Executor | None, addresses: np.ndarray, length: int,
                  digests: np.ndarray, ctl: np.ndarray) -> np.ndarray:
    """Hand the hashing of the pages at ``addresses`` to ``helper`` (``follow_hashes``):
    returns the progress array the mover publishes into, or an empty one (no helper,
    no pages, or the helper shut down), and the mover hashes itself. The job keeps its
    arrays alive until it has run; the memory at ``addresses`` stays alive because the
    mover waits for a helper that claimed the job (``settle_split``)."""
    n = addresses.shape[0]
    if helper is not None and n > 0:
        progress = np.zeros(n, np.int64)
        try:
            helper.submit(_kernels()["follow_hashes"], addresses, int(length), progress,
                          digests, ctl)
            return progress
        except RuntimeError:  # shut down: hash here
            pass
    return np.zeros(0, np.int64)


def read_pages(paths: np.ndarray, dest: Any, offsets: Any, head: int, length: int,
               headers: np.ndarray, expect: np.ndarray, pad_from: int,
               deadline: float | None = None,
               helper: Executor | None = None,
               bases: Any = None, ends: Any = None,
               direct: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """See the module docstring. ``helper``: hash the payloads on one of its threads,
    chunk by chunk right behind the reads (the bytes are still in the shared cache), so
    this thread only moves bytes; if the helper has not started when the reads are
    done, they are hashed here. ``direct``: open with ``O_DIRECT`` (see ``aligned``)."""
    kernels = _kernels()
    n = paths.shape[0]
    if n == 0:  # nothing to read (an empty header array has no aligned address)
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    flat = _flat(dest)  # alive through the call: the pages land at its addresses
    addresses = (np.asarray(offsets, np.int64) + flat.ctypes.data).astype(np.uint64)
    if direct:
        _check_aligned("read_pages", addresses, headers, head, length, bases)
    digests = np.zeros(n, np.uint64)
    ctl = np.zeros(2, np.int64)  # [claimed by: 0 nobody, 1 helper, 2 reader; helper done]
    progress = _start_helper(helper, addresses, length, digests, ctl)
    deadline_ns = 0 if deadline is None else max(1, int(deadline * 1e9))
    at, end, same = _records(paths, bases, ends, head + length)
    status, sizes = kernels["read_pages"](paths, addresses, int(head), int(length), headers,
                                          expect, int(pad_from), deadline_ns, progress,
                                          digests, ctl, READ_CHUNK, at, end, same,
                                          O_DIRECT if direct else 0,
                                          aligned_rows(1, DIRECT_ALIGN)[0] if direct
                                          else np.zeros(1, np.uint8))
    return status, sizes


def _records(paths: np.ndarray, bases: Any, ends: Any, record: int,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's record offset in its file (default 0), where its file ends (default
    one record) and whether its file is the previous row's (read through one open)."""
    n = paths.shape[0]
    at = np.zeros(n, np.int64) if bases is None else np.asarray(bases, np.int64)
    end = np.full(n, record, np.int64) if ends is None else np.asarray(ends, np.int64)
    same = np.zeros(n, np.uint8)
    if n > 1 and bases is not None:
        same[1:] = (paths[1:] == paths[:-1]).all(axis=1)
    return at, end, same


def write_pages(tmp_paths: np.ndarray, paths: np.ndarray, src: Any, offsets: Any,
                length: int, headers: np.ndarray, sum_at: int, fsync: bool = False,
                skip_existing: bool = False, bases: Any = None,
                last: Any = None, direct: bool = False) -> np.ndarray:
    """Write each row's page as a file of its own, or (``bases``, ``last``) rows
    ``i..j`` with ``last[j]`` as the records of one file at those offsets (its paths
    are row j's; all rows of a file get one status). ``direct``: open with
    ``O_DIRECT`` (see ``aligned``)."""
    n = paths.shape[0]
    if n == 0:  # nothing to write (an empty header array has no aligned address)
        return np.zeros(0, np.int64)
    at = np.zeros(n, np.int64) if bases is None else np.asarray(bases, np.int64)
    ends = np.ones(n, np.uint8) if last is None else np.asarray(last, np.uint8)
    flat = _flat(src)
    offsets = np.asarray(offsets, np.int64)
    if direct:
        _check_aligned("write_pages", offsets + flat.ctypes.data, headers,
                       headers.shape[1], length, at)
    status: np.ndarray = _kernels()["write_pages"](
        tmp_paths, paths, flat, offsets, int(length), headers,
        int(sum_at), bool(fsync), bool(skip_existing), at, ends, O_DIRECT if direct else 0,
        WRITE_CALL_BYTES)
    return status


def aligned_rows(n: int, width: int) -> np.ndarray:
    """A zeroed ``(n, width)`` uint8 array whose rows start at ``DIRECT_ALIGN`` byte
    boundaries when ``width`` is a multiple of it (header rows for ``direct`` I/O)."""
    raw = np.zeros(n * width + DIRECT_ALIGN, np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip:skip + n * width].reshape(n, width)


def aligned(rows: np.ndarray) -> np.ndarray:
    """``rows`` itself where it already suits ``direct`` I/O, else a copy in ``aligned_rows``."""
    if rows.ctypes.data % DIRECT_ALIGN == 0 and rows.flags.c_contiguous:
        return rows
    out = aligned_rows(*rows.shape)
    out[:] = rows
    return out


def direct_ok(address: int, length: int) -> bool:
    """Whether pages of ``length`` bytes from ``address`` (and every multiple of
    ``length`` after it) can move with ``direct`` I/O, behind a header of
    ``DIRECT_ALIGN`` bytes."""
    return bool(O_DIRECT) and address % DIRECT_ALIGN == 0 and length % DIRECT_ALIGN == 0


def _check_aligned(what: str, addresses: np.ndarray, headers: np.ndarray, head: int,
                   length: int, bases: Any) -> None:
    """O_DIRECT moves whole sectors between aligned memory and aligned file offsets:
    anything else fails with EINVAL inside the batch, so it is refused here."""
    offsets = np.zeros(0, np.int64) if bases is None else np.asarray(bases, np.int64)
    if (not O_DIRECT or head % DIRECT_ALIGN or length % DIRECT_ALIGN
            or headers.ctypes.data % DIRECT_ALIGN or headers.strides[0] % DIRECT_ALIGN
            or (np.asarray(addresses, np.int64) % DIRECT_ALIGN).any()
            or (offsets % DIRECT_ALIGN).any()):
        raise ValueError(f"{what}: direct I/O needs {DIRECT_ALIGN}-byte aligned headers, "
                         "payload addresses, lengths and file offsets")


def _flat(data: Any) -> np.ndarray:
    """A 1-D uint8 numpy view of an array, tensor or buffer (no copy)."""
    if hasattr(data, "numpy") and hasattr(data, "untyped_storage"):  # torch CPU tensor
        data = data.view(-1).numpy()
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    return arr.reshape(-1)
