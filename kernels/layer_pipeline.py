"""Layer-by-layer loads and saves beside the forward pass: a copy thread on CPU, a side
CUDA stream on a GPU.

See DESIGN.md "Processes and threads".

Contract (both modes):
- ``start_load(copy_layer, num_layers)`` queues ``copy_layer(i)`` for
  i = 0..num_layers-1 in order; ``wait_layer(i)`` makes layer i usable by the
  forward pass once layer i is copied (or failed), so the forward pass of
  layer i starts while later layers are still copying.
- ``submit(kind, fn)`` queues any other copy (saves) behind what is queued.
- ``drain()`` waits for everything queued and returns the failures as
  ``(kind, exception)``; nothing stays in flight across a ``drain``.
- ``idle()`` (CPU mode): whether everything queued has run, so the caller may
  copy in its own thread without overtaking the queue.
- ``checkpoint()`` marks the end of what is queued so far: its ``done()``
  answers without blocking whether all of that has run, ``wait()`` blocks
  until it has. Stores that complete across steps (tiers/worker/store_queue.py) are
  followed with checkpoints instead of a ``drain``; ``take_failures()``
  returns the failures recorded so far without waiting.
- A failed copy never raises into the caller: it is reported by ``drain`` so
  the caller can degrade to recompute.

Inline mode (``LayerPipeline(inline=True)``): no thread at all. ``start_load``
and ``submit`` run the copies in the calling thread before they return,
``wait_layer`` returns at once, checkpoints are done when taken, and
``inline`` is True so callers can skip per-layer work that only pays when
copies overlap the forward pass. This is what a CPU engine uses by default:
its forward pass runs OpenMP threads pinned to every core, so a copy thread
that wakes during it takes a core from one of them and every other one waits
for it at the next barrier (docs/benchmarks-trace.md, "Where HiCache's time went");
the copy costs less where the forward pass is not running.

CPU mode (``LayerPipeline()``): one background thread runs the
queued copies in order; ``wait_layer`` blocks the caller until the layer's
copy returned. Copies release the GIL (torch ``copy_``, the numba kernel), so
the thread runs while the forward pass computes (stores that finish across
steps, ``hicache_async_stores``, need it). ``thread_init`` runs first in that
thread (the worker pins it off the forward thread's core).

CUDA mode (``LayerPipeline(device)`` with a CUDA device): copies are enqueued
on a dedicated side stream from the calling thread, and ordering is kept by
CUDA events, never by blocking the host:
- ``start_load`` records an event on the compute stream (the current stream
  at the call) and makes the side stream wait on it, so loads never overwrite
  blocks that earlier compute still reads; then, with the side stream
  current, it calls ``copy_layer(i)`` and records one event per layer.
- ``wait_layer(i)`` makes the current (compute) stream wait on layer i's
  event and returns at once.
- ``submit`` records an event on the compute stream at the call (the point
  where that layer's KV is final), makes the side stream wait on it and calls
  ``fn`` with the side stream current, so a save never stalls the forward.
- ``drain`` synchronises the side stream; a CUDA error raised there is
  reported for every kind queued since the previous drain.
- The callables must enqueue their work on the current stream and may return
  before it is done (``CopyPath.load_async``/``save_async``). Synchronous copy
  functions stay correct (they wait for the side stream) but then the host
  waits for each copy. Exceptions raised while enqueueing are reported like
  failed copies; a failed layer still records its event.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


class Checkpoint:
    """The end of what a pipeline had queued when it was taken (see the module docstring)."""

    def __init__(self, future: Future[None] | None = None,
                 event: torch.cuda.Event | None = None) -> None:
        self._future = future
        self._event = event
        # A CUDA error surfaced while waiting: what was queued cannot be trusted.
        self.failed = False

    def done(self) -> bool:
        """Whether everything queued before the checkpoint has run (never blocks)."""
        if self._future is not None:
            return self._future.done()
        if self._event is None:
            return True
        try:
            return bool(self._event.query())
        except Exception:  # noqa: BLE001 - a CUDA error: done, and failed
            self.failed = True
            return True

    def wait(self) -> bool:
        """Block until done; False when a CUDA error surfaced."""
        if self._future is not None:
            self._future.result()
        elif self._event is not None:
            try:
                self._event.synchronize()
            except Exception:  # noqa: BLE001 - reported as a failed copy by the caller
                self.failed = True
        return not self.failed


class LayerPipeline:
    """Runs queued copies in order (thread or side stream); per-layer completion for loads."""

    def __init__(self, device: torch.device | str | None = None, *,
                 inline: bool = False,
                 thread_init: Callable[[], object] | None = None) -> None:
        self._failures: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()
        dev = torch.device(device) if device is not None else None
        self._cuda = _CudaQueue(dev, self._record) if dev is not None and dev.type == "cuda" \
            else None
        # Inline: every copy in the caller's thread (CPU only; a GPU keeps its stream).
        self.inline = inline and self._cuda is None
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-copy",
                               initializer=thread_init)
            if self._cuda is None and not self.inline else None
        )
        self._futures: list[Future[None]] = []
        self._layer_done: list[threading.Event] = []

    @property
    def on_cuda(self) -> bool:
        """True when copies run on a side CUDA stream (else on a copy thread)."""
        return self._cuda is not None

    def start_load(self, copy_layer: Callable[[int], None], num_layers: int) -> None:
        if self._cuda is not None:
            self._cuda.start_load(copy_layer, num_layers)
            return
        if self.inline:
            self._layer_done = []
            for i in range(num_layers):
                self._run_now("load", functools.partial(copy_layer, i))
            return
        events = [threading.Event() for _ in range(num_layers)]
        self._layer_done = events

        def run() -> None:
            for i, done in enumerate(events):
                try:
                    copy_layer(i)
                except BaseException as exc:  # noqa: BLE001 - reported by drain()
                    self._record("load", exc)
                finally:
                    done.set()

        self._submit(run)

    def wait_layer(self, layer: int) -> None:
        if self._cuda is not None:
            self._cuda.wait_layer(layer)
        elif layer < len(self._layer_done):
            self._layer_done[layer].wait()

    def submit(self, kind: str, fn: Callable[[], None]) -> None:
        if self._cuda is not None:
            self._cuda.submit(kind, fn)
            return
        if self.inline:
            self._run_now(kind, fn)
            return

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by drain()
                self._record(kind, exc)

        self._submit(run)

    def checkpoint(self) -> Checkpoint:
        """A mark after everything queued so far."""
        if self._cuda is not None:
            return Checkpoint(event=self._cuda.checkpoint())
        if self.inline:
            return Checkpoint()  # everything queued has run
        return Checkpoint(future=self._submit(lambda: None))

    def idle(self) -> bool:
        """CPU mode: nothing queued is still running (so a copy made now in the caller's
        thread keeps the queue's order). Always False in CUDA mode, whose copies are
        ordered by the side stream, not by the host."""
        if self._cuda is not None:
            return False
        return all(f.done() for f in self._futures)

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """The failures recorded since the last take (or drain), without waiting."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def drain(self) -> list[tuple[str, BaseException]]:
        if self._cuda is not None:
            self._cuda.drain()
        for future in self._futures:
            future.result()
        self._futures, self._layer_done = [], []
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def shutdown(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _run_now(self, kind: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported by drain()
            self._record(kind, exc)

    def _submit(self, run: Callable[[], None]) -> Future[None]:
        assert self._executor is not None
        future = self._executor.submit(run)
        # Without a drain (stores across steps), keep only what may still run.
        self._futures = [f for f in self._futures if not f.done()]
        self._futures.append(future)
        return future

    def _record(self, kind: str, exc: BaseException) -> None:
        logger.error("HiCache: %s copy failed: %r", kind, exc)
        with self._lock:
            self._failures.append((kind, exc))


class _CudaQueue:
    """CUDA mode of LayerPipeline: one side stream, events for every ordering."""

    def __init__(
        self, device: torch.device, record: Callable[[str, BaseException], None]
    ) -> None:
        self._device = device
        self._record = record
        self._side = torch.cuda.Stream(device=device)
        self._layer_events: list[torch.cuda.Event] = []
        self._pending: set[str] = set()

    def _after_compute(self) -> None:
        """Order the side stream after everything enqueued so far on the compute stream."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        self._side.wait_event(ready)

    def start_load(self, copy_layer: Callable[[int], None], num_layers: int) -> None:
        self._after_compute()
        events = []
        with torch.cuda.stream(self._side):
            for i in range(num_layers):
                try:
                    copy_layer(i)
                except Exception as exc:  # noqa: BLE001 - reported by drain()
                    self._record("load", exc)
                done = torch.cuda.Event()
                done.record(self._side)
                events.append(done)
        self._layer_events = events
        self._pending.add("load")

    def wait_layer(self, layer: int) -> None:
        if layer < len(self._layer_events):
            torch.cuda.current_stream(self._device).wait_event(self._layer_events[layer])

    def submit(self, kind: str, fn: Callable[[], None]) -> None:
        self._after_compute()
        with torch.cuda.stream(self._side):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported by drain()
                self._record(kind, exc)
        self._pending.add(kind)

    def checkpoint(self) -> torch.cuda.Event:
        """An event recorded on the side stream after everything enqueued so far."""
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def drain(self) -> None:
        try:
            self._side.synchronize()
        except Exception as exc:  # noqa: BLE001 - a CUDA error in a queued copy
            for kind in sorted(self._pending):
                self._record(kind, exc)
        self._pending = set()
        self._layer_events = []
