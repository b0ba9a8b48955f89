"""One directory of page files and their record format, shared by the file and NIXL backends.

Contract:
- ``PageDirectory(root, ext, key_suffix, config_key)`` makes ``<root>/pages/``,
  ``<root>/tmp/`` and ``<root>/quarantine/`` (``StorageConfigError`` naming
  ``config_key`` when it cannot) and removes temp files whose writer process is
  gone.
- A page lives at ``pages/<xx>/<page key>_<key_suffix><ext>``, ``xx`` the first two
  hex digits of its page key (256 sub-directories, each made on first use by
  ``make_dir``): no directory holds more than about 1/256 of the pages. ``ext``
  names the file format: ``PAGE_EXT`` for the one record both backends write,
  so a file and a NIXL backend pointed at one directory with the same
  fingerprint read each other's pages.
- The record (``PAGE_EXT``): the ``integrity`` header zero-padded to
  ``FILE_HEADER_BYTES`` (4 KiB), then the payload, so the payload starts 4 KiB
  aligned in the file (page-cache copies are whole pages; O_DIRECT can move it
  straight into an aligned slot). Its header carries container layout
  ``FILE_LAYOUT`` (integrity.py ``version_of``); ``PADDING`` is the zeros a
  reader checks. ``name(key)`` is the path relative to
  ``pages/``; ``path(name)`` the full path.
- Writes go to ``temp_path(name)`` (``tmp/``, unique to this process and thread)
  and are renamed into place: readers see a whole page or none.
- ``quarantine(name, reason, fd)`` moves a corrupt page to ``quarantine/`` for
  inspection; given the read's file descriptor it first checks that the file at
  ``name`` is still the one read (another writer may have replaced it with a good
  copy meanwhile, which then stays). False when nothing was moved.
- ``page_files()`` lists every page file of this ``ext`` (the fan-out, and flat
  ``pages/*<ext>`` of earlier layouts); ``clear()`` removes them and the
  quarantined files.
- Thread-safe: every method is a few syscalls on paths; the set of made
  sub-directories only grows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import StorageConfigError

logger = logging.getLogger(__name__)
FANOUT_CHARS = 2
PAGE_EXT = ".page"
# The integrity header, zero-padded: payloads start 4 KiB aligned in the file.
FILE_HEADER_BYTES = 4096
# integrity.py container layout of these records (1: header padded to FILE_HEADER_BYTES).
FILE_LAYOUT = 1
PADDING = bytes(FILE_HEADER_BYTES - integrity.HEADER_BYTES)
QUARANTINE_DIR = "quarantine"


class PageDirectory:
    """``<root>/pages/<xx>/`` page files, ``tmp/`` writes, ``quarantine/``."""

    def __init__(self, root: str | Path, ext: str, key_suffix: str, config_key: str) -> None:
        self.root = Path(root)
        self.ext = ext
        self.pages_dir = self.root / "pages"
        self.tmp_dir = self.root / "tmp"
        self.quarantine_dir = self.root / QUARANTINE_DIR
        try:
            for d in (self.pages_dir, self.tmp_dir, self.quarantine_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageConfigError(
                f"{config_key}={str(root)!r} is not a usable directory: {exc}") from exc
        self.pages = f"{self.pages_dir}{os.sep}"
        self.tmp = f"{self.tmp_dir}{os.sep}"
        self._suffix = f"_{key_suffix}{ext}"
        self._dirs: set[str] = set()
        for stale in self.tmp_dir.glob("*.tmp"):
            if not _pid_alive(stale.name.split(".")[-3]):
                stale.unlink(missing_ok=True)

    # ---- names -------------------------------------------------------------------

    def name(self, key: str) -> str:
        """``key``'s file relative to ``pages/``: ``<xx>/<key>_<suffix><ext>``."""
        return f"{key[:FANOUT_CHARS]}/{key}{self._suffix}"

    def path(self, name: str) -> str:
        return self.pages + name

    def temp_suffix(self) -> str:
        """What this process and thread append to a temp file's name."""
        return f".{os.getpid()}.{threading.get_ident()}.tmp"

    def temp_path(self, name: str, suffix: str | None = None) -> str:
        """Where ``name`` is written before its rename into place."""
        return f"{self.tmp}{name.rpartition('/')[2]}{suffix or self.temp_suffix()}"

    def make_dir(self, name: str) -> None:
        """The fan-out folder of ``name`` (made once per instance)."""
        folder = name.partition("/")[0]
        if folder not in self._dirs:
            os.makedirs(self.pages + folder, exist_ok=True)
            self._dirs.add(folder)

    # ---- listing, quarantine, clearing ---------------------------------------------

    def page_files(self) -> list[tuple[str, str]]:
        """(name relative to pages/, path) of every page file of this format: the
        fan-out and flat ``pages/*<ext>`` of an earlier layout."""
        found = []
        with os.scandir(self.pages_dir) as top:
            for entry in top:
                if entry.name.endswith(self.ext):
                    found.append((entry.name, entry.path))
                elif len(entry.name) == FANOUT_CHARS and entry.is_dir(follow_symlinks=False):
                    try:
                        with os.scandir(entry.path) as sub:
                            found.extend((f"{entry.name}/{e.name}", e.path) for e in sub
                                         if e.name.endswith(self.ext))
                    except FileNotFoundError:
                        continue
        return found

    def quarantine(self, name: str, reason: str, fd: int | None = None) -> bool:
        """Move page ``name`` aside; with ``fd``, only if it is still the file read."""
        path = self.pages + name
        dest = self.quarantine_dir / f"{name.rpartition('/')[2]}.{time.time_ns()}"
        try:
            if fd is not None and os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False  # replaced by a fresh copy meanwhile: that one stays
            os.replace(path, dest)
        except OSError:
            return False  # already gone (another engine quarantined or deleted it)
        logger.warning("HiCache L3: page %s is corrupt (%s); quarantined in %s", name, reason,
                       self.quarantine_dir)
        return True

    def clear(self) -> None:
        """Remove every page file of this format and every quarantined file."""
        for _, path in self.page_files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for entry in os.scandir(self.quarantine_dir):
            if entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _pid_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
