"""Read a batch of page files with one release of the GIL.

Contract:
- ``read_pages(paths, headers, addrs, payload_bytes)`` reads, for each page
  i, the file ``paths[i]``: its first ``headers.shape[1]`` bytes into
  ``headers[i]`` and the next ``payload_bytes`` into the memory at
  ``addrs[i]`` (a host pool slot). It returns, per page, the bytes read
  (header + payload + at most one byte past them, which tells a longer file
  apart), or -1 when the file could not be opened. The whole batch runs in
  compiled code with the GIL released: ``open`` / ``pread`` / ``close``
  through libc, no Python in between.
- Why: a Python loop of ``os.open`` / ``os.preadv`` / ``os.close`` gives the
  GIL back at every system call, and while vLLM's engine thread computes,
  taking it again waits up to the interpreter's switch interval (5 ms) each
  time. Measured with a thread spinning in Python beside it, 64 pages of
  256 KiB: 172 ms as a Python loop, 15 ms in one call (2.5 ms each when idle).
- ``available()`` is False without numba or a C library to bind (the caller
  keeps its Python loop). numba is imported on first use, like
  kernels/cpu_copy.py, never at module import (vLLM's in-process engine
  start must not see it). The kernel is compiled at the first read, about
  1.3 s here, once per process: numba cannot cache a function bound to
  ctypes pointers. ``warm_up()`` compiles it without reading.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_kernel: Callable[..., None] | None = None
_lock = threading.Lock()


def available() -> bool:
    return importlib.util.find_spec("numba") is not None and os.name == "posix"


def _build() -> Callable[..., None]:
    import numba

    libc = ctypes.CDLL(None, use_errno=True)
    c_open = libc.open
    c_open.argtypes = [ctypes.c_void_p, ctypes.c_int]
    c_open.restype = ctypes.c_int
    c_pread = libc.pread
    c_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    c_pread.restype = ctypes.c_ssize_t
    c_close = libc.close
    c_close.argtypes = [ctypes.c_int]
    c_close.restype = ctypes.c_int
    rdonly = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

    @numba.njit(nogil=True)
    def read_all(fd: int, addr: int, n: int, offset: int) -> int:
        done = 0
        while done < n:
            got = c_pread(fd, addr + done, n - done, offset + done)
            if got <= 0:
                break
            done += got
        return done

    @numba.njit(nogil=True)
    def kernel(paths: Any, headers: Any, addrs: Any, payload: int, extra: Any,
               out: Any) -> None:
        head = headers.shape[1]
        for i in range(paths.shape[0]):
            fd = c_open(paths[i].ctypes.data, rdonly)
            if fd < 0:
                out[i] = -1
                continue
            got = read_all(fd, headers[i].ctypes.data, head, 0)
            if got == head:
                got += read_all(fd, addrs[i], payload, head)
                if got == head + payload:
                    got += read_all(fd, extra.ctypes.data, 1, head + payload)
            c_close(fd)
            out[i] = got

    return kernel


def _get_kernel() -> Callable[..., None]:
    global _kernel
    with _lock:
        if _kernel is None:
            _kernel = _build()
        return _kernel


def warm_up() -> None:
    """Compile the kernel now (a read of no page)."""
    read_pages([], np.zeros((0, 1), dtype=np.uint8), [], 0)


def read_pages(paths: Sequence[str | os.PathLike[str]], headers: np.ndarray,
               addrs: Sequence[int], payload_bytes: int) -> np.ndarray:
    """Bytes read per page (see the module docstring); -1: not opened."""
    encoded = [os.fsencode(p) for p in paths]
    width = max((len(p) for p in encoded), default=0) + 1
    names = np.zeros((len(encoded), width), dtype=np.uint8)
    for i, p in enumerate(encoded):
        names[i, : len(p)] = np.frombuffer(p, dtype=np.uint8)
    out = np.zeros(len(encoded), dtype=np.int64)
    extra = np.zeros(1, dtype=np.uint8)
    _get_kernel()(names, headers, np.asarray(addrs, dtype=np.uint64), payload_bytes, extra,
                  out)
    return out
