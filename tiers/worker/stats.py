"""What one worker counts and times, and the one tracker that turns totals into per-step increments.

Contract:
- ``WorkerStats`` holds the worker's own counters (L2 copies, errors,
  layer-wise overlap) and the latency observations not reported yet, keyed
  by the ``latency`` rows of ``tiers/metrics.py``.
- ``CopyClock`` times the copies of one kind (loads or stores) of one step
  on the copy path's own clock: ``wrap(fn)`` brackets every call of ``fn``;
  on CUDA with timing events recorded on the stream current at the call
  (the pipeline's side stream), else with ``time.perf_counter``.
  ``take_seconds()``, called once the step's copies are drained, returns
  their summed copy time (the busy time, not the wait for the forward pass)
  and starts over.
- ``CounterDeltas`` is the only delta tracker of the worker's cumulative
  counters: ``take(now)`` returns what moved since the previous take. The
  worker calls it once per step, in ``take_report``; that report is the
  only way counters leave the worker (to the admin view and to vLLM's
  stats, see connector/vllm_metrics.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WorkerStats:
    """Counters of one worker (pages are L2 pages; blocks are vLLM blocks)."""

    loaded_blocks: int = 0
    loaded_bytes: int = 0
    saved_pages: int = 0
    saved_bytes: int = 0
    load_errors: int = 0
    save_errors: int = 0
    # Layer-wise overlap actually used: waits for one layer's load, and layer
    # saves started during the forward pass (not at its end).
    layer_waits: int = 0
    layer_saves_in_forward: int = 0
    # Idle engine steps that waited for an L3 fetch and saw one finish.
    idle_fetch_waits: int = 0
    # Times a step waited for stores of earlier steps (tiers/worker/store_queue.py,
    # "stores across steps").
    store_waits: int = 0
    # Latency key -> seconds observed since the last report.
    observations: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, key: str, seconds: float) -> None:
        self.observations.setdefault(key, []).append(seconds)

    def take_observations(self) -> dict[str, list[float]]:
        taken, self.observations = self.observations, {}
        return taken


class CopyClock:
    """Summed copy time of one step's copies of one kind (see the module docstring)."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self._spans: list[tuple[Any, Any]] = []

    def wrap(self, fn: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            start = self._mark()
            try:
                fn(*args)
            finally:
                self._spans.append((start, self._mark()))

        return timed

    def take_seconds(self) -> float | None:
        """The copy time since the last take (None when nothing was copied)."""
        spans, self._spans = self._spans, []
        if not spans:
            return None
        if not self.cuda:
            return sum(end - start for start, end in spans)
        try:
            return sum(start.elapsed_time(end) for start, end in spans) / 1e3
        except RuntimeError:  # a failed copy left an event unrecorded: no observation
            return None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class CounterDeltas:
    """Increments of cumulative counters between two takes (see the module docstring)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, now: Mapping[str, float]) -> dict[str, float]:
        deltas = {k: v - self._last.get(k, 0) for k, v in now.items()
                  if v != self._last.get(k, 0)}
        self._last.update(now)
        return deltas
