"""When background work may start beside vLLM's forward pass (a CPU engine's cores).

See DESIGN.md "Processes and threads".

Contract:
- ``ForwardGate(cv, enabled, max_defer_s)`` shares the condition variable of the
  thread it holds back (tiers/worker/l3_io.py); callers of ``wait_s`` hold it.
- ``started()`` / ``ended()``: the worker's step hooks mark a forward pass
  (begin_step, finish_step); ``ended`` wakes the waiting thread.
- ``wait_s(stopping)``: seconds work must still wait (0: it may start now): 0 when
  the gate is off (``enabled`` False: a GPU engine, whose host is free while it
  computes), no pass runs, the thread is stopping, or the pass has run for
  ``max_defer_s`` already (its own gap is too far off).
- Work already running is never stopped: the gate only says when to start.
"""

from __future__ import annotations

import threading
import time

# Longest work waits for a forward pass to end.
MAX_DEFER_S = 1.0


class ForwardGate:
    """Whether a forward pass runs now, for the threads that yield to it."""

    def __init__(self, cv: threading.Condition, enabled: bool,
                 max_defer_s: float = MAX_DEFER_S) -> None:
        self.cv = cv
        self.enabled = enabled
        self.max_defer_s = max_defer_s
        self._since: float | None = None  # monotonic start of the running pass

    def started(self) -> None:
        if self.enabled:
            with self.cv:
                self._since = time.monotonic()

    def ended(self) -> None:
        if self.enabled:
            with self.cv:
                self._since = None
                self.cv.notify_all()

    def wait_s(self, stopping: bool = False) -> float:
        if self._since is None or stopping:
            return 0.0
        return max(0.0, self._since + self.max_defer_s - time.monotonic())
