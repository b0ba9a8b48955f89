"""The copy thread lets layer i be used while later layers are still copying."""

import threading

from hicache.kernels.layer_pipeline import LayerPipeline


def test_layer_is_ready_before_later_layers_finish():
    pipeline = LayerPipeline()
    gate = threading.Event()
    copied: list[int] = []

    def copy_layer(i: int) -> None:
        if i >= 1:
            assert gate.wait(10), "test gate never opened"
        copied.append(i)

    pipeline.start_load(copy_layer, num_layers=3)
    pipeline.wait_layer(0)  # must not need layers 1 and 2
    assert copied == [0]
    gate.set()
    pipeline.wait_layer(2)
    assert copied == [0, 1, 2]
    assert pipeline.drain() == []
    pipeline.shutdown()


def test_failures_are_reported_not_raised_and_later_work_still_runs():
    pipeline = LayerPipeline()
    ran: list[str] = []

    def copy_layer(i: int) -> None:
        if i == 1:
            raise OSError("disk on fire")
        ran.append(f"load{i}")

    pipeline.start_load(copy_layer, num_layers=3)
    pipeline.submit("save", lambda: ran.append("save"))
    pipeline.wait_layer(2)  # a failed layer still counts as done
    failures = pipeline.drain()
    assert [kind for kind, _ in failures] == ["load"]
    assert ran == ["load0", "load2", "save"]
    assert pipeline.drain() == []  # nothing stays in flight after a drain
    pipeline.shutdown()
