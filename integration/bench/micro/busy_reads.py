"""File L3 reads while vLLM's engine thread computes: the GIL-free batch read against
the per-page Python loop, with the interpreter idle and with a thread spinning in
Python beside it (what vLLM's step loop does), in one run.

A batch of ``--pages`` pages of ``--page-kib`` KiB is stored by the file backend, then
read back ``--repeats`` times into host pool slots on a reader thread: through
``FileBackend.batch_get_v1`` (one compiled call for the batch, tiers/l3/batch_read.py)
and through the base class's per-page path (``os.open`` / ``os.preadv`` / ``os.close``
per page). Prints the median time of each, and the ratios busy / idle and batch /
per-page. Page cache warm; headers and checksums checked in both.

    python -m hicache.integration.bench.micro.busy_reads [--pages 64] [--page-kib 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

from hicache.tiers.index.page_keys import page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import StorageBackend, StorageConfig
from hicache.tiers.l3.file_backend import FileBackend


def timed(read: Callable[[], list[bool]], repeats: int, busy: bool) -> float:
    """Median seconds of ``read`` on a reader thread, the main thread idle or spinning."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    if spinner is not None:
        spinner.start()
    times: list[float] = []

    def run() -> None:
        t0 = time.perf_counter()
        assert all(read()), "a page was not read"
        times.append(time.perf_counter() - t0)

    try:
        for _ in range(repeats):
            reader = threading.Thread(target=run)
            reader.start()
            reader.join()
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-kib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    page_bytes = args.page_kib * 1024
    geom = PoolGeometry(num_slots=2 * args.pages, num_layers=1, blocks_per_page=1,
                        block_bytes=page_bytes)
    keys = [k.hex() for k in page_keys(b"busy-reads", list(range(args.pages)), 1)]
    with tempfile.TemporaryDirectory() as path:
        backend = FileBackend(StorageConfig(0, 1, "busy-reads", "page_first", page_bytes,
                                            extra_config={"path": path}))
        pool = HostPagePool(geom, layout="page_first", pin_memory=False)
        backend.register_host_pool(pool)
        assert all(backend.batch_set_v1(keys, list(range(args.pages))))
        slots = list(range(args.pages, 2 * args.pages))
        batch = lambda: backend.batch_get_v1(keys, slots)  # noqa: E731
        per_page = lambda: StorageBackend.batch_get_v1(backend, keys, slots)  # noqa: E731
        batch()  # compiles the batch kernel once
        rows = {(name, busy): timed(fn, args.repeats, busy)
                for name, fn in (("batch (GIL-free)", batch), ("per page (Python)", per_page))
                for busy in (False, True)}
        backend.close()
    print(f"{args.pages} pages x {args.page_kib} KiB, median of {args.repeats}")
    print("| read | idle | main thread busy | busy / idle |")
    print("|---|---:|---:|---:|")
    for name in ("batch (GIL-free)", "per page (Python)"):
        idle, busy = rows[(name, False)], rows[(name, True)]
        print(f"| {name} | {idle * 1000:.1f} ms | {busy * 1000:.1f} ms | {busy / idle:.1f}x |")
    for busy in (False, True):
        ratio = rows[("batch (GIL-free)", busy)] / rows[("per page (Python)", busy)]
        print(f"batch / per page, {'busy' if busy else 'idle'}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
