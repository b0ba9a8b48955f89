"""Fault-injecting L3 backend for tests and drills: a file backend that is slow, loses pages or fails.

Select it like any third-party backend::

    "hicache_storage_backend": "dynamic",
    "hicache_storage_backend_extra_config": {
        "module_path": "support.fault_injection",
        "class_name": "FaultyFileBackend",
        "path": "/tmp/l3", "fault_get_delay_s": 0.5}

Faults (extra-config keys, all optional):
- ``fault_get_delay_s``: sleep this long in every ``read`` call (a slow store;
  the gate and ``fault_fail_gets`` act there too).
- ``fault_exists_delay_s``: sleep this long in every ``exists_prefix`` call (a slow
  lookup); the names of the threads that called it are kept in ``exists_threads``.
- ``fault_delete_after_exists``: delete every page file right after a
  ``exists_prefix`` found anything (pages vanishing between lookup and read).
- ``fault_fail_gets``: every read raises ``OSError`` (a store that went down).
- ``fault_unreachable``: the constructor raises ``ConnectionError`` (a store that
  cannot be reached at start).
Everything else is the file backend's (``path``, ``capacity_gb``, ``fsync``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Sequence

from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import ReadBatch, StorageConfig
from hicache.tiers.l3.file.backend import FileBackend

FAULT_KEYS = ("fault_get_delay_s", "fault_delete_after_exists", "fault_fail_gets",
              "fault_exists_delay_s", "fault_unreachable")


class FaultyFileBackend(FileBackend):
    """``FileBackend`` plus the faults named in the module docstring."""

    def __init__(self, config: StorageConfig) -> None:
        extra = dict(config.extra_config)
        faults = {k: extra.pop(k) for k in FAULT_KEYS if k in extra}
        if faults.get("fault_unreachable"):
            raise ConnectionError("injected: the store cannot be reached")
        super().__init__(dataclasses.replace(config, extra_config=extra))
        self.get_delay_s = float(faults.get("fault_get_delay_s", 0.0))
        self.delete_after_exists = bool(faults.get("fault_delete_after_exists", False))
        self.fail_gets = bool(faults.get("fault_fail_gets", False))
        self.exists_delay_s = float(faults.get("fault_exists_delay_s", 0.0))
        self.exists_threads: list[str] = []
        # A test may hold every read in a gate: ``get_entered`` is set once a read
        # waits in it, and it goes on when the test sets ``get_gate``.
        self.get_gate: threading.Event | None = None
        self.get_entered = threading.Event()

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self.exists_threads.append(threading.current_thread().name)
        if self.exists_delay_s:
            time.sleep(self.exists_delay_s)
        found = super().exists_prefix(keys)
        if self.delete_after_exists and found:
            # Everything goes: what was found, and the page objects that may hold the
            # same pages as a span object found (spans.py: pages a store cut out).
            for _, path in self.dir.page_files():
                with contextlib.suppress(FileNotFoundError):  # another thread's lookup
                    os.unlink(path)
        return found

    def _read_faults(self) -> None:
        if self.get_gate is not None:
            self.get_entered.set()
            self.get_gate.wait()
        if self.get_delay_s:
            time.sleep(self.get_delay_s)
        if self.fail_gets:
            raise OSError("injected L3 read failure")

    def register_host_pool(self, pool: HostPagePool) -> None:
        super().register_host_pool(pool)
        # Every read goes through the faults a batch at a time (BATCH_PAGES pages each),
        # without the file backend's deadline inside a batch.
        self.capabilities = dataclasses.replace(self.capabilities, timed=False)

    def read(self, batch: ReadBatch) -> list[bool]:
        self._read_faults()
        return super().read(batch)
