"""Admin prefetch operations: an id per ``POST /prefetch``, its status, its cancel, a TTL
and a bound on how many run at once.

Contract (every call under the scheduler lock; the admin view takes it):
- ``start(op_id, keys, in_l3, ttl_s)`` plans the L3 pages of ``keys[:in_l3]``
  that L2 lacks into L2 (``HiCacheScheduler.plan_prefetch``) under the id
  ``op_id`` (one is made when None). The same id with the same prompt is the
  same operation: its status is returned and nothing new is planned; the same
  id with another prompt raises ``OpConflict``. Two ids on one prompt share
  its one fetch. More than ``max_running`` operations queued or running
  raise ``OpConflict`` (nothing is planned).
- ``ttl_s`` bounds the read: the workers stop reading that many seconds after
  they start it (the fetch's ``timeout_s``); what they read by then stays.
- ``status(op_id)``: ``queued`` (planned, not yet in a step's plan),
  ``running`` (handed to the workers, not yet reported by every rank),
  ``done`` (every planned page reached L2, or L2 held them all already),
  ``failed`` (fewer did: an L3 read failed, or ``ttl_s`` passed first),
  ``cancelled``; with ``pages`` (planned) and ``fetched_pages`` (once ended).
  None for an id it does not know.
- ``cancel(op_id)``: a queued operation is dropped (its slots freed); a
  running one gets a ``CancelFetches`` command for the workers, which stop
  after the batch in flight. Either is ``cancelled`` from then on, with
  ``fetched_pages`` once the workers have reported (the pages they read stay
  in L2). Cancelling a read that two ids share cancels it for both.
- Ended operations are kept for ``status`` until ``keep`` newer ones ended.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hicache.tiers.index.commands import CancelFetches

if TYPE_CHECKING:
    from hicache.tiers.controller.scheduler import HiCacheScheduler
    from hicache.tiers.index.page_keys import PageKey

MAX_RUNNING = 16
KEEP_ENDED = 1024


class OpConflict(Exception):
    """The operation cannot start: its id names another prompt, or too many run."""


@dataclass
class PrefetchOp:
    op_id: str
    prompt: tuple[bytes, ...]  # its page keys: the same id must name the same prompt
    fetch_id: str | None  # None: nothing to read (L2 held it, or L3 held nothing more)
    pages: int
    created: float
    ttl_s: float | None
    cancelled: bool = False
    fetched: int | None = None  # pages that reached L2, once ended

    def view(self, state: str) -> dict[str, Any]:
        return {"id": self.op_id, "status": state, "pages": self.pages,
                "fetched_pages": self.fetched, "ttl_s": self.ttl_s,
                "age_s": round(time.monotonic() - self.created, 3)}


class PrefetchOps:
    """The admin's prefetch operations of one scheduler."""

    def __init__(self, scheduler: HiCacheScheduler, *, max_running: int = MAX_RUNNING,
                 keep: int = KEEP_ENDED, new_id: Callable[[], str] | None = None) -> None:
        self._s = scheduler
        self.max_running = max_running
        self.keep = keep
        self._new_id = new_id or (lambda: uuid.uuid4().hex)
        self._ops: OrderedDict[str, PrefetchOp] = OrderedDict()

    def start(self, op_id: str | None, keys: Sequence[PageKey], in_l3: int,
              ttl_s: float | None = None) -> tuple[dict[str, Any], int]:
        """(the operation's status, the pages this call planned: 0 when the id was
        known, L2 holds them, or the operation joined the prompt's running read)."""
        prompt = tuple(bytes(k) for k in keys)
        op = self._ops.get(op_id) if op_id is not None else None
        if op is not None:
            if op.prompt != prompt:
                raise OpConflict(f"prefetch id {op_id!r} already names another prompt")
            return self._view(op), 0
        self._trim()  # before a read of this prompt can reuse an ended read's id
        if self.running() >= self.max_running:
            raise OpConflict(f"{self.max_running} prefetches are queued or running: wait "
                             "for one to end or cancel one (DELETE /prefetch/{id})")
        planned, fetch_id = self._s.plan_prefetch(keys, in_l3, timeout_s=ttl_s)
        running = self._s.fetches.in_flight.get(fetch_id)
        pages = planned or (len(running.slots) if running is not None else 0)
        op = PrefetchOp(op_id or self._new_id(), prompt, fetch_id if pages else None,
                        pages, time.monotonic(), ttl_s)
        if op.fetch_id is None:
            op.fetched = 0
        self._ops[op.op_id] = op
        self._trim()
        return self._view(op), planned

    def status(self, op_id: str) -> dict[str, Any] | None:
        op = self._ops.get(op_id)
        return None if op is None else self._view(op)

    def cancel(self, op_id: str) -> dict[str, Any] | None:
        op = self._ops.get(op_id)
        if op is None:
            return None
        if self._state(op) in ("queued", "running"):
            op.cancelled = True
            assert op.fetch_id is not None
            if self._s.fetches.cancel_planned(op.fetch_id):
                op.fetched = 0
            else:
                self._s.queue_command(CancelFetches((op.fetch_id,)))
        return self._view(op)

    def running(self) -> int:
        """Distinct reads queued or running, cancelled ones until they end
        (operations that share one count once)."""
        fetches = self._s.fetches
        return len({op.fetch_id for op in self._ops.values()
                    if op.fetch_id is not None and op.fetch_id in fetches.in_flight})

    def _state(self, op: PrefetchOp) -> str:
        fetches = self._s.fetches
        if op.fetched is None and op.fetch_id is not None:
            if op.fetch_id in fetches.in_flight:
                if op.cancelled:  # its workers stop after the batch in flight
                    return "cancelled"
                return "queued" if fetches.is_planned(op.fetch_id) else "running"
            op.fetched = fetches.ended.get(op.fetch_id, 0)
        if op.cancelled:
            return "cancelled"
        return "done" if (op.fetched or 0) >= op.pages else "failed"

    def _view(self, op: PrefetchOp) -> dict[str, Any]:
        return op.view(self._state(op))

    def _trim(self) -> None:
        """Record the outcome of every operation whose read ended (asked for or not),
        then keep the newest ``keep`` ended ones."""
        ended = []
        for op_id, op in self._ops.items():
            self._state(op)
            if op.fetched is not None:
                ended.append(op_id)
        for op_id in ended[: max(0, len(ended) - self.keep)]:
            del self._ops[op_id]
