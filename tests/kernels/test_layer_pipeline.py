"""The copy thread (CPU) or side stream (CUDA) lets layer i be used while later layers
are still copying; inline mode (a CPU engine's default) copies in the caller's thread."""

import contextlib
import threading

import pytest
import torch

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


def test_a_checkpoint_is_done_once_everything_queued_before_it_ran():
    pipeline = LayerPipeline()
    gate = threading.Event()
    ran: list[str] = []
    pipeline.submit("save", lambda: (gate.wait(10), ran.append("save")))
    mark = pipeline.checkpoint()
    assert not mark.done()  # never blocks: the save is still gated
    pipeline.submit("save", lambda: ran.append("later"))
    gate.set()
    assert mark.wait() and mark.done()
    assert ran[0] == "save"
    assert pipeline.take_failures() == []
    pipeline.submit("save", lambda: 1 / 0)
    pipeline.checkpoint().wait()
    assert [kind for kind, _ in pipeline.take_failures()] == ["save"]  # without a drain
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


# ---- inline mode -----------------------------------------------------------------


def test_inline_mode_copies_in_the_callers_thread_before_returning():
    pipeline = LayerPipeline(inline=True)
    assert pipeline.inline and not pipeline.on_cuda
    caller = threading.get_ident()
    ran: list[tuple[str, int]] = []
    pipeline.start_load(lambda i: ran.append((f"load{i}", threading.get_ident())), 2)
    assert ran == [("load0", caller), ("load1", caller)]  # done on return
    pipeline.wait_layer(1)  # nothing to wait for
    pipeline.submit("save", lambda: ran.append(("save", threading.get_ident())))
    assert ran[-1] == ("save", caller)
    mark = pipeline.checkpoint()
    assert mark.done() and mark.wait() and pipeline.idle()
    assert not [t for t in threading.enumerate() if t.name.startswith("hicache-copy")]
    pipeline.shutdown()


def test_inline_mode_reports_failures_like_the_thread():
    pipeline = LayerPipeline(inline=True)
    ran: list[str] = []

    def copy_layer(i: int) -> None:
        if i == 1:
            raise OSError("disk on fire")
        ran.append(f"load{i}")

    pipeline.start_load(copy_layer, num_layers=3)  # never raises into the caller
    pipeline.submit("save", lambda: 1 / 0)
    assert ran == ["load0", "load2"]
    assert [kind for kind, _ in pipeline.take_failures()] == ["load", "save"]
    assert pipeline.drain() == []


def test_inline_is_ignored_on_a_gpu_stream(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    pipeline = LayerPipeline("cuda", inline=True)
    assert pipeline.on_cuda and not pipeline.inline


# ---- CUDA mode -------------------------------------------------------------------
# The ordering logic is checked on CPU with fake streams/events that log what
# would be enqueued; the real-GPU tests below skip without CUDA.


class _FakeCuda:
    """Stand-ins for torch.cuda.Stream/Event/current_stream/stream that log operations."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute = _FakeStream("compute", self)
        self.current = self.compute
        self.events = 0

    def install(self, monkeypatch):
        fake = self

        class Event:
            def __init__(self):
                fake.events += 1
                self.id = fake.events

            def record(self, stream):
                fake.log.append((stream.name, "record", self.id))

        @contextlib.contextmanager
        def stream(s):
            previous, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = previous

        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream("side", fake))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(torch.cuda, "stream", stream)


class _FakeStream:
    def __init__(self, name, fake):
        self.name, self.fake = name, fake
        self.fail_sync: BaseException | None = None

    def wait_event(self, event):
        self.fake.log.append((self.name, "wait", event.id))

    def synchronize(self):
        self.fake.log.append((self.name, "sync"))
        if self.fail_sync is not None:
            raise self.fail_sync


def test_cuda_mode_orders_by_events_never_by_host_waits(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    pipeline = LayerPipeline("cuda")
    assert pipeline.on_cuda

    def copy_layer(i):
        fake.log.append((fake.current.name, "copy", i))

    pipeline.start_load(copy_layer, num_layers=3)
    # Loads: after the compute stream's earlier work, one event per layer, on the side stream.
    assert fake.log == [
        ("compute", "record", 1), ("side", "wait", 1),
        ("side", "copy", 0), ("side", "record", 2),
        ("side", "copy", 1), ("side", "record", 3),
        ("side", "copy", 2), ("side", "record", 4),
    ]
    fake.log.clear()
    pipeline.wait_layer(1)
    pipeline.wait_layer(7)  # a layer with nothing to load
    assert fake.log == [("compute", "wait", 3)]  # a stream wait, not a host block
    fake.log.clear()
    pipeline.submit("save", lambda: fake.log.append((fake.current.name, "save")))
    # A save runs on the side stream once the compute stream reached this point.
    assert fake.log == [("compute", "record", 5), ("side", "wait", 5), ("side", "save")]
    assert fake.current is fake.compute
    fake.log.clear()
    assert pipeline.drain() == []
    assert fake.log == [("side", "sync")]
    fake.log.clear()
    pipeline.wait_layer(1)  # events are gone after a drain
    assert fake.log == []
    pipeline.shutdown()


def test_cuda_mode_reports_enqueue_and_stream_failures(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    pipeline = LayerPipeline(torch.device("cuda", 0))

    def copy_layer(i):
        if i == 1:
            raise RuntimeError("bad launch")

    pipeline.start_load(copy_layer, num_layers=3)
    assert sum(1 for entry in fake.log if entry[:2] == ("side", "record")) == 3
    failures = pipeline.drain()
    assert [kind for kind, _ in failures] == ["load"]
    pipeline.submit("save", lambda: None)
    pipeline.start_load(lambda i: None, num_layers=1)
    side = pipeline._cuda._side
    side.fail_sync = RuntimeError("illegal memory access")
    failures = pipeline.drain()
    assert sorted(kind for kind, _ in failures) == ["load", "save"]
    side.fail_sync = None
    assert pipeline.drain() == []


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none on CI machines)")


# ~several seconds of GPU cycles: far longer than the host needs to enqueue the rest
SLOW_CYCLES = 5_000_000_000


@needs_cuda
def test_cuda_loads_overlap_and_wait_layer_does_not_block_the_host():
    pipeline = LayerPipeline(torch.device("cuda"))
    src = [torch.full((1 << 20,), i + 1, dtype=torch.uint8).pin_memory() for i in range(3)]
    dst = [torch.zeros(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(3)]
    torch.cuda.synchronize()

    def copy_layer(i):
        if i == 1:
            torch.cuda._sleep(SLOW_CYCLES)  # a slow layer on the side stream
        dst[i].copy_(src[i], non_blocking=True)

    pipeline.start_load(copy_layer, 3)
    for i in range(3):
        pipeline.wait_layer(i)
    sums = [d.sum() for d in dst]  # enqueued on the compute stream after the waits
    # The host got here while the slow layer still ran: the waits were stream
    # waits, not host synchronisations (an ordering fact, not a timing bound).
    assert not torch.cuda.current_stream().query()
    assert [int(s) for s in sums] == [(i + 1) * (1 << 20) for i in range(3)]
    assert pipeline.drain() == []
    pipeline.shutdown()


@needs_cuda
def test_cuda_save_waits_for_the_compute_stream_not_the_host():
    pipeline = LayerPipeline(torch.device("cuda"))
    kv = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    host = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLOW_CYCLES)
    kv.fill_(7)  # the layer's KV becomes final only after the sleep
    pipeline.submit("save", lambda: host.copy_(kv, non_blocking=True))
    assert not torch.cuda.current_stream().query()  # submit returned; the GPU still sleeps
    assert pipeline.drain() == []
    assert bool((host == 7).all())
    pipeline.shutdown()
