"""A CPU worker in a process of its own freezes its GC heap once its KV caches are
registered; nowhere else; ``unfreeze`` undoes it. Run in fresh processes: freezing
the test process's heap would keep later engines' garbage."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import gc, sys, torch
from hicache.connector import gc_heap
kv = {"layer.0": torch.zeros(4, 8, device=sys.argv[2])}
if sys.argv[3] == "list":
    kv = {"layer.0": [kv["layer.0"]]}
frozen = gc_heap.freeze_worker_heap(kv, sys.argv[1])
assert frozen == gc.get_freeze_count(), (frozen, gc.get_freeze_count())
gc_heap.unfreeze()
print(frozen > 0, gc.get_freeze_count())
"""


@pytest.mark.parametrize(("backend", "device", "form", "frozen"), [
    ("mp", "cpu", "tensor", True),      # vLLM's CPU worker in its own process
    ("mp", "cpu", "list", True),        # a layer given as a list of tensors
    ("uni", "cpu", "tensor", False),    # the engine core's process: vLLM freezes it
    ("mp", "meta", "tensor", False),    # not CPU memory (a GPU worker freezes itself)
    (None, "cpu", "tensor", False),
])
def test_freezes_only_a_cpu_worker_in_a_process_of_its_own(backend, device, form, frozen):
    done = subprocess.run([sys.executable, "-c", CHECK, str(backend), device, form],
                          capture_output=True, text=True, timeout=300)  # a hang guard
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(frozen), "0"]  # and unfreeze undid it
