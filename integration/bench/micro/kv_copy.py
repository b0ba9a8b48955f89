"""Copy benchmark: L1 <-> L2 bandwidth of every host layout and IO backend vs memcpy.

For each page size (tokens), page count, layout and direction it moves the
same pages through every copy path of the device and, in the same run, times
one plain ``copy_`` of the same number of bytes between two contiguous
buffers (memcpy on CPU; a pinned ``cudaMemcpyAsync`` on a GPU, in the copy's
direction: device->host for saves, host->device for loads). It prints a
table with the ratio to that baseline and writes JSON and a PNG plot.

On a GPU the paths are ``torch-slices`` (io backend ``direct``) and, when
triton and CUDA are usable, ``gpu-kernel`` (io backend ``kernel``, one Triton
launch per transfer), and each row also gives the rate of one
``cudaMemcpyAsync`` per page (contiguous pinned buffers, issued by torch
``copy_``) and the path's ratio to it (``x page``): what a per-page copy loop
could reach at best.

KV shape per TP rank defaults to a Llama-3-8B-like layer (8 KV heads x 128
dims, K and V, bf16: 4 KiB per token and layer) over 16 layers, with vLLM's
GPU block size of 16 tokens. Each page's blocks are consecutive in L1 and
pages sit at random places, as after some churn in vLLM's block pool.

    python -m hicache.integration.bench.micro.kv_copy [--page-sizes 16,64,128] [--pages 16,64,256]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hicache.kernels import gpu_copy, io_backend
from hicache.kernels.block_copy import BlockTransfer, block_byte_view
from hicache.tiers.l2.host_pool import LAYOUT_DIMS, HostPagePool, PoolGeometry


def _timed(fn: Any, device: torch.device, min_seconds: float = 0.15) -> float:
    """Median seconds of one call, over repeats filling ``min_seconds``."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    combos = [(p, n, layout) for p in args.page_sizes for n in args.pages
              for layout in sorted(LAYOUT_DIMS)]
    rows: list[dict[str, Any]] = []
    for page_size, num_pages, layout in tqdm(combos, desc="copy benchmark"):
        rows.extend(_measure(args, page_size, num_pages, layout))
    return rows


def _setup(args: argparse.Namespace, page_size: int, num_pages: int, layout: str) -> Any:
    """Layers, pool and transfer of one measurement, and the memcpy baselines."""
    device = torch.device(args.device)
    pinned = device.type == "cuda"
    rng = random.Random(page_size * 100_003 + num_pages)
    block_bytes = args.block_size * args.kv_heads * args.head_dim * 2 * 2  # K and V, bf16
    bpp = page_size // args.block_size
    num_blocks = max(args.pages) * bpp * 2
    kv = torch.empty(args.layers, num_blocks, block_bytes, dtype=torch.uint8, device=device)
    layers = [block_byte_view(kv[i], num_blocks) for i in range(args.layers)]
    pool = HostPagePool(PoolGeometry(num_pages, args.layers, bpp, block_bytes),
                        layout=layout, pin_memory=pinned)
    starts = rng.sample(range(0, num_blocks, bpp), num_pages)
    transfer = BlockTransfer.from_lists(
        [s + i for s in starts for i in range(bpp)],
        [p for p in range(num_pages) for _ in range(bpp)],
        [i for _ in range(num_pages) for i in range(bpp)],
    )
    nbytes = len(transfer) * block_bytes * args.layers
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    # Touch every buffer first: never-written memory maps the kernel's zero
    # page, which reads from cache and would flatter whichever side reads it.
    for t in (kv, pool.buffer, src, dst):
        t.fill_(1)
    memcpy_s = _timed(lambda: dst.copy_(src, non_blocking=True), device)
    # GPU baselines per direction: D2H for saves (memcpy_s), H2D for loads, and
    # one cudaMemcpyAsync per page of the same bytes.
    baseline = {"save": memcpy_s, "load": memcpy_s}
    per_page: dict[str, float] = {}
    if device.type == "cuda":
        baseline["load"] = _timed(lambda: src.copy_(dst, non_blocking=True), device)
        page_bytes = nbytes // num_pages
        dev_pages = list(src.split(page_bytes))
        host_pages = list(dst.split(page_bytes))
        per_page["save"] = _timed(lambda: _copy_pages(host_pages, dev_pages), device)
        per_page["load"] = _timed(lambda: _copy_pages(dev_pages, host_pages), device)
    return device, layers, pool, transfer, nbytes, baseline, per_page


def _measure(
    args: argparse.Namespace, page_size: int, num_pages: int, layout: str
) -> list[dict[str, Any]]:
    device, layers, pool, transfer, nbytes, baseline, per_page = _setup(
        args, page_size, num_pages, layout)
    rows = []
    if device.type == "cpu":
        paths = {io_backend.select(io, device.type) for io in ("direct", "kernel")}
    else:
        paths = {io_backend.select("direct", device.type)}
        if device.type == "cuda" and gpu_copy.available():
            paths.add(io_backend.select("kernel", device.type))
    paths.add(io_backend.TORCH_SLICES)
    for path, direction in [(p, d) for p in sorted(paths, key=lambda p: p.name)
                            for d in ("save", "load")]:
        if direction == "save":
            fn = functools.partial(path.save, layers, pool.canonical, transfer, None)
        else:
            fn = functools.partial(path.load, pool.canonical, layers, transfer, None)
        seconds = _timed(fn, device)
        base_s = baseline[direction]
        row = {
            "page_size": page_size, "pages": num_pages, "layout": layout,
            "path": path.name, "direction": direction, "bytes": nbytes,
            "gbps": nbytes / seconds / 1e9, "memcpy_gbps": nbytes / base_s / 1e9,
            "ratio": base_s / seconds, "copies_per_layer": len(transfer.runs),
        }
        if direction in per_page:
            row["per_page_gbps"] = nbytes / per_page[direction] / 1e9
            row["per_page_ratio"] = per_page[direction] / seconds
        rows.append(row)
    return rows


SWEEP = [gpu_copy.Tuning(programs_per_sm=pps, num_warps=warps, max_chunk_words=chunk,
                         split=split)
         for pps in (4, 8, 16, 32) for warps in (0, 8) for chunk in (1024, 4096)
         for split in (False, True)]


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The GPU kernel under every tuning of ``SWEEP``, against memcpy of the same bytes."""
    rows: list[dict[str, Any]] = []
    combos = [(p, n, layout) for p in args.page_sizes for n in args.pages
              for layout in args.layouts]
    for page_size, num_pages, layout in tqdm(combos, desc="kernel tunings"):
        device, layers, pool, transfer, nbytes, baseline, _ = _setup(
            args, page_size, num_pages, layout)
        for tuning in SWEEP:
            for direction in ("save", "load"):
                fn = functools.partial(gpu_copy.launch, layers, pool.canonical, transfer,
                                       load=direction == "load", tuning=tuning)
                seconds = _timed(fn, device, min_seconds=0.05)
                rows.append({"page_size": page_size, "pages": num_pages, "layout": layout,
                             "direction": direction, "tuning": dataclasses.asdict(tuning),
                             "default": tuning == gpu_copy.TUNING, "bytes": nbytes,
                             "gbps": nbytes / seconds / 1e9,
                             "ratio": baseline[direction] / seconds})
    return rows


def print_sweep(rows: list[dict[str, Any]]) -> None:
    """Per tuning, the lowest ratio to memcpy over sizes, layouts and directions."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        t = r["tuning"]
        key = (f"pps={t['programs_per_sm']:<2} warps={t['num_warps'] or 'auto':<4} "
               f"chunk={t['max_chunk_words']:<4} split={int(t['split'])}")
        by.setdefault(key, []).append(r)
    print("\nGPU copy kernel tunings: ratio to one pinned cudaMemcpyAsync of the same bytes "
          "(min / median over page sizes, page counts, layouts, directions)")
    ranked = sorted(by.items(), key=lambda kv: -min(r["ratio"] for r in kv[1]))
    for key, rs in ranked:
        ratios = [r["ratio"] for r in rs]
        mark = " (default)" if rs[0]["default"] else ""
        print(f"  {key}  min {min(ratios):.2f}  median {statistics.median(ratios):.2f}{mark}")
    for page_size in sorted({r["page_size"] for r in rows}):
        best = ranked[0][0]
        rs = [r for r in by[best] if r["page_size"] == page_size]
        print(f"best at {page_size}-token pages: " + ", ".join(
            f"{r['pages']}p {r['layout']} {r['direction']} {r['ratio']:.2f}" for r in rs))


def _copy_pages(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """One async copy (cudaMemcpyAsync) per page."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s, non_blocking=True)


def print_table(rows: list[dict[str, Any]], device: str) -> None:
    gpu = any("per_page_gbps" in r for r in rows)
    if not gpu:
        print(f"\nL1 <-> L2 copy bandwidth on {device}; on CPU io backends 'direct' and 'kernel' "
              "both resolve to cpu-batch; torch-slices shown for comparison; ratio = vs a plain "
              "copy of the same bytes in the same run")
        print(f"{'page':>5} {'pages':>6} {'MiB':>7} {'layout':<18} {'path':<13} {'dir':<5} "
              f"{'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
    else:
        print(f"\nL1 <-> L2 copy bandwidth on {device}; io backend 'direct' = torch-slices, "
              "'kernel' = gpu-kernel; memcpy = one pinned cudaMemcpyAsync of the same bytes in "
              "the same direction, per-page = one cudaMemcpyAsync per page, both in the same "
              "run; ratio / x page = path vs those")
        print(f"{'page':>5} {'pages':>6} {'MiB':>7} {'layout':<18} {'path':<13} {'dir':<5} "
              f"{'GB/s':>7} {'memcpy':>7} {'ratio':>6} {'per-page':>8} {'x page':>6}")
    for r in rows:
        line = (f"{r['page_size']:>5} {r['pages']:>6} {r['bytes'] / 2**20:>7.1f} "
                f"{r['layout']:<18} {r['path']:<13} {r['direction']:<5} {r['gbps']:>7.2f} "
                f"{r['memcpy_gbps']:>7.2f} {r['ratio']:>6.2f}")
        if gpu:
            line += f" {r.get('per_page_gbps', 0.0):>8.2f} {r.get('per_page_ratio', 0.0):>6.2f}"
        print(line)
    best: dict[Any, Any] = {}
    for r in rows:
        if r["page_size"] >= 64:
            key = (r["page_size"], r["pages"], r["direction"])
            best[key] = max(best.get(key, 0.0), r["ratio"])
    if best:
        print(f"best path at page_size >= 64: min ratio over sizes/directions "
              f"{min(best.values()):.2f} (goal >= 0.80)")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    page_sizes = sorted({r["page_size"] for r in rows})
    best_path = max({r["path"] for r in rows},
                    key=lambda name: sum(r["ratio"] for r in rows if r["path"] == name))
    fig, axes = plt.subplots(1, len(page_sizes), figsize=(5 * len(page_sizes), 4), sharey=True)
    for ax, page_size in zip(axes if len(page_sizes) > 1 else [axes], page_sizes, strict=True):
        for layout in sorted(LAYOUT_DIMS):
            for direction, style in (("save", "-"), ("load", "--")):
                pts = sorted((r["pages"], r["gbps"]) for r in rows
                             if r["page_size"] == page_size and r["layout"] == layout
                             and r["direction"] == direction and r["path"] == best_path)
                ax.plot([p for p, _ in pts], [g for _, g in pts], style, marker="o",
                        label=f"{layout} {direction}")
        # memcpy is timed beside every measurement; plot its mean per page count.
        by_pages: dict[int, list[float]] = {}
        for r in rows:
            if r["page_size"] == page_size:
                by_pages.setdefault(r["pages"], []).append(r["memcpy_gbps"])
        pages = sorted(by_pages)
        ax.plot(pages, [statistics.fmean(by_pages[n]) for n in pages], "k:", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"page = {page_size} tokens ({best_path})")
        ax.set_xlabel("pages per transfer")
        ax.grid(alpha=0.3)
    (axes[0] if len(page_sizes) > 1 else axes).set_ylabel("GB/s")
    (axes[-1] if len(page_sizes) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--page-sizes", type=ints, default=[16, 64, 128])
    p.add_argument("--pages", type=ints, default=[16, 64, 256])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench_results/copy")
    p.add_argument("--sweep", action="store_true",
                   help="GPU: time the copy kernel under every tuning of SWEEP instead")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=sorted(LAYOUT_DIMS),
                   help="host layouts of --sweep")
    args = p.parse_args(argv)
    if args.sweep:
        rows = sweep(args)
        print_sweep(rows)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}))
        return
    rows = run(args)
    print_table(rows, args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
