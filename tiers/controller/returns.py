"""Prefetches a request books with its ``return_in_s`` hint: the client expects the
conversation's next turn in about that many seconds (an agent waiting on a tool), so
what L3 holds of it is read back into L2 shortly before, with no second client.

Contract:
- ``book(req_id, keys, return_in_s)`` books the prefetch of ``keys`` (the
  finished request's prompt and answer pages: the next turn's history) for
  ``max(0, return_in_s - lead_s)`` seconds from now, as the prefetch operation
  ``return_id(req_id)``, which it returns (the response's
  ``kv_transfer_params.hicache.prefetch_id``). Booking the same id again
  replaces the earlier booking.
- ``run_due()`` starts, oldest due first, every booking whose time has come
  through ``start(op_id, keys)`` (the admin view's: asks L3 what it holds,
  plans the read into L2 as a prefetch operation, wakes an idle engine, so
  ``GET /prefetch/{id}`` follows it from then on). A start that raises is
  logged and kept as ``failed`` (with ``error``; the last ``KEEP_FAILED``):
  a booking is a hint, never a failure of anything else.
- ``view(op_id)``: a booking not yet started, as a prefetch status
  (``booked``, with ``due_in_s``), one being started (``queued``: ``start``
  runs; once it returns, the prefetch operations know the id), or one that
  could not start (``failed``); None once started or unknown. A caller asks
  this before the prefetch operations, so an id is never unknown in between.
  ``cancel(op_id)`` drops a booking not started yet (its view, ``cancelled``);
  for one being started it first waits for ``start`` to return, then answers
  None (cancel the started operation instead); ``pending()`` counts the
  bookings.
- A daemon thread (``start_thread``) runs ``run_due`` when the earliest
  booking is due, woken early by each new booking; ``close()`` ends it.
  Without the thread (tests, with an injected clock) the caller runs
  ``run_due``.
- Engine-free; thread-safe (one lock around the bookings; ``start`` runs
  outside it).
"""

from __future__ import annotations

import heapq
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from hicache.tiers.index.page_keys import PageKey

logger = logging.getLogger(__name__)

# Seconds before the expected return that the read starts (about one L3 read of a
# history; a client that knows better books return_in_s earlier).
LEAD_S = 1.0
# Bookings that could not start, kept for GET /prefetch/{id}.
KEEP_FAILED = 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")


def return_id(req_id: str) -> str:
    """The prefetch operation id of ``req_id``'s booking (the admin's id pattern)."""
    return "return-" + _UNSAFE.sub("_", req_id)[:120]


class ReturnPrefetches:
    """Bookings of ``return_in_s`` prefetches (see the module docstring)."""

    def __init__(self, start: Callable[[str, Sequence[PageKey]], object],
                 lead_s: float = LEAD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._start = start
        self.lead_s = lead_s
        self.clock = clock
        self._cond = threading.Condition()
        # (due, sequence, op id); the live booking of an id is in _booked.
        self._heap: list[tuple[float, int, str]] = []
        self._booked: dict[str, tuple[float, int, tuple[PageKey, ...], float]] = {}
        self._starting: dict[str, float] = {}  # op id -> when it was booked
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.started = 0
        self.failed = 0
        self._failed: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def book(self, req_id: str, keys: Sequence[PageKey], return_in_s: float) -> str:
        op_id = return_id(req_id)
        with self._cond:
            now = self.clock()
            due = now + max(0.0, return_in_s - self.lead_s)
            self._seq += 1
            self._booked[op_id] = (due, self._seq, tuple(keys), now)
            heapq.heappush(self._heap, (due, self._seq, op_id))
            self._cond.notify()
        return op_id

    def _take_due(self) -> list[tuple[str, tuple[PageKey, ...]]]:
        now, out = self.clock(), []
        while self._heap and self._heap[0][0] <= now:
            _, seq, op_id = heapq.heappop(self._heap)
            live = self._booked.get(op_id)
            if live is not None and live[1] == seq:  # not replaced or cancelled
                del self._booked[op_id]
                self._starting[op_id] = live[3]
                out.append((op_id, live[2]))
        return out

    def run_due(self) -> int:
        """Start every booking that is due; how many were started."""
        with self._cond:
            due = self._take_due()
        for op_id, keys in due:
            try:
                self._start(op_id, keys)
                self.started += 1
            except Exception as exc:  # noqa: BLE001 - a hint never fails anything
                self.failed += 1
                logger.warning("HiCache: return_in_s prefetch %s not started: %s", op_id, exc)
                with self._cond:
                    self._failed[op_id] = {
                        "id": op_id, "status": "failed", "pages": 0, "fetched_pages": 0,
                        "ttl_s": None, "age_s": 0.0, "error": f"not started: {exc}"}
                    while len(self._failed) > KEEP_FAILED:
                        self._failed.popitem(last=False)
            finally:
                with self._cond:
                    self._starting.pop(op_id, None)
                    self._cond.notify_all()
        return len(due)

    def view(self, op_id: str) -> dict[str, Any] | None:
        with self._cond:
            if op_id in self._starting:
                return {"id": op_id, "status": "queued", "pages": 0, "fetched_pages": None,
                        "ttl_s": None, "age_s": round(self.clock() - self._starting[op_id], 3)}
            return self._booked_view(op_id) or self._failed.get(op_id)

    def _booked_view(self, op_id: str) -> dict[str, Any] | None:
        live = self._booked.get(op_id)
        if live is None:
            return None
        now = self.clock()
        return {"id": op_id, "status": "booked", "pages": 0, "fetched_pages": None,
                "ttl_s": None, "age_s": round(now - live[3], 3),
                "due_in_s": round(max(0.0, live[0] - now), 3)}

    def cancel(self, op_id: str) -> dict[str, Any] | None:
        """Drop a booking not yet started: its view as ``cancelled``; None when there
        was none (started, failed or unknown), after waiting for a start in progress."""
        with self._cond:
            while op_id in self._starting and not self._closed:
                self._cond.wait(1.0)
            view = self._booked_view(op_id)
            if view is None:
                return None
            del self._booked[op_id]
        return {**view, "status": "cancelled", "fetched_pages": 0}

    def pending(self) -> int:
        with self._cond:
            return len(self._booked)

    def start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hicache-returns",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    wait = self._heap[0][0] - self.clock() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
            self.run_due()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
