"""A circuit breaker for an L3 store that fails: calls fail fast until a probe says it is back.

Contract:
- ``Breaker(name, probe, interval_s)``: closed at start. ``trip(reason)`` opens it
  (False when it was open already or stopped) and starts one daemon thread that
  calls ``probe()`` every ``interval_s`` seconds; the first probe that returns True
  closes the breaker and ends the thread. A probe that raises counts as False.
- ``is_open``: whether calls should fail fast now; ``reason``: why it last opened.
- ``stop()``: no more probing (the backend is closing); a stopped breaker never
  opens again and ``trip`` is then a no-op.
- Thread-safe. Used by the Mooncake and LMCache backends, whose calls to a dead
  server would each wait out a timeout; a third-party backend can use it the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Breaker:
    """Open on the first failure; a probe thread closes it when the store answers."""

    def __init__(self, name: str, probe: Callable[[], bool], interval_s: float = 0.5) -> None:
        self.name = name
        self._probe = probe
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._open = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reason = ""

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def trip(self, reason: str) -> bool:
        """Open the breaker and start probing; False if it was open already or stopped."""
        with self._lock:
            if self._open or self._stop.is_set():
                return False
            self._open = True
            self.reason = reason
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"hicache-{self.name}-probe")
            self._thread.start()
        logger.warning("%s failed (%s); calls fail fast until it answers", self.name, reason)
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                back = self._probe()
            except Exception:  # noqa: BLE001 - a probe that raises: still down
                back = False
            if back:
                with self._lock:
                    self._open = False
                logger.warning("%s answers again", self.name)
                return
