"""The one guard every L3 backend runs behind: counters, breaker, fail-fast, never raising.

Contract:
- ``GuardedBackend(inner)`` is a ``StorageBackend`` that forwards every call to
  ``inner`` (``factory.create_backend`` wraps every backend, built-in or
  ``dynamic``, so a third-party backend gets all of this without writing it).
  Attributes it does not have (``page_path``, ``settings``...) are ``inner``'s.
- Counters: ``stats()`` is counted here, from each call's results (pages asked,
  hits, misses, bytes, seconds, write failures, lookups), plus what the backend
  reported on its ``report`` during the call (tiers/l3/report.py: corrupt,
  skipped, not started, in place, evicted, errors). Backends keep no counters.
- Never raising: an exception out of a read, write, lookup or delete is logged and
  counted in ``errors``; the call returns False per page / 0 / nothing. Errors
  that mean the caller is wrong (``ValueError``, ``TypeError``,
  ``NotImplementedError``, ``AssertionError``) still propagate, and so do the
  errors of ``register_host_pool`` (the worker's start reports them).
- Breaker (tiers/l3/breaker.py), for a backend that overrides ``answers()``: an
  exception, or ``report.failed(..., down=True)``, opens it; while it is open
  every call fails fast (counted in ``refused_calls``, no call into the backend) until a
  probe thread's ``answers()`` returns True. A backend without a probe is called
  every time.
- Deadline: ``batch_get_until`` on a backend without timed batches starts nothing
  once the deadline has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hicache.tiers.index.spans import SpanRef
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import StorageBackend, StorageStats
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
        self._stats = StorageStats()
        self._lock = threading.Lock()
        probe = type(inner).answers is not StorageBackend.answers
        self._breaker = (Breaker(self.name, inner.answers, probe_interval_s) if probe else None)
        inner.report = Report(on_down=self._trip, is_down=self._is_down, on_loose=self._add)
        # what the I/O thread and the scheduler ask of a backend's class
        vars(self).update(concurrent_lookups=inner.concurrent_lookups,
                          concurrent_io=inner.concurrent_io,
                          uses_pool_checksums=inner.uses_pool_checksums)

    def __getattr__(self, name: str) -> Any:
        # only reached for what the guard lacks: the backend's own attributes
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # an attribute the backend has and the guard does not is the backend's
        inner = self.__dict__.get("inner")
        if inner is not None and name not in self.__dict__ and name in vars(inner):
            setattr(inner, name, value)
        else:
            object.__setattr__(self, name, value)

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
        with self._lock:
            return StorageStats(**self._stats.as_dict())

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

    def _read(self, n: int, call: Callable[[], list[bool]]) -> list[bool]:
        results, tally, seconds = self._call("read", call, [False] * n)
        hits = sum(results)
        asked = n - tally.not_started
        self._add(tally, get_pages=asked, get_hits=hits, get_misses=asked - hits,
                  bytes_read=hits * self.config.page_bytes, read_seconds=seconds)
        return results

    def _write(self, n: int, call: Callable[[], list[bool]], fallback: bool = False) -> list[bool]:
        """``fallback``: pages a call leaves False are stored another way by the caller
        (span objects), so they are not failures."""
        results, tally, seconds = self._call("write", call, [False] * n)
        written = sum(results) - tally.skipped
        self._add(tally, set_pages=written, set_failures=0 if fallback else n - sum(results),
                  bytes_written=written * self.config.page_bytes,
                  write_seconds=seconds if written else 0.0)
        return results

    def _other(self, what: str, call: Callable[[], T], failed: T, **deltas: float) -> T:
        result, tally, _ = self._call(what, call, failed)
        self._add(tally, **deltas)
        return result

    # ---- what the backend offers ----------------------------------------------------------

    @property
    def supports_spans(self) -> bool:
        return self.inner.supports_spans

    @property
    def timed_batches(self) -> bool:
        return self.inner.timed_batches

    def object_key(self, key: str) -> str:
        return self.inner.object_key(key)

    def register_host_pool(self, pool: HostPagePool) -> None:
        self.inner.register_host_pool(pool)
        self.pool = pool

    def answers(self) -> bool:
        return self.inner.answers()

    # ---- reads ------------------------------------------------------------------------------

    def get(self, key: str, target: torch.Tensor) -> bool:
        return self._read(1, lambda: [self.inner.get(key, target)])[0]

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        return self._read(len(keys), lambda: self.inner.batch_get(keys, targets))

    def batch_get_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        return self._read(len(keys), lambda: self.inner.batch_get_v1(keys, host_slots))

    def batch_get_until(self, keys: list[str], host_slots: list[int],
                        deadline: float | None) -> list[bool]:
        if not self.inner.timed_batches:
            if deadline is not None and time.monotonic() > deadline:
                return [False] * len(keys)
            return self.batch_get_v1(keys, host_slots)
        return self._read(len(keys),
                          lambda: self.inner.batch_get_until(keys, host_slots, deadline))

    def batch_get_spans(self, keys: list[str], host_slots: list[int], spans: list[SpanRef],
                        deadline: float | None = None) -> list[bool]:
        return self._read(len(keys),
                          lambda: self.inner.batch_get_spans(keys, host_slots, spans, deadline))

    # ---- writes -----------------------------------------------------------------------------

    def set(self, key: str, value: torch.Tensor) -> bool:
        return self._write(1, lambda: [self.inner.set(key, value)])[0]

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        return self._write(len(keys), lambda: self.inner.batch_set(keys, values))

    def batch_set_v1(self, keys: list[str], host_slots: list[int]) -> list[bool]:
        return self._write(len(keys), lambda: self.inner.batch_set_v1(keys, host_slots))

    def batch_set_spans(self, keys: list[str], host_slots: list[int],
                        spans: list[SpanRef]) -> list[bool]:
        return self._write(len(keys),
                           lambda: self.inner.batch_set_spans(keys, host_slots, spans),
                           fallback=True)

    # ---- lookups and maintenance --------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._other("lookup", lambda: self.inner.exists(key), False, exists_queries=1)

    def batch_exists(self, keys: list[str]) -> int:
        return self._other("lookup", lambda: self.inner.batch_exists(keys), 0,
                           exists_queries=len(keys))

    def delete(self, key: str) -> bool:
        return self._other("delete", lambda: self.inner.delete(key), False)

    def batch_delete(self, keys: list[str]) -> int:
        return self._other("delete", lambda: self.inner.batch_delete(keys), 0)

    def retain(self, keys: list[str], until: float) -> int:
        return self._other("retain", lambda: self.inner.retain(keys, until), 0)

    def clear(self) -> None:
        self._other("clear", self.inner.clear, None)

    def close(self) -> None:
        if self._breaker is not None:
            self._breaker.stop()
        self.inner.close()


def guarded(backend: StorageBackend) -> StorageBackend:
    """``backend`` behind its guard (a guard is not wrapped twice)."""
    return backend if isinstance(backend, GuardedBackend) else GuardedBackend(backend)
