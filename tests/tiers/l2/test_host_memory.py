"""L2 host memory: exact sizes, and the CUDA registration calls.

Registration needs a GPU, which this machine lacks: ``FakeCudart`` stands in for
``torch.cuda.cudart()`` and records the calls (the GPU run of
integration/bench/gpu checks the real one: the Triton kernel reads the pool).
"""

from __future__ import annotations

import mmap

import pytest
import torch

from hicache.tiers.l2 import host_memory
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry


class FakeCudart:
    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size, flags))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("nbytes", [1, 4096, 3 * 2**20 + 5])
def test_pinned_buffer_is_exactly_the_size_asked_and_registered_once(nbytes):
    cudart = FakeCudart()
    buf = host_memory.allocate(nbytes, pin=True, cudart=cudart)
    assert buf.pinned and buf.nbytes == nbytes and buf.tensor.dtype == torch.uint8
    assert cudart.registered == [(buf.tensor.data_ptr(), nbytes, host_memory.REGISTER_FLAGS)]
    buf.tensor[-1] = 7  # writable through to the last byte
    assert int(buf.tensor[-1]) == 7
    buf.release()
    buf.release()
    assert cudart.unregistered == [buf.tensor.data_ptr()]


def test_pageable_buffer_registers_nothing():
    buf = host_memory.allocate(1000, pin=False, cudart=FakeCudart())
    assert not buf.pinned and buf.nbytes == 1000
    assert buf.tensor.data_ptr() % 4096 == 0  # an OS page boundary: O_DIRECT-ready slots
    buf.release()


def _resident_bytes(address: int) -> int:
    """Rss of the mapping that holds ``address``, from /proc/self/smaps (Linux)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pageable_buffer_is_resident_before_it_serves():
    """Every page of a CPU pool is backed at allocation, not at its first copy in the
    forward thread (a fresh mapping of the same size is not: the check can fail)."""
    nbytes = 48 * 2**20
    fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fresh_view = torch.frombuffer(fresh, dtype=torch.uint8)
    assert _resident_bytes(fresh_view.data_ptr()) < nbytes // 2
    buf = host_memory.allocate(nbytes, pin=False)
    assert _resident_bytes(buf.tensor.data_ptr()) >= nbytes
    assert int(buf.tensor.count_nonzero()) == 0  # touched, not written over
    del fresh_view
    fresh.close()


def test_failed_registration_names_the_error_and_the_size():
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of the 0\.00 GB L2 pool failed \(2\)"):
        host_memory.allocate(4096, pin=True, cudart=FakeCudart(fail=2))


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        host_memory.allocate(-1, pin=False)


def test_cpulist_parsing():
    assert host_memory._parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert host_memory._parse_cpulist("") == []


def test_no_numa_binding_for_a_cpu_device():
    assert host_memory.gpu_numa_node(torch.device("cpu")) is None
    assert host_memory.gpu_numa_node(None) is None


def test_pool_views_exactly_its_geometry():
    geometry = PoolGeometry(5, 3, 2, 96)
    pool = HostPagePool(geometry, layout="page_first", pin_memory=False)
    assert pool.nbytes == geometry.buffer_bytes == pool.memory.nbytes
    pool.close()
