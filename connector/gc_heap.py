"""The worker's GC heap frozen after start, where vLLM itself leaves it unfrozen.

Contract: ``freeze_worker_heap(kv_caches, executor_backend)`` collects and
freezes (``gc.freeze``) the calling process's heap once the KV caches are
registered, when the worker has a process of its own (``"mp"``) and its KV
caches are in CPU memory; it returns the number of objects frozen, or 0 where
it leaves the heap alone. vLLM's GPU worker freezes its heap after warm-up and
its engine core freezes the process it runs in (a worker of the ``"uni"``
executor included), but vLLM's CPU worker in a process of its own never does:
there the objects HiCache allocates each step make Python collect now and then,
and a full collection walks every object of the model and the engine, ~0.5 s
in the forward thread (docs/benchmarks-trace.md). ``unfreeze`` undoes it at
shutdown, as vLLM's engine core does, so an engine closed in-process leaks
nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch


def _device_type(kv_caches: Mapping[str, Any]) -> str | None:
    for value in kv_caches.values():
        tensor = value if isinstance(value, torch.Tensor) else next(iter(value), None)
        if isinstance(tensor, torch.Tensor):
            return tensor.device.type
    return None


def freeze_worker_heap(kv_caches: Mapping[str, Any], executor_backend: Any) -> int:
    """See the module docstring."""
    if executor_backend != "mp" or _device_type(kv_caches) != "cpu":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    gc.unfreeze()
