"""The one guard every L3 backend runs behind: counters, breaker, fail-fast, never raising.

Contract:
- ``GuardedBackend(inner)`` is a ``StorageBackend`` that forwards the seven
  verbs of the contract (tiers/l3/base.py) and ``register_host_pool`` to
  ``inner``, explicitly; nothing else reaches through (``inner`` is there for
  what only a test or a tool asks of a backend). ``factory.create_backend``
  wraps every backend, built-in or ``dynamic``, so a third-party backend gets
  all of this without writing it.
- Counters: ``stats()`` is counted here, from each call's results (pages asked,
  hits, misses, bytes, seconds, write failures, lookups), plus what the backend
  reported on its ``report`` during the call (tiers/l3/report.py: corrupt,
  skipped, not started, in place, evicted, errors). Backends keep no counters.
- Never raising: this is the one place where a backend's exception becomes a
  miss. An exception out of a read, write, lookup, delete, clear or retain is
  logged and counted in ``errors``; the call returns False per page / 0 /
  nothing. Errors that mean the caller is wrong (``ValueError``,
  ``TypeError``, ``NotImplementedError``, ``AssertionError``) still
  propagate, and so do the errors of ``register_host_pool`` (the worker's
  start reports them).
- Breaker (tiers/l3/breaker.py), for a backend with ``capabilities.probe``: an
  exception, or ``report.failed(..., down=True)``, opens it; while it is open
  every call fails fast (counted in ``refused_calls``, no call into the
  backend) until a probe thread's ``answers()`` returns True. A backend
  without a probe is called every time.
- Deadline: a read whose deadline has passed starts nothing where the backend
  does not honour deadlines itself (``capabilities.timed``).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageStats, WriteBatch
from hicache.tiers.l3.breaker import Breaker
from hicache.tiers.l3.report import BatchTally, Report

logger = logging.getLogger(__name__)
T = TypeVar("T")
# errors of the caller, not of the store: they propagate
CALLER_ERRORS = (ValueError, TypeError, NotImplementedError, AssertionError)
PROBE_INTERVAL_S = 0.5


class GuardedBackend(StorageBackend):
    """``inner`` behind the counters, the breaker and the never-raise rule."""

    def __init__(self, inner: StorageBackend, probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.name = type(inner).__name__
        self.capabilities = inner.capabilities
        self.pool = inner.pool
        self._stats = StorageStats()
        self._lock = threading.Lock()
        self._breaker = (Breaker(self.name, inner.answers, probe_interval_s)
                         if inner.capabilities.probe else None)
        inner.report = Report(on_down=self._trip, is_down=self._is_down, on_loose=self._add)

    # ---- breaker ------------------------------------------------------------------------

    def _is_down(self) -> bool:
        return self._breaker is not None and self._breaker.is_open

    def _trip(self, reason: str) -> None:
        if self._breaker is not None:
            self._breaker.trip(reason)

    @property
    def reachable(self) -> bool:
        """False while the breaker is open (the store stopped answering)."""
        return not self._is_down()

    @property
    def last_error(self) -> str:
        """Why the breaker last opened ("" if it never did)."""
        return "" if self._breaker is None else self._breaker.reason

    # ---- counting -------------------------------------------------------------------------

    def _add(self, tally: BatchTally, **deltas: float) -> None:
        with self._lock:
            s = self._stats
            s.corrupt_pages += tally.corrupt
            s.set_skipped_existing += tally.skipped
            s.pages_in_place += tally.in_place
            s.evicted_pages += tally.evicted
            s.errors += tally.errors
            for name, delta in deltas.items():
                setattr(s, name, getattr(s, name) + delta)

    def stats(self) -> StorageStats:
        """This backend's counters so far (a copy)."""
        with self._lock:
            # Every field is a number: a shallow copy is the whole copy (``asdict``
            # would deep-copy field by field; the worker reads this every step).
            return copy.copy(self._stats)

    def _call(self, what: str, call: Callable[[], T], failed: T) -> tuple[T, BatchTally, float]:
        """``call()`` with this thread's tally; ``failed`` when the breaker is open or it
        raised (counted as an error, opening the breaker)."""
        if self._is_down():
            with self._lock:
                self._stats.refused_calls += 1
            return failed, BatchTally(), 0.0
        report = self.inner.report
        tally = report.begin()
        t0 = time.perf_counter()
        try:
            result = call()
        except CALLER_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing store is counted, not raised
            logger.warning("HiCache L3 %s: %s failed: %s: %s", self.name, what,
                           type(exc).__name__, exc)
            tally.errors += 1
            self._trip(f"{what}: {type(exc).__name__}: {exc}")
            result = failed
        finally:
            report.end()
        return result, tally, time.perf_counter() - t0

    def _other(self, what: str, call: Callable[[], T], failed: T, **deltas: float) -> T:
        result, tally, _ = self._call(what, call, failed)
        self._add(tally, **deltas)
        return result

    # ---- the verbs --------------------------------------------------------------------------

    def register_host_pool(self, pool: HostPagePool) -> None:
        self.inner.register_host_pool(pool)
        self.pool = pool
        self.capabilities = self.inner.capabilities

    def read(self, batch: ReadBatch) -> list[bool]:
        n = len(batch.keys)
        if (not self.capabilities.timed and batch.deadline is not None
                and time.monotonic() > batch.deadline):
            return [False] * n
        results, tally, seconds = self._call("read", lambda: self.inner.read(batch), [False] * n)
        hits = sum(results)
        asked = n - tally.not_started
        self._add(tally, get_pages=asked, get_hits=hits, get_misses=asked - hits,
                  bytes_read=hits * self.config.page_bytes, read_seconds=seconds)
        return results

    def write(self, batch: WriteBatch) -> list[bool]:
        """Pages a span write leaves False are stored another way by the caller (page
        objects), so they are not failures."""
        n = len(batch.keys)
        results, tally, seconds = self._call("write", lambda: self.inner.write(batch),
                                             [False] * n)
        written = sum(results) - tally.skipped
        failures = 0 if batch.spans is not None else n - sum(results)
        self._add(tally, set_pages=written, set_failures=failures,
                  bytes_written=written * self.config.page_bytes,
                  write_seconds=seconds if written else 0.0)
        return results

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self._other("lookup", lambda: self.inner.exists_prefix(keys), 0,
                           exists_queries=len(keys))

    def delete(self, keys: Sequence[str]) -> int:
        return self._other("delete", lambda: self.inner.delete(keys), 0)

    def clear(self) -> None:
        self._other("clear", self.inner.clear, None)

    def retain(self, keys: Sequence[str], until: float) -> int:
        return self._other("retain", lambda: self.inner.retain(keys, until), 0)

    def answers(self) -> bool:
        return self.inner.answers()

    def close(self) -> None:
        if self._breaker is not None:
            self._breaker.stop()
        self.inner.close()


def guarded(backend: StorageBackend) -> GuardedBackend:
    """``backend`` behind its guard (a guard is not wrapped twice)."""
    return backend if isinstance(backend, GuardedBackend) else GuardedBackend(backend)
