"""What an L3 backend tells the guard around it: the facts only the backend can see.

Contract:
- Every backend has a ``report`` (``StorageBackend.report``). The guard
  (tiers/l3/guard.py) counts what it can read off each call's results (pages
  asked, hits, misses, bytes, seconds, failures) and hands the backend a report
  bound to its own counters and breaker; a backend built without a guard has a
  detached report, which keeps nothing.
- During a guarded call the backend adds what the results cannot show:
  ``corrupt(n)`` pages that failed their check (still misses), ``skipped(n)``
  pages a write found stored already (still True), ``not_started(n)`` pages a
  timed read left at its deadline (False, but neither read nor missed),
  ``in_place(n)`` pages copied from store memory this process holds, and
  ``evicted(n)`` pages the backend removed to make room.
- ``failed(reason, down=False, count=1)`` counts errors; ``down=True`` says the store
  stopped answering, and the guard's breaker opens (calls fail fast until the
  backend's ``answers()`` probe returns True). ``down`` is whether the breaker is
  open now, for a backend that wants to stop inside a long batch.
- Thread-safe: per-batch tallies are kept per thread, so batches on several
  threads (``capabilities.concurrent_io``) never mix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class BatchTally:
    """What the backend reported during one guarded call."""

    corrupt: int = 0
    skipped: int = 0
    not_started: int = 0
    in_place: int = 0
    evicted: int = 0
    errors: int = 0


class Report:
    """The backend's side of its guard: ``corrupt``, ``skipped``, ``failed`` and the rest."""

    def __init__(self, on_down: Callable[[str], None] | None = None,
                 is_down: Callable[[], bool] | None = None,
                 on_loose: Callable[[BatchTally], None] | None = None) -> None:
        self._on_down = on_down
        self._is_down = is_down
        # where a fact reported outside any guarded call goes (evictions of a
        # background thread, an error of a heartbeat)
        self._on_loose = on_loose
        self._local = threading.local()

    @property
    def down(self) -> bool:
        """True while the guard's breaker is open (never for a detached report)."""
        return self._is_down is not None and self._is_down()

    def begin(self) -> BatchTally:
        """Start this thread's tally of one call (the guard's side; calls do not nest)."""
        self._local.tally = BatchTally()
        return self._local.tally

    def end(self) -> None:
        self._local.tally = None

    def _add(self, field: str, n: int) -> None:
        tally = getattr(self._local, "tally", None)
        if tally is not None:
            setattr(tally, field, getattr(tally, field) + n)
        elif self._on_loose is not None:
            loose = BatchTally()
            setattr(loose, field, n)
            self._on_loose(loose)

    def corrupt(self, pages: int) -> None:
        self._add("corrupt", pages)

    def skipped(self, pages: int) -> None:
        self._add("skipped", pages)

    def not_started(self, pages: int) -> None:
        self._add("not_started", pages)

    def in_place(self, pages: int) -> None:
        self._add("in_place", pages)

    def evicted(self, pages: int) -> None:
        self._add("evicted", pages)

    def failed(self, reason: str, down: bool = False, count: int = 1) -> None:
        """``count`` errors (one by default); ``down``: the store stopped answering
        (the breaker opens)."""
        self._add("errors", count)
        if down and self._on_down is not None:
            self._on_down(reason)
