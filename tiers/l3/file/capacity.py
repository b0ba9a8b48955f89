"""The file backend's capacity: an LRU index of page files with retention, and its eviction.

Contract:
- ``PageIndex(pages, capacity_bytes, on_evict)`` keeps file name -> size in
  access order for one backend instance; ``rebuild(files)`` fills it from
  what is on disk, oldest mtime first (engines sharing a directory each
  keep their own view: a page another engine wrote counts once this one
  sees it).
- ``touch`` / ``touch_all`` move pages to the recent end (a read, a write, a
  lookup that found them); ``forget`` drops one (deleted, missing,
  quarantined); ``clear`` drops all.
- ``make_room(need)`` deletes least-recently-used files (``pages`` + name)
  until ``need`` more bytes fit the capacity (0 = unlimited), calling
  ``on_evict(1)`` per file. A page retained (``retain``: a request's
  ``retain_s``, an admin pin), stored before or after the call, is passed
  over until its deadline (moved to the recent end instead); only when every
  page is retained does the capacity win, oldest first.
- Thread-safe: one lock around the index; files are unlinked outside it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

# Retention entries kept before the expired ones are dropped.
RETAINED_PRUNE_AT = 1 << 16


class PageIndex:
    """Sizes and access order of one directory's page files; see the module docstring."""

    def __init__(self, pages: str, capacity_bytes: int,
                 on_evict: Callable[[int], None]) -> None:
        self._pages = pages
        self.capacity_bytes = capacity_bytes
        self._on_evict = on_evict
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU order
        self._bytes = 0
        self._lock = threading.Lock()
        self.retained: dict[str, float] = {}  # file name -> keep until (epoch seconds)

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def rebuild(self, files: Iterable[tuple[str, str]]) -> None:
        """Index the (name, path) files that exist, oldest first."""
        entries = []
        for name, path in files:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime, name, st.st_size))
        with self._lock:
            self._index.clear()
            self._bytes = 0
            for _, name, size in sorted(entries):
                self._index[name] = size
                self._bytes += size

    def touch(self, name: str, size: int) -> None:
        self.touch_all([name], size)

    def touch_all(self, names: Sequence[str], size: int) -> None:
        """Move these files (each ``size`` bytes) to the recent end, under one lock."""
        if not names:
            return
        with self._lock:
            index = self._index
            for name in names:
                old = index.pop(name, None)
                self._bytes += size - (old or 0)
                index[name] = size

    def forget(self, name: str) -> None:
        with self._lock:
            self.retained.pop(name, None)
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._bytes = 0
            self.retained.clear()

    def retain(self, names: Sequence[str], until: float) -> int:
        """Pass these files over until ``until`` (epoch seconds; 0 ends it)."""
        with self._lock:
            for name in names:
                if until > 0:
                    self.retained[name] = max(until, self.retained.get(name, 0.0))
                else:
                    self.retained.pop(name, None)
            if len(self.retained) > RETAINED_PRUNE_AT:
                now = time.time()
                self.retained = {n: t for n, t in self.retained.items() if t > now}
        return len(names) if until > 0 else 0

    def make_room(self, need: int) -> None:
        if not self.capacity_bytes:
            return
        now = time.time()
        passes = len(self._index)  # retained pages passed over at most once each
        while True:
            with self._lock:
                if self._bytes + need <= self.capacity_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                if passes > 0 and self.retained.get(name, 0.0) > now:
                    passes -= 1
                    self._index[name] = size  # kept: to the recent end
                    continue
                self.retained.pop(name, None)
                self._bytes -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._pages + name)
            self._on_evict(1)
