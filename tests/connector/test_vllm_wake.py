"""connector/vllm_wake.py: finding the engine core's input queue above the connector's
constructor, and vLLM's own WAKEUP sentinel on it. The engine test is
tests/e2e/test_engine_admin.py (a prefetch on an idle engine)."""

from __future__ import annotations

import queue

from vllm.v1.engine import EngineCoreRequestType

from hicache.connector.vllm_wake import EngineWake


class _EngineCore:
    """What vLLM's EngineCoreProc has when it builds its scheduler: an input queue
    and the dispatcher that reads it."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.wake = self._build_scheduler()

    def _build_scheduler(self) -> EngineWake:
        return _Connector().wake

    def _handle_client_request(self, request_type, request) -> None: ...


class _Connector:
    def __init__(self) -> None:
        self.wake = EngineWake.find()


def test_the_queue_of_the_engine_core_that_builds_the_connector_is_found():
    core = _EngineCore()
    assert core.wake.available
    assert core.wake.wake() is True
    assert core.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)


def test_without_an_engine_core_above_it_wake_does_nothing():
    class Holder:  # an input_queue alone is not an engine core
        def __init__(self) -> None:
            self.input_queue: queue.Queue = queue.Queue()
            self.wake = EngineWake.find()

    holder = Holder()
    assert not holder.wake.available
    assert holder.wake.wake() is False
    assert holder.input_queue.empty()
