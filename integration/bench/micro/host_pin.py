"""Pinned host memory for the L2 pool: what torch's ``pin_memory=True`` locks vs ours.

For one pool size it allocates the pool twice, once through torch's caching host
allocator (``torch.empty(..., pin_memory=True)``) and once through
``tiers/l2/host_memory.allocate`` (mmap + ``cudaHostRegister``), and prints for each:
the bytes torch's allocator reserved (``torch.cuda.host_memory_stats``), the
allocation seconds, whether torch sees it as pinned, and the host->device copy rate
of a 1 GiB slice (the same for both if both are truly page-locked). Needs CUDA.

    python -m hicache.integration.bench.micro.host_pin [--gb 20]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from hicache.tiers.l2.host_memory import allocate


def _reserved() -> int:
    """Bytes of the blocks torch's caching host allocator holds in use (its blocks
    are rounded up, so this is what is locked for the tensors alive)."""
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def _h2d_gbps(host: torch.Tensor) -> float:
    n = min(host.numel(), 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host[:n], non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host[:n], non_blocking=True)
    torch.cuda.synchronize()
    return 5 * n / (time.perf_counter() - t0) / 1e9


def measure(nbytes: int) -> list[dict[str, Any]]:
    rows = []
    before = _reserved()
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = time.perf_counter() - t0
    rows.append({"how": "torch pin_memory=True", "asked_gb": nbytes / 1e9,
                 "locked_gb": (_reserved() - before) / 1e9, "seconds": seconds,
                 "is_pinned": host.is_pinned(), "h2d_gbps": _h2d_gbps(host)})
    del host
    torch.cuda.synchronize()
    torch._C._host_emptyCache()
    t0 = time.perf_counter()
    buf = allocate(nbytes, pin=True, device=torch.device("cuda"))
    seconds = time.perf_counter() - t0
    rows.append({"how": "mmap + cudaHostRegister (HiCache)", "asked_gb": nbytes / 1e9,
                 "locked_gb": buf.nbytes / 1e9, "seconds": seconds,
                 "is_pinned": buf.tensor.is_pinned(), "h2d_gbps": _h2d_gbps(buf.tensor),
                 "numa_node": buf.numa_node})
    buf.release()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=20.0, help="pool size, GB (1e9 bytes)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_pin needs CUDA")
    rows = measure(int(args.gb * 1e9))
    print(f"{'allocation':36} {'asked GB':>9} {'locked GB':>10} {'seconds':>8} "
          f"{'pinned':>7} {'H2D GB/s':>9}")
    for r in rows:
        print(f"{r['how']:36} {r['asked_gb']:9.2f} {r['locked_gb']:10.2f} {r['seconds']:8.2f} "
              f"{r['is_pinned']!s:>7} {r['h2d_gbps']:9.1f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
