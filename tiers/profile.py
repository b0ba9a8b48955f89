"""The step profile: where each engine step's time goes, one JSON line per step.

See DESIGN.md "Processes and threads" and docs/benchmarks-trace.md ("The step profile").

Contract:
- Off unless the environment variable ``HICACHE_PROFILE`` names a file
  (``profile_path()``); then every process that builds a connector
  (the scheduler half in the engine core, the worker half in each worker)
  appends its records to that file, each record one ``write`` of one line
  (``O_APPEND``), so processes never interleave inside a line.
- ``HookClock`` times the connector hooks of one process: ``call(name, fn,
  ...)`` runs a hook and adds its seconds and calls; ``take()`` returns and
  resets what was added since. The connector adapter (connector/profile.py)
  wraps vLLM's hooks with it; this module never sees vLLM's objects.
- ``GcClock`` adds up the seconds Python's garbage collector ran in this process
  (any thread) and how many collections of each generation it made, from
  ``gc.callbacks``; ``take()`` returns ``{"s": seconds, "collections": [gen0,
  gen1, gen2]}`` since the last take. A full collection walks every object the
  process tracks, so a cache that holds many live objects makes it longer.
- ``ThreadClock`` reads, without stopping anything, the CPU seconds of the
  calling thread (the forward thread in a worker, the scheduling thread in
  the engine core), of HiCache's own threads (named ``hicache-*``) and of
  the whole process, and the seconds the calling thread waited, runnable,
  for a CPU (``/proc/thread-self/schedstat``, Linux; 0 elsewhere).
  ``delta()`` is what changed since the previous call, with
  ``hicache_by_thread``: the helper threads' CPU seconds per family (the
  name without its pool index: ``hicache-l3``, ``hicache-l3-fetch``,
  ``hicache-copy``...), families that used none left out.
- A record is a plain dict: ``role`` ("scheduler" | "worker"), ``connector``
  (the instrumented class: inside vLLM's MultiConnector each child writes its
  own), ``pid``,
  ``seq`` (the step's plan number, the same in both halves' records of a
  step), wall-clock ``t0``/``t1``, ``hooks`` ({name: [calls, seconds]}),
  ``cpu`` (ThreadClock's delta), ``gc`` (GcClock's take) and the role's own fields (the adapter's
  docstring lists them). Readers (integration/bench/profile_report.py) join
  the halves by ``seq``.
- Profiling never changes what the connector does; a record that cannot be
  written is dropped with one warning.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

PROFILE_ENV = "HICACHE_PROFILE"
# HiCache's helper threads are named with this prefix (copy, L3 I/O, verify, probes).
THREAD_PREFIX = "hicache-"

T = TypeVar("T")

# A pool's index at the end of a thread name: "hicache-copy_0", "hicache-l3-fetch-1".
_POOL_INDEX = re.compile(r"[-_]\d+$")


def profile_path() -> str | None:
    """The file ``HICACHE_PROFILE`` names, or None (profiling off)."""
    path = os.environ.get(PROFILE_ENV, "").strip()
    return path or None


class HookClock:
    """Seconds and calls per hook name since the last ``take``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._spent: dict[str, list[float]] = {}

    def call(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = self.clock()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = self._spent.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += self.clock() - start

    def take(self) -> dict[str, list[float]]:
        spent, self._spent = self._spent, {}
        return {k: [int(n), round(s, 6)] for k, (n, s) in spent.items()}


class GcClock:
    """Seconds in garbage collection and collections per generation since ``take``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started: float | None = None
        self._seconds = 0.0
        self._collections = [0, 0, 0]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            self._seconds += self.clock() - self._started
            self._started = None
            generation = int(info.get("generation", 0))
            if 0 <= generation < len(self._collections):
                self._collections[generation] += 1

    def take(self) -> dict[str, Any]:
        out = {"s": round(self._seconds, 6), "collections": list(self._collections)}
        self._seconds, self._collections = 0.0, [0, 0, 0]
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def _schedstat_wait_s() -> float:
    """Seconds the calling thread has waited on a run queue (0 where unknown)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class ThreadClock:
    """CPU seconds of the calling thread, of HiCache's threads and of the process."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _helper_cpu_s() -> dict[str, float]:
        by_family: dict[str, float] = {}
        for t in threading.enumerate():
            if not t.name.startswith(THREAD_PREFIX) or t.ident is None:
                continue
            try:
                cpu = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, AttributeError):
                continue  # ended meanwhile, or no per-thread clocks here
            family = _POOL_INDEX.sub("", t.name)
            by_family[family] = by_family.get(family, 0.0) + cpu
        return by_family

    def _read(self) -> dict[str, Any]:
        return {"thread": time.thread_time(), "hicache_threads": self._helper_cpu_s(),
                "process": time.process_time(), "thread_waited": _schedstat_wait_s()}

    def delta(self) -> dict[str, Any]:
        now = self._read()
        last, self._last = self._last, now
        out: dict[str, Any] = {k: round(now[k] - last[k], 6)
                               for k in ("thread", "process", "thread_waited")}
        families = {}
        for family, cpu in now["hicache_threads"].items():
            # A thread that ended since the last read takes its seconds with it;
            # a family never goes below zero.
            used = round(max(0.0, cpu - last["hicache_threads"].get(family, 0.0)), 6)
            if used > 0:
                families[family] = used
        out["hicache_threads"] = round(sum(families.values()), 6)
        out["hicache_by_thread"] = families
        return out


class ProfileWriter:
    """Appends records to the profile file as single-line writes."""

    def __init__(self, path: str, role: str, connector: str = "") -> None:
        self.path = path
        self.role = role
        self.connector = connector
        self.pid = os.getpid()
        self._fd: int | None = None
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        if self._failed:
            return
        line = json.dumps({"role": self.role, "connector": self.connector, "pid": self.pid,
                           **record},
                          separators=(",", ":")) + "\n"
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(self._fd, line.encode())
        except OSError as exc:
            self._failed = True
            logger.warning("HiCache: the step profile cannot be written to %s (%s); "
                           "profiling stops", self.path, exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
