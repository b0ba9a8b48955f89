"""L3 -> L2 fetch through the product's own path against a native read of the same bytes.

What it measures, in one run on this machine:
- ``native``: a small C program (built here with the system C compiler into
  ``.cache/bench-bin/``) that opens, ``pread``s and closes every page file of the
  store into one preallocated, touched buffer, with the same number of threads as
  the fetch uses, timing itself around the read loop: what the disk or the page
  cache delivers for these files, with no Python anywhere.
- ``ours``: a prefetch (``RequestFetch(prefetch=True)``: L3 -> L2, no vLLM) of every
  page through ``StorageIO`` and the file backend, headers and checksums verified,
  from submission to its result, as the engine's L3 thread runs it.
- ``ours+busy``: the same with a pure-Python thread spinning in this process, as
  vLLM's engine loop does while a request waits for its pages.
- ``helper`` and ``helper+busy``: ``ours`` with the file backend's ``verify: helper``
  (checksums on a helper thread right behind the reads; auto picks it on GPU hosts).
- ``python``: ``ours`` with the file backend's GIL-free batch path turned off (one
  ``open``/``preadv``/``close`` and one xxh3 call per page from Python), and
  ``python+busy``: that path beside a spinning thread.
Pages are shaped like Llama-3-8B's KV at TP=1 (32 layers x 8 KV heads x 128 dims,
K and V, bf16: 128 KiB per token) at the engine's page sizes (``--page-tokens``,
default 16 and 64 tokens: 2 and 8 MiB), ``--total-gib`` of them (default 1). The
store is written once through the backend; reads come from the page cache, where
the Python overhead shows rather than hiding behind a disk. Each side runs
``--repeats`` times (median), interleaved in rotating order.

    python -m hicache.integration.bench.micro.l3_fetch [--page-tokens 16,64] [--total-gib 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, RequestFetch
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.verify import THREADS as VERIFY_THREADS
from hicache.tiers.worker.l3_io import StorageIO

KIB_PER_TOKEN = 128  # Llama-3-8B, TP=1, bf16: 32 layers x 8 heads x 128 dims x 2 x 2 B
REPO = Path(__file__).resolve().parents[3]

READER_C = r"""
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static char **paths; static char *buf; static long size; static int n, threads;

static void *work(void *arg) {
    long t = (long)arg;
    for (int i = (int)t; i < n; i += threads) {
        int fd = open(paths[i], O_RDONLY);
        if (fd < 0) { perror(paths[i]); exit(2); }
        long done = 0;
        while (done < size) {
            ssize_t got = pread(fd, buf + (long)i * size + done, size - done, done);
            if (got <= 0) { fprintf(stderr, "short read %s\n", paths[i]); exit(3); }
            done += got;
        }
        close(fd);
    }
    return NULL;
}

int main(int argc, char **argv) {
    /* reader THREADS LISTFILE BYTES_PER_FILE REPEATS: seconds of each repeat */
    threads = atoi(argv[1]); size = atol(argv[3]); int repeats = atoi(argv[4]);
    FILE *f = fopen(argv[2], "r"); char line[4096]; int cap = 1024;
    paths = malloc(cap * sizeof(char *));
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (n == cap) { cap *= 2; paths = realloc(paths, cap * sizeof(char *)); }
        paths[n++] = strdup(line);
    }
    buf = malloc((long)n * size); memset(buf, 1, (long)n * size);
    pthread_t tid[256];
    for (int r = 0; r < repeats; r++) {
        struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
        for (long t = 0; t < threads; t++) pthread_create(&tid[t], NULL, work, (void *)t);
        for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.9f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
    }
    return 0;
}
"""


def build_reader(out_dir: Path) -> Path | None:
    """The native reader, compiled once; None when no C compiler works here."""
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "l3_reader.c"
    binary = out_dir / "l3_reader"
    stale = not binary.exists() or not src.exists() or src.read_text() != READER_C
    if stale:
        src.write_text(READER_C)
        for cc in ("cc", "gcc", "clang"):
            try:
                subprocess.run([cc, "-O2", "-pthread", "-o", str(binary), str(src)],
                               check=True, capture_output=True)
                break
            except (OSError, subprocess.CalledProcessError):
                continue
        else:
            return None
    return binary


def native_seconds(reader: Path, files: list[Path], size: int, threads: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".list", delete=False) as f:
        f.write("\n".join(str(p) for p in files) + "\n")
        listing = f.name
    try:
        out = subprocess.run([str(reader), str(threads), listing, str(size), "1"],
                             check=True, capture_output=True, text=True).stdout
    finally:
        Path(listing).unlink(missing_ok=True)
    return float(out.split()[0])


class Spinner:
    """A pure-Python thread that keeps the GIL busy (vLLM's loop, roughly)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _store(directory: Path, page_bytes: int, pages: int) -> tuple[FileBackend, HostPagePool,
                                                                   list[bytes]]:
    """A file store holding ``pages`` random pages, and a pool with room to fetch them."""
    geom = PoolGeometry(num_slots=2 * pages, num_layers=1, blocks_per_page=1,
                        block_bytes=page_bytes)
    pool = HostPagePool(geom, layout="page_first_direct", pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    for i in range(pages):
        pool.buffer[i].copy_(torch.randint(0, 256, (1, 1, page_bytes), dtype=torch.uint8,
                                           generator=gen))
    ns = KeyNamespace("bench", "uint8", "bench", 16, 1)
    keys = [bytes(k) for k in page_keys(ns.seed(), list(range(16 * pages)), 16)]
    cfg = StorageConfig(0, 1, ns.fingerprint(), "page_first_direct", page_bytes,
                        extra_config={"path": str(directory)})
    backend = FileBackend(cfg)
    backend.register_host_pool(pool)
    assert all(backend.write(WriteBatch([k.hex() for k in keys], list(range(pages)))))
    return backend, pool, keys


def fetch_seconds(io: StorageIO, pool: HostPagePool, keys: list[bytes], first_slot: int,
                  tag: str) -> float:
    """Seconds for one prefetch of every page into slots from ``first_slot`` on."""
    pool.buffer[first_slot:].zero_()
    fetch = RequestFetch(tag, (), tuple(PagePlan(first_slot + i, k, 0, ())
                                        for i, k in enumerate(keys)), prefetch=True)
    start = time.perf_counter()
    io.submit_fetch(fetch)
    while True:
        io.wait_results(1.0)
        results = io.poll()
        if results:
            break
    seconds = time.perf_counter() - start
    (result,) = results
    if result.fetched_pages != len(keys):
        raise RuntimeError(f"fetched {result.fetched_pages} of {len(keys)} pages")
    return seconds


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    reader = build_reader(REPO / ".cache" / "bench-bin")
    rows: list[dict[str, Any]] = []
    for tokens in tqdm(args.page_tokens, desc="page sizes"):
        page_bytes = tokens * KIB_PER_TOKEN * 1024
        pages = max(1, int(args.total_gib * 2**30 // page_bytes))
        directory = Path(tempfile.mkdtemp(prefix="hicache-bench-fetch-", dir=args.dir))
        try:
            rows.append(_measure(reader, directory, tokens, page_bytes, pages, args.repeats))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return rows


def _measure(reader: Path | None, directory: Path, tokens: int, page_bytes: int, pages: int,
             repeats: int) -> dict[str, Any]:
    backend, pool, keys = _store(directory, page_bytes, pages)
    native_path = backend._pool_np
    io = StorageIO(backend, pool, lambda _: None)
    files = [backend.page_path(k.hex()) for k in keys]
    counter = iter(range(10**9))

    def ours() -> float:
        return fetch_seconds(io, pool, keys, pages, f"fetch-{next(counter)}")

    def busy(fn: Callable[[], float]) -> Callable[[], float]:
        def run_busy() -> float:
            with Spinner():
                return fn()
        return run_busy

    def with_backend(attr: str, value: Any, fn: Callable[[], float]) -> Callable[[], float]:
        """``fn`` run with the backend's ``attr`` set to ``value``, then put back."""
        def run() -> float:
            before = getattr(backend, attr)
            setattr(backend, attr, value)
            try:
                return fn()
            finally:
                setattr(backend, attr, before)
        return run

    helpers = ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="bench-verify")
    # The per-page Python path: no GIL-free batch view of the pool.
    python_path = functools.partial(with_backend, "_pool_np", None)
    # Checksums on a helper thread (verify: helper).
    on_helper = functools.partial(with_backend, "_verify_helper", helpers)

    sides: dict[str, Callable[[], float]] = {"ours": ours, "ours+busy": busy(ours)}
    if native_path is not None:
        sides.update({"helper": on_helper(ours), "helper+busy": on_helper(busy(ours)),
                      "python": python_path(ours), "python+busy": python_path(busy(ours))})
    if reader is not None:
        # One fetch runs on one L3 thread: the native reader gets one thread too.
        file_bytes = files[0].stat().st_size
        sides["native"] = lambda: native_seconds(reader, files, file_bytes, 1)
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for _ in range(1):  # warm: page cache, compiled paths
        for name in names:
            sides[name]()
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(sides[name]())
    io.shutdown()
    backend.close()
    helpers.shutdown()
    payload = pages * page_bytes
    row: dict[str, Any] = {"page_tokens": tokens, "page_mib": page_bytes / 2**20,
                           "pages": pages, "gib": payload / 2**30}
    for name, ts in times.items():
        row[f"{name}_gbs"] = payload / statistics.median(ts) / 1e9
    if "native_gbs" in row:
        for name in names:
            row[f"{name}_x_native"] = row[f"{name}_gbs"] / row["native_gbs"]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    sides = ["native", "ours", "ours+busy", "helper", "helper+busy", "python", "python+busy"]
    print(f"{'page':>10} {'GiB':>5} " + " ".join(f"{s:>17}" for s in sides))
    for r in rows:
        cells = []
        for s in sides:
            gbs = r.get(f"{s}_gbs")
            x = r.get(f"{s}_x_native")
            cells.append("" if gbs is None else
                         f"{gbs:6.2f} GB/s" + (f" {x:4.2f}x" if x is not None else ""))
        print(f"{r['page_tokens']:>4} tok/{r['page_mib']:g}Mi {r['gib']:>5.2f} "
              + " ".join(f"{c:>17}" for c in cells))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-tokens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64])
    p.add_argument("--total-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="parent folder of the store (default: temp)")
    p.add_argument("--out", default="bench_results")
    args = p.parse_args(argv)
    rows = run(args)
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l3_fetch.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                  indent=2))


if __name__ == "__main__":
    main()
