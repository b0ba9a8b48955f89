"""Waking vLLM's idle engine core when HiCache has work for its workers.

Contract:
- ``EngineWake.find()`` is called while vLLM builds the scheduler-side
  connector, which happens inside the engine core's constructor (vLLM
  0.32: ``EngineCoreProc.__init__`` -> ``EngineCore.__init__`` ->
  ``Scheduler`` -> the connector). It finds that engine core's input queue on
  the call stack: the queue an idle engine core blocks on.
- ``wake()`` puts vLLM's own ``WAKEUP`` sentinel on that queue. The idle
  engine core then asks ``has_work()`` again, which asks the connector's
  ``has_pending_push_work()``; while that answers True the engine takes
  steps without a forward pass, and each one carries HiCache's plan (admin
  prefetches, L3 commands) to the workers and their reports back.
- Where no queue is found (an in-process engine, stepped by its caller; a
  vLLM that builds the connector elsewhere) ``wake()`` does nothing: the work
  then goes with the engine's next step.
"""

from __future__ import annotations

import logging
import queue
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

logger = logging.getLogger(__name__)

# Frames above the connector's constructor searched for the engine core.
_MAX_DEPTH = 40


class EngineWake:
    """The input queue of the engine core that built this connector, if found."""

    def __init__(self, input_queue: queue.Queue[Any] | None) -> None:
        self._queue = input_queue

    @classmethod
    def find(cls) -> EngineWake:
        frame: FrameType | None = sys._getframe(1)
        for _ in range(_MAX_DEPTH):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            q = getattr(owner, "input_queue", None)
            if isinstance(q, queue.Queue) and hasattr(owner, "_handle_client_request"):
                return cls(q)
            frame = frame.f_back
        logger.info("HiCache: no engine core input queue above the connector (an "
                    "in-process engine?): admin work waits for the engine's next step")
        return cls(None)

    @property
    def available(self) -> bool:
        return self._queue is not None

    def wake(self) -> bool:
        """Wake the engine core if it idles; False when this engine cannot be woken."""
        if self._queue is None:
            return False
        from vllm.v1.engine import EngineCoreRequestType

        self._queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        return True
