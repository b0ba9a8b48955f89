"""The compiled half of native_io.py: libc and xxHash bound through ctypes, lock-free
atomics, and the numba ``nogil`` kernels themselves.

Contract: ``kernels()`` compiles (once per process, on first use) and returns the
batch functions native_io.py wraps: ``checksums``, ``checksums_at``,
``settle_split``, ``read_pages``, ``follow_hashes``, ``write_pages``,
``copy_records``; their arguments and the status codes below are native_io.py's
contract. ``libc()``, ``xxh3()`` and ``xxh3_stream()`` raise ``OSError`` where a
symbol is missing (native_io ``available()`` then says False).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time
from typing import Any

import numpy as np

# read_pages
OK = 0
MISSING = 1
UNREADABLE = 2
WRONG_SIZE = 3
BAD_HEADER = 4
BAD_CHECKSUM = 5
BAD_PADDING = 6
NOT_READ = 7  # its deadline passed before it
# write_pages (OK as above)
SKIPPED = 1
OPEN_FAILED = 2
WRITE_FAILED = 3
RENAME_FAILED = 4
# Records per pwritev: two iovecs each, within Linux's IOV_MAX (1024).
IOV_RECORDS = 256


@functools.cache
def libc() -> Any:
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name)
    # Pointers travel as 64-bit integers (numba passes array addresses as ints);
    # on every 64-bit Linux ABI a pointer and a uint64 argument go the same way.
    u64, i64, cint = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    sig = {"open": ([u64, cint, cint], cint), "close": ([cint], cint),
           "pread": ([cint, u64, u64, i64], i64), "preadv": ([cint, u64, cint, i64], i64),
           "pwritev": ([cint, u64, cint, i64], i64),
           "fsync": ([cint], cint), "rename": ([u64, u64], cint), "unlink": ([u64], cint),
           "access": ([u64, cint], cint), "clock_gettime": ([cint, u64], cint),
           "usleep": ([ctypes.c_uint], cint), "memcpy": ([u64, u64, ctypes.c_size_t], u64)}
    for fn, (args, res) in sig.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = res
    return lib


def _xxhash_libs() -> list[Any]:
    """xxHash's C library: the xxhash package's extension (it exports xxHash's C API),
    then a system libxxhash."""
    import xxhash._xxhash as ext

    libs = []
    for path in (ext.__file__, ctypes.util.find_library("xxhash")):
        if path:
            try:
                libs.append(ctypes.CDLL(path))
            except OSError:
                continue
    return libs


def _typed(fn: Any, args: list[Any], res: Any) -> Any:
    fn.argtypes = args
    fn.restype = res
    return fn


@functools.cache
def xxh3() -> Any:
    """One-shot ``XXH3_64bits(const void*, size_t)``. The dispatching entry picks the
    widest SIMD the CPU has (AVX2 / AVX-512; 28 against 20 GB/s on 2 MiB here); same
    digest."""
    for lib in _xxhash_libs():
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or getattr(lib, "XXH3_64bits", None)
        if fn is not None:
            return _typed(fn, [ctypes.c_uint64, ctypes.c_size_t], ctypes.c_uint64)
    raise OSError("no XXH3_64bits symbol in the xxhash package or a system libxxhash")


@functools.cache
def xxh3_stream() -> tuple[Any, Any, Any, Any, Any]:
    """Streaming XXH3-64 (createState, reset, update, digest, freeState): a page is
    hashed chunk by chunk as it is read, while each chunk is still in the CPU cache
    (8 MiB pages: 4.2 -> 4.8 GB/s here)."""
    u64, cint = ctypes.c_uint64, ctypes.c_int
    for lib in _xxhash_libs():
        update = getattr(lib, "XXH3_64bits_update_dispatch", None) or \
            getattr(lib, "XXH3_64bits_update", None)
        if update is None or not hasattr(lib, "XXH3_createState"):
            continue
        return (_typed(lib.XXH3_createState, [], u64),
                _typed(lib.XXH3_64bits_reset, [u64], cint),
                _typed(update, [u64, u64, ctypes.c_size_t], cint),
                _typed(lib.XXH3_64bits_digest, [u64], u64),
                _typed(lib.XXH3_freeState, [u64], cint))
    raise OSError("no streaming XXH3 in the xxhash package or a system libxxhash")


# How long a thread waiting for the other side of a split read sleeps between looks.
POLL_US = 20


def _atomics() -> tuple[Any, Any, Any]:
    """Acquire loads, release stores and compare-and-swap on cells of 1-D int64 arrays:
    how the reading and the hashing thread of a split read hand pages over, lock-free."""
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def cell(context: Any, builder: Any, arr_t: Any, idx_t: Any, arr: Any, idx: Any) -> Any:
        ary = context.make_array(arr_t)(context, builder, arr)
        index = context.cast(builder, idx, idx_t, types.intp)
        return cgutils.get_item_pointer(context, builder, arr_t, ary, [index],
                                        wraparound=False)

    def cells(arr: Any) -> bool:
        return isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1

    @intrinsic
    def load_acquire(typingctx: Any, arr: Any, idx: Any) -> Any:
        if not cells(arr):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.load_atomic(cell(context, builder, arr, idx, *args), "acquire", 8)
        return types.int64(arr, idx), codegen

    @intrinsic
    def store_release(typingctx: Any, arr: Any, idx: Any, value: Any) -> Any:
        if not cells(arr):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = cell(context, builder, arr, idx, args[0], args[1])
            builder.store_atomic(context.cast(builder, args[2], value, types.int64), ptr,
                                 "release", 8)
            return context.get_dummy_value()
        return types.void(arr, idx, value), codegen

    @intrinsic
    def compare_swap(typingctx: Any, arr: Any, idx: Any, expected: Any, new: Any) -> Any:
        if not cells(arr):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ptr = cell(context, builder, arr, idx, args[0], args[1])
            old = context.cast(builder, args[2], expected, types.int64)
            value = context.cast(builder, args[3], new, types.int64)
            return builder.extract_value(
                builder.cmpxchg(ptr, old, value, "acq_rel", "acquire"), 1)
        return types.boolean(arr, idx, expected, new), codegen

    return load_acquire, store_release, compare_swap


@functools.cache
def kernels() -> dict[str, Any]:
    """Compile the batch functions (numba turns ctypes calls into direct C calls)."""
    import numba

    lib = libc()
    c_xxh3 = xxh3()
    s_create, s_reset, s_update, s_digest, s_free = xxh3_stream()
    c_open, c_close, c_pread, c_pwritev = lib.open, lib.close, lib.pread, lib.pwritev
    c_preadv = lib.preadv
    c_fsync, c_rename, c_unlink, c_access = lib.fsync, lib.rename, lib.unlink, lib.access
    c_clock, c_usleep, c_memcpy = lib.clock_gettime, lib.usleep, lib.memcpy
    load_acquire, store_release, compare_swap = _atomics()
    monotonic = time.CLOCK_MONOTONIC  # the clock of time.monotonic() on Linux
    o_rdonly, o_write = os.O_RDONLY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    jit = functools.partial(numba.njit, nogil=True)

    @jit
    def checksums(buf: Any, offsets: Any, length: int) -> Any:
        out = np.zeros(offsets.shape[0], np.uint64)
        for i in range(offsets.shape[0]):
            out[i] = c_xxh3(buf.ctypes.data + offsets[i], length)
        return out

    @jit
    def checksums_at(addresses: Any, length: int) -> Any:
        out = np.zeros(addresses.shape[0], np.uint64)
        for i in range(addresses.shape[0]):
            out[i] = c_xxh3(addresses[i], length)
        return out

    @jit
    def settle_split(addresses: Any, length: int, progress: Any, digests: Any,
                     ctl: Any) -> None:
        """The mover's end of a split read or copy: if the helper has not started, claim
        the batch and hash here every page that arrived whole; else wait until the
        helper is done."""
        if compare_swap(ctl, 0, 0, 2):
            for i in range(progress.shape[0]):
                if load_acquire(progress, i) == length:
                    digests[i] = c_xxh3(addresses[i], length)
        else:
            while load_acquire(ctl, 1) == 0:
                c_usleep(POLL_US)

    @jit
    def read_pages(paths: Any, addresses: Any, head: int, length: int,
                   headers: Any, expect: Any, pad_from: int, deadline_ns: int,
                   progress: Any, digests: Any, ctl: Any, chunk: int, bases: Any,
                   ends: Any, same: Any, flags: int, probe: Any) -> Any:
        n = paths.shape[0]
        fd = -1
        # Split: another thread hashes the payloads (follow_hashes) as this one
        # publishes them in progress[i]; else they are hashed here, chunk by chunk.
        split = n > 0 and progress.shape[0] == n
        status = np.zeros(n, np.int64)
        sizes = np.zeros(n, np.int64)
        now = np.zeros(2, np.int64)  # struct timespec
        prefix = expect.shape[1]
        state = s_create()
        iov = np.zeros((2, 2), np.int64)  # struct iovec {base, len}: header, first chunk
        for i in range(n):
            if deadline_ns > 0:
                c_clock(monotonic, now.ctypes.data)
                if now[0] * 1_000_000_000 + now[1] > deadline_ns:
                    status[i:] = NOT_READ
                    if split:
                        for j in range(i, n):
                            store_release(progress, j, -1)
                    break
            done = 0
            if i == 0 or same[i] == 0:  # a record of the file before: its descriptor
                if fd >= 0:
                    c_close(fd)
                fd = c_open(paths[i].ctypes.data, o_rdonly | flags, 0)
            if fd < 0:
                status[i] = MISSING
            else:
                base = bases[i]
                # The header and the payload's first chunk in one call (with O_DIRECT
                # one I/O instead of two: they lie back to back in the file).
                first = min(chunk, length)
                iov[0, 0] = headers[i].ctypes.data
                iov[0, 1] = head
                iov[1, 0] = addresses[i]
                iov[1, 1] = first
                got = c_preadv(fd, iov.ctypes.data, 2 if first > 0 else 1, base)
                total = got
                if got >= head:
                    # The payload chunk by chunk, each hashed (here or by the helper)
                    # while it is in the CPU cache.
                    s_reset(state)
                    got -= head
                    if got > 0:
                        if split:
                            store_release(progress, i, got)
                        else:
                            s_update(state, addresses[i], got)
                        done = got
                    while done < length and got > 0:
                        want = min(chunk, length - done)
                        at = addresses[i] + done
                        got = c_pread(fd, at, want, base + head + done)
                        if got <= 0:
                            break
                        if split:
                            store_release(progress, i, done + got)
                        else:
                            s_update(state, at, got)
                        done += got
                    total = head + done if got >= 0 else got
                    if done == length:
                        if not split:
                            digests[i] = s_digest(state)
                        # Nothing past where the file should end.
                        total += min(max(c_pread(fd, probe.ctypes.data, probe.shape[0],
                                                 ends[i]), 0), 1)
                sizes[i] = total
            if split and done != length:
                store_release(progress, i, -1)  # nothing (more) to hash in this page
        if fd >= 0:
            c_close(fd)
        s_free(state)
        if split:
            settle_split(addresses, length, progress, digests, ctl)
        for i in range(n):
            if status[i] != OK:  # MISSING, NOT_READ
                continue
            if sizes[i] < 0:
                status[i] = UNREADABLE
                continue
            if sizes[i] != head + length:
                status[i] = WRONG_SIZE
                continue
            row = headers[i]
            bad = False
            for b in range(prefix):
                if row[b] != expect[i, b]:
                    bad = True
                    break
            if bad:
                status[i] = BAD_HEADER
                continue
            stored = np.uint64(0)
            for b in range(8):
                stored |= np.uint64(row[prefix + b]) << np.uint64(8 * b)
            if stored != digests[i]:
                status[i] = BAD_CHECKSUM
                continue
            for b in range(pad_from, head):
                if row[b] != 0:
                    status[i] = BAD_PADDING
                    break
        return status, sizes

    @jit
    def follow_hashes(addresses: Any, length: int, progress: Any, digests: Any,
                      ctl: Any) -> bool:
        """The helper's side of a split read or copy: hash each page's bytes (at
        ``addresses[i]``) as the mover publishes them. Unless the mover has finished
        and hashed them itself."""
        if not compare_swap(ctl, 0, 0, 1):
            return False
        state = s_create()
        for i in range(progress.shape[0]):
            s_reset(state)
            done = 0
            while True:
                ready = load_acquire(progress, i)
                if ready < 0:
                    break
                if ready > done:
                    s_update(state, addresses[i] + done, ready - done)
                    done = ready
                    if done == length:
                        digests[i] = s_digest(state)
                        break
                else:
                    c_usleep(POLL_US)
        s_free(state)
        store_release(ctl, 1, 1)
        return True

    @jit
    def write_pages(tmp_paths: Any, paths: Any, src: Any, offsets: Any, length: int,
                    headers: Any, sum_at: int, fsync: bool, skip_existing: bool,
                    bases: Any, last: Any, flags: int, call_bytes: int) -> Any:
        # Rows i..j (``last[j]``) are the records of one file, at ``bases``; its
        # paths are row j's. One temp file, one rename per file. ``call_bytes``: the
        # most one pwritev moves (after the first record of a call).
        n = paths.shape[0]
        status = np.zeros(n, np.int64)
        head = headers.shape[1]
        iov = np.zeros((2 * IOV_RECORDS, 2), np.int64)  # struct iovec {base, len}
        i = 0
        while i < n:
            j = i
            while j < n - 1 and last[j] == 0:
                j += 1
            if skip_existing and c_access(paths[j].ctypes.data, 0) == 0:
                status[i:j + 1] = SKIPPED
                i = j + 1
                continue
            fd = c_open(tmp_paths[j].ctypes.data, o_write | flags, 0o644)
            if fd < 0:
                status[i:j + 1] = OPEN_FAILED
                i = j + 1
                continue
            ok = True
            for r in range(i, j + 1):
                digest = c_xxh3(src.ctypes.data + offsets[r], length)
                for b in range(8):
                    headers[r, sum_at + b] = np.uint8((digest >> np.uint64(8 * b))
                                                      & np.uint64(255))
            # The file's records back to back: one pwritev per IOV_RECORDS records or
            # call_bytes (one system call, and with O_DIRECT one I/O, instead of two per
            # record).
            r = i
            while ok and r <= j:
                k = r
                while (k < j and k - r + 1 < IOV_RECORDS
                       and (k - r + 2) * (head + length) <= call_bytes
                       and bases[k + 1] == bases[k] + head + length):
                    k += 1
                for q in range(r, k + 1):
                    iov[2 * (q - r), 0] = headers[q].ctypes.data
                    iov[2 * (q - r), 1] = head
                    iov[2 * (q - r) + 1, 0] = src.ctypes.data + offsets[q]
                    iov[2 * (q - r) + 1, 1] = length
                want = (k - r + 1) * (head + length)
                ok = c_pwritev(fd, iov.ctypes.data, 2 * (k - r + 1), bases[r]) == want
                r = k + 1
            if ok and fsync:
                ok = c_fsync(fd) == 0
            c_close(fd)
            if not ok:
                c_unlink(tmp_paths[j].ctypes.data)
                status[i:j + 1] = WRITE_FAILED
            elif c_rename(tmp_paths[j].ctypes.data, paths[j].ctypes.data) != 0:
                c_unlink(tmp_paths[j].ctypes.data)
                status[i:j + 1] = RENAME_FAILED
            i = j + 1
        return status

    @jit
    def copy_records(sources: Any, header_dests: Any, dests: Any, head: int, length: int,
                     chunk: int, progress: Any, digests: Any, ctl: Any) -> None:
        # One pass over each record: header, then the payload chunk by chunk, each
        # chunk hashed right after its copy while in the CPU cache: here, or (split)
        # by the helper (follow_hashes) as this thread publishes it in progress[i].
        n = sources.shape[0]
        split = n > 0 and progress.shape[0] == n
        state = s_create()
        for i in range(n):
            c_memcpy(header_dests[i], sources[i], head)
            s_reset(state)
            done = 0
            while done < length:
                want = min(chunk, length - done)
                c_memcpy(dests[i] + done, sources[i] + head + done, want)
                done += want
                if split:
                    store_release(progress, i, done)
                else:
                    s_update(state, dests[i] + done - want, want)
            if not split:
                digests[i] = s_digest(state)
        s_free(state)
        if split:
            settle_split(dests, length, progress, digests, ctl)

    return {"checksums": checksums, "checksums_at": checksums_at, "read_pages": read_pages,
            "follow_hashes": follow_hashes, "write_pages": write_pages,
            "copy_records": copy_records}
