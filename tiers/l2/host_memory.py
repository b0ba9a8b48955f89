"""Host memory for the L2 pool: exactly the bytes asked for, page-locked for a GPU.

Contract:
- ``allocate(nbytes, pin=..., device=...)`` returns a ``HostBuffer`` whose
  ``tensor`` is a 1-D uint8 CPU tensor of exactly ``nbytes`` bytes.
- Both start as anonymous ``mmap`` memory (transparent huge pages advised),
  so the buffer starts on an OS page boundary: slots of 4 KiB multiples are then
  aligned for the file L3's O_DIRECT batches.
- ``pin=False``: that memory, pageable, as on a CPU-only host, with every page
  faulted in before ``allocate`` returns (``prefault``), as vLLM's own CPU KV
  cache (``torch.zeros``) is. Left to fault lazily, the first copy into each
  page would pay the fault (huge-page zeroing, at times compaction) in the
  forward thread while serving, and a pool larger than the traffic would keep
  paying it (docs/benchmarks.md measures both).
- ``pin=True``: then ``cudaHostRegister`` (portable + mapped), so the DMA engines and the
  Triton copy kernel (unified addressing: the host pointer is valid on the
  device) reach it directly. Exactly ``nbytes`` rounded up to the OS page is
  locked. torch's ``pin_memory=True`` goes through its caching host
  allocator, which rounds every allocation up to a power of two: a 40 GB
  pool would lock 64 GB of the host (LMCache#1147, vllm#56410).
- NUMA: registering faults every page in, from the calling thread. When the
  GPU sits on a known NUMA node of a multi-node host, the calling thread is
  bound to that node's CPUs for the registration (first touch puts the pages
  there) and its affinity restored afterwards. Elsewhere (one node, or the
  node unknown) nothing is bound.
- A failed registration raises ``RuntimeError`` naming the CUDA error and
  the size; the mapping is dropped first.
- ``HostBuffer.release()`` unregisters (idempotent); the mapping is freed
  when the last tensor view of it goes away.
- The CUDA runtime is reached through ``torch.cuda.cudart()`` (or the
  ``cudart`` argument, which the CPU tests use for a recording stand-in,
  since registration cannot run without a GPU).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache.tiers.host_cpus import parse_cpu_list, read_cpus, running_on

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped
REGISTER_FLAGS = 0x01 | 0x02


@dataclass
class HostBuffer:
    """``nbytes`` of host memory as a uint8 tensor; ``pinned``: registered with CUDA."""

    tensor: torch.Tensor
    pinned: bool
    numa_node: int | None = None
    _cudart: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def release(self) -> None:
        """Unregister from CUDA (once); the bytes stay valid until unreferenced."""
        if self.pinned and self._cudart is not None:
            rc = self._cudart.cudaHostUnregister(self.tensor.data_ptr())
            if _code(rc):
                logger.warning("HiCache: cudaHostUnregister of the L2 pool failed: %s", rc)
        self._cudart = None


def allocate(nbytes: int, *, pin: bool, device: torch.device | None = None,
             cudart: Any = None) -> HostBuffer:
    """Exactly ``nbytes`` of host memory, page-locked for CUDA when ``pin``."""
    if nbytes < 0:
        raise ValueError(f"host buffer size must not be negative, got {nbytes}")
    if nbytes == 0:
        return HostBuffer(torch.empty(0, dtype=torch.uint8), pinned=False)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    if not pin:
        prefault(tensor)
        return HostBuffer(tensor, pinned=False)
    runtime = cudart if cudart is not None else torch.cuda.cudart()
    node = gpu_numa_node(device)
    with _bound_to_node(node):
        rc = runtime.cudaHostRegister(tensor.data_ptr(), nbytes, REGISTER_FLAGS)
    if _code(rc):
        del tensor
        with contextlib.suppress(BufferError):
            mapping.close()
        raise RuntimeError(
            f"cudaHostRegister of the {nbytes / 1e9:.2f} GB L2 pool failed ({rc}): lower "
            "hicache_size / hicache_ratio, or raise the locked-memory limit (ulimit -l)")
    return HostBuffer(tensor, pinned=True, numa_node=node, _cudart=runtime)


def prefault(tensor: torch.Tensor) -> None:
    """Write one byte of every OS page of ``tensor`` (a fresh, zeroed mapping, so
    its bytes do not change): each page is then backed before the pool serves."""
    started = time.perf_counter()
    tensor[::mmap.PAGESIZE].zero_()
    seconds = time.perf_counter() - started
    if seconds > 1.0:
        logger.info("HiCache: faulting in the %.1f GB L2 pool took %.1f s",
                    tensor.numel() / 1e9, seconds)


def _code(rc: Any) -> int:
    """A cudart return value (enum or int) as an int; 0 is success."""
    return int(getattr(rc, "value", rc))


def gpu_numa_node(device: torch.device | None) -> int | None:
    """The NUMA node of ``device``'s PCI slot on a multi-node host, else None."""
    nodes = _online_nodes()
    if device is None or device.type != "cuda" or len(nodes) < 2:
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        # torch's stubs omit the PCI fields its CUDA properties carry
        domain, bus_id, dev = (getattr(props, f"pci_{k}_id") for k in ("domain", "bus", "device"))
        bus = f"{domain:04x}:{bus_id:02x}:{dev:02x}.0"
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip())
    except (AttributeError, OSError, ValueError):
        return None
    return node if node in nodes else None


def _online_nodes() -> list[int]:
    try:
        return _parse_cpulist(Path("/sys/devices/system/node/online").read_text())
    except OSError:
        return []


def _parse_cpulist(text: str) -> list[int]:
    """Linux list format ("0-3,8,10-11") as a sorted list of ints ("" -> none)."""
    return sorted(parse_cpu_list(text)) if text.strip() else []


@contextlib.contextmanager
def _bound_to_node(node: int | None) -> Iterator[None]:
    """Run the block on ``node``'s CPUs (this thread only), then restore affinity."""
    cpus = None if node is None else read_cpus(
        Path(f"/sys/devices/system/node/node{node}/cpulist"))
    with running_on((cpus or frozenset()) & os.sched_getaffinity(0)):
        yield
