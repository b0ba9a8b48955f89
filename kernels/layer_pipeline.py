"""One background copy thread per worker: layer-by-layer loads and saves beside the forward pass.

Contract:
- ``start_load(copy_layer, num_layers)`` queues a task that calls
  ``copy_layer(i)`` for i = 0..num_layers-1 in order and marks each layer
  done; ``wait_layer(i)`` returns once layer i is copied (or failed), so the
  forward pass of layer i starts while later layers are still copying.
- ``submit(kind, fn)`` queues any other copy (saves) behind what is queued.
- ``drain()`` waits for everything queued and returns the failures as
  ``(kind, exception)``; nothing stays in flight across a ``drain``, which is
  what keeps the step-ordering contract of connector/metadata.py.
- Copies release the GIL (torch ``copy_``, the numba kernel), so the thread
  runs while the forward pass computes. A failed copy never raises into the
  caller: it is reported by ``drain`` so the caller can degrade to recompute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)


class LayerPipeline:
    """Runs queued copies in order on one thread; per-layer completion for loads."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-copy")
        self._futures: list[Future[None]] = []
        self._layer_done: list[threading.Event] = []
        self._failures: list[tuple[str, BaseException]] = []
        self._lock = threading.Lock()

    def start_load(self, copy_layer: Callable[[int], None], num_layers: int) -> None:
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

        self._futures.append(self._executor.submit(run))

    def wait_layer(self, layer: int) -> None:
        if layer < len(self._layer_done):
            self._layer_done[layer].wait()

    def submit(self, kind: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by drain()
                self._record(kind, exc)

        self._futures.append(self._executor.submit(run))

    def drain(self) -> list[tuple[str, BaseException]]:
        for future in self._futures:
            future.result()
        self._futures, self._layer_done = [], []
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def shutdown(self) -> None:
        self.drain()
        self._executor.shutdown(wait=True)

    def _record(self, kind: str, exc: BaseException) -> None:
        logger.error("HiCache: %s copy failed: %r", kind, exc)
        with self._lock:
            self._failures.append((kind, exc))
