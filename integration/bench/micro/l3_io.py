"""L3 benchmark: our storage backends against raw I/O of the same bytes, in one run.

- ``file`` and ``nixl``: write (``write`` from host pool slots) and
  read (``read`` into slots, header and checksum verified) of N
  pages, against a raw sequential write / read of the same bytes in the
  same run: one file written with ``os.write`` and read with ``readinto``
  (``raw-1file``) and one file per page (``raw-per-page``, what any
  page-addressed store must at least do); for ``file`` also a native read
  (``native-per-page``: a C program opening, reading and closing files of the
  backend's size with one thread, as our batch does; its write side is Python). Files live in ``--dir`` (default
  a temp dir); reads come from the OS page cache for both sides, which is
  what makes the checksum cost visible rather than hidden behind a disk.
- ``mooncake``: put / get through ``MooncakeBackend`` (and a second put row,
  ``mooncake/pool-sums``, with the checksums the store path leaves in the pool;
  ``l2_checksum_gbps`` is what computing them costs there) against raw
  ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` on the
  same registered buffer, against a master this benchmark starts on
  127.0.0.1 (``l3_mooncake``); its baseline is named ``raw-client``.
- ``lmcache``: through ``LMCacheBackend`` against a raw client making the
  fewest wire calls per page on the same ``lmcache server`` this benchmark
  starts (``l3_lmcache``); baseline ``raw-client``. The row also carries the
  server's cost per wire operation (``per_call_ms``).
- Each side is timed ``--repeats`` times (default 5; median), interleaved
  with the others in rotating order, so a change in the machine's load
  (other work on this 2-core VM) hits every side alike. Each timed write
  goes into a store emptied with ``clear()`` after an untimed first write:
  its directories exist (the file backend's 256 fan-out sub-directories
  included), as in a store that has held a few hundred pages, and as the
  raw baselines' directory does. Before each read the destination slots
  are zeroed, and ours are compared with the source after it.
- ``--direct-io off|auto|on``: the file backend's ``direct_io`` (O_DIRECT).
  ``--cold``: before every timed read, ours and raw, the files are written
  back and dropped from the page cache (``posix_fadvise(DONTNEED)``), so
  reads come from the disk: the case O_DIRECT is for.

Prints a table with ratio columns, writes ``bench_results/l3.json`` and a
PNG bar chart::

    python -m hicache.integration.bench.micro.l3_io [--page-mib 1,4] [--object-mib 1] [--total-mib 256] [--backends file,nixl,mooncake,lmcache] [--direct-io off] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.spans import SpanLayout, pages_per_object
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageConfig, WriteBatch
from hicache.tiers.l3.factory import create_backend

GB = 1e9


@dataclass
class _Case:
    """One side of a comparison: how to write and read the same pages."""

    name: str
    write: Callable[[], None]
    # May return the seconds it measured itself (a native reader timing its own loop).
    read: Callable[[], float | None]
    before_write: Callable[[], None]
    before_read: Callable[[], None]
    after_read: Callable[[], None] = lambda: None
    finish: Callable[[], None] = lambda: None


def _interleaved(cases: list[_Case], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (write s, read s) of each case, its repeats interleaved with the others'
    (the order rotating) so that a change in the machine's load hits every side alike."""
    writes: dict[str, list[float]] = {c.name: [] for c in cases}
    reads: dict[str, list[float]] = {c.name: [] for c in cases}
    for rep in range(repeats):
        for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
            case.before_write()
            t = time.perf_counter()
            case.write()
            writes[case.name].append(time.perf_counter() - t)
    for rep in range(repeats):
        for case in cases[rep % len(cases):] + cases[:rep % len(cases)]:
            case.before_read()
            t = time.perf_counter()
            own = case.read()
            reads[case.name].append(time.perf_counter() - t if own is None else own)
            case.after_read()
    for case in cases:
        case.finish()
    return {name: (statistics.median(writes[name]), statistics.median(reads[name]))
            for name in writes}


def _pool(page_bytes: int, pages: int) -> HostPagePool:
    geom = PoolGeometry(num_slots=2 * pages, num_layers=1, blocks_per_page=1,
                        block_bytes=page_bytes)
    pool = HostPagePool(geom, layout="page_first_direct", pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    pool.buffer[:pages].copy_(torch.randint(0, 256, (pages, 1, 1, page_bytes),
                                            dtype=torch.uint8, generator=gen))
    pool.buffer[pages:].zero_()  # touch the read side once, as a long-lived pool is
    return pool


def _evict(directory: Path) -> None:
    """Write back and drop every file under ``directory`` from the page cache."""
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _raw_case(directory: Path, pool: HostPagePool, pages: int, per_page: bool,
              cold: bool) -> _Case:
    """The same bytes with plain os.write / readinto."""
    src = [pool.buffer[i].view(-1).numpy() for i in range(pages)]
    dst = [pool.buffer[pages + i].view(-1).numpy() for i in range(pages)]
    name = "raw-per-page" if per_page else "raw-1file"
    target = directory / name

    def clean() -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()

    def write() -> None:
        if per_page:
            for i, page in enumerate(src):
                tmp = target / f"{i}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, page.data)
                os.close(fd)
                os.replace(tmp, target / f"{i}.page")
        else:
            fd = os.open(target / "all", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for page in src:
                os.write(fd, page.data)
            os.close(fd)

    def read() -> None:
        if per_page:
            for i, page in enumerate(dst):
                with open(target / f"{i}.page", "rb", buffering=0) as f:
                    f.readinto(page.data)
        else:
            with open(target / "all", "rb", buffering=0) as f:
                for page in dst:
                    f.readinto(page.data)

    return _Case(name, write, read, before_write=clean,
                 before_read=lambda: _before_read(pool, pages, target, cold),
                 finish=lambda: shutil.rmtree(target, ignore_errors=True))


def _native_case(directory: Path, pool: HostPagePool, pages: int, cold: bool,
                 reader: Path) -> _Case:
    """Files of the file backend's size (4 KiB header + page), written from Python,
    read by a small C program (l3_fetch.py) with one thread: open, pread, close per
    file into one preallocated buffer, timed by the program itself."""
    from hicache.integration.bench.micro.l3_fetch import native_seconds
    from hicache.tiers.l3.file.page_io import FILE_HEADER_BYTES

    src = [pool.buffer[i].view(-1).numpy() for i in range(pages)]
    target = directory / "native-per-page"
    files = [target / f"{i}.page" for i in range(pages)]
    head = bytes(FILE_HEADER_BYTES)

    def clean() -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()

    def write() -> None:
        for f, page in zip(files, src, strict=True):
            with open(f, "wb", buffering=0) as out:
                out.write(head)
                out.write(page.data)

    def read() -> float:
        return native_seconds(reader, files, FILE_HEADER_BYTES + pool.geometry.page_bytes, 1)

    return _Case("native-per-page", write, read, before_write=clean,
                 before_read=lambda: _before_read(pool, pages, target, cold),
                 finish=lambda: shutil.rmtree(target, ignore_errors=True))


def _before_read(pool: HostPagePool, pages: int, target: Path, cold: bool) -> None:
    pool.buffer[pages:].zero_()  # every side starts from the same slots, nothing to find there
    if cold:
        _evict(target)


def _ours_case(backend_name: str, directory: Path, pool: HostPagePool, pages: int,
               extra: dict[str, Any], cold: bool, name: str = "ours",
               pool_sums: bool = False, span_pages: int = 1) -> _Case:
    """``span_pages`` > 1: pages in span objects of that many pages (tiers/index/
    spans.py), through batches with ``spans``."""
    page_bytes = pool.geometry.page_bytes
    ns = KeyNamespace("bench", "uint8", "bench", 64, 1)
    page_ids = page_keys(ns.seed(), list(range(64 * pages)), 64)
    keys = [k.hex() for k in page_ids]
    layout = SpanLayout(span_pages)
    spans = layout.refs(page_ids, 0, pages)
    target = directory / name
    shutil.rmtree(target, ignore_errors=True)

    def fresh() -> StorageBackend:
        cfg = StorageConfig(0, 1, ns.fingerprint(), "page_first_direct", page_bytes,
                            extra_config={"path": str(target), **extra})
        b = create_backend(backend_name, cfg)
        b.register_host_pool(pool)
        return b

    state: dict[str, StorageBackend] = {}

    def before_write() -> None:
        # A new instance on an emptied store: nothing to skip, directories kept.
        if "b" in state:
            state["b"].clear()
            state["b"].close()
        state["b"] = fresh()
        for slot in range(pages):  # slots holding pages; checksums only when asked
            pool.set_key(slot, keys[slot].encode())
        if pool_sums:  # as the store path leaves them (host_pool.py set_checksums)
            pool.set_checksums(list(range(pages)), _slot_sums(pool, pages))

    def write() -> None:
        slots = list(range(pages))
        if layout.enabled:  # whole spans as objects, a tail shorter than one as pages
            whole = [i for i, span in enumerate(spans) if span is not None]
            batch = WriteBatch([keys[i] for i in whole], whole,
                               [spans[i] for i in whole])  # type: ignore[misc]
            assert all(state["b"].write(batch))
            rest = [i for i, span in enumerate(spans) if span is None]
            assert all(state["b"].write(WriteBatch([keys[i] for i in rest], rest)))
            return
        assert all(state["b"].write(WriteBatch(keys, slots)))

    def read() -> None:
        if layout.enabled:
            whole = [i for i, span in enumerate(spans) if span is not None]
            batch = ReadBatch([keys[i] for i in whole], [pages + i for i in whole],
                              [spans[i] for i in whole])  # type: ignore[misc]
            assert all(state["b"].read(batch))
            rest = [i for i, span in enumerate(spans) if span is None]
            assert all(state["b"].read(ReadBatch([keys[i] for i in rest],
                                               [pages + i for i in rest])))
            return None
        assert all(state["b"].read(ReadBatch(keys, list(range(pages, 2 * pages)))))
        return None

    def check() -> None:
        assert torch.equal(pool.buffer[:pages], pool.buffer[pages:]), "read back differs"

    def finish() -> None:
        state["b"].close()
        shutil.rmtree(target, ignore_errors=True)

    before_write()
    write()  # untimed: the store's directories come into being
    return _Case(name, write, read, before_write=before_write,
                 before_read=lambda: _before_read(pool, pages, target, cold),
                 after_read=check, finish=finish)


def _slot_sums(pool: HostPagePool, pages: int) -> list[int]:
    from hicache.tiers.l3.integrity import checksums_at

    page = pool.geometry.page_bytes
    return checksums_at([pool.buffer.data_ptr() + s * page for s in range(pages)],
                        [pool.read_page(s) for s in range(pages)], page)


def _ours_name(verify: str | None) -> str:
    return "ours" if verify in (None, "inline") else f"ours-{verify}"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    work = [(b, m) for m in args.page_mib for b in args.backends]
    directory = Path(args.dir or tempfile.mkdtemp(prefix="hicache-bench-l3-"))
    directory.mkdir(parents=True, exist_ok=True)
    from hicache.integration.bench.micro.l3_fetch import REPO, build_reader

    reader = build_reader(REPO / ".cache" / "bench-bin") if "file" in args.backends else None
    for backend, mib in tqdm(work, desc="L3 benchmark", unit="case"):
        page_bytes = int(mib * 2**20)
        pages = max(1, int(args.total_mib // mib))
        payload = pages * page_bytes
        if backend == "mooncake":
            rows += _mooncake_rows(mib, page_bytes, pages, args)
            continue
        if backend == "lmcache":
            from hicache.integration.bench.micro.l3_lmcache import bench_lmcache

            res = bench_lmcache(page_bytes, pages, args.repeats)
            rows.append({
                "backend": backend, "page_mib": mib, "pages": pages,
                "ours_write_gbs": res["ours_put_gbps"], "ours_read_gbs": res["ours_get_gbps"],
                "raw": "raw-client",  # the fewest wire calls per page, same server
                "raw_write_gbs": res["raw_put_gbps"], "raw_read_gbs": res["raw_get_gbps"],
                "per_call_ms": res["per_call_ms"],
            })
            continue
        pool = _pool(page_bytes, pages)
        # The file backend once per verify mode, each against every baseline.
        modes: list[str | None] = list(args.verify) if backend == "file" else [None]
        ours = {_ours_name(mode): {"direct_io": args.direct_io, "verify": mode}
                if mode else {} for mode in modes}
        if backend == "nixl":  # it takes the pool's checksums: a row with them too
            ours["ours-pool-sums"] = {"variant": "pool-sums"}
        span_pages = pages_per_object(args.object_mib, page_bytes)
        if backend == "file" and span_pages > 1:  # span objects, inline checksums
            ours["ours-spans"] = {"variant": f"spans of {span_pages}",
                                  "direct_io": args.direct_io}
        cases = [_ours_case(backend, directory, pool, pages,
                            {k: v for k, v in extra.items() if k != "variant"}, args.cold,
                            name, pool_sums=name == "ours-pool-sums",
                            span_pages=span_pages if name == "ours-spans" else 1)
                 for name, extra in ours.items()]
        cases += [_raw_case(directory, pool, pages, per_page, args.cold)
                  for per_page in (False, True)]
        if backend == "file" and reader is not None:
            cases.append(_native_case(directory, pool, pages, args.cold, reader))
        times = _interleaved(cases, args.repeats)
        for name, extra in ours.items():
            ow, orr = times[name]
            for raw_name in [c.name for c in cases[len(ours):]]:
                rw, rr = times[raw_name]
                rows.append({
                    "backend": backend, "page_mib": mib, "pages": pages, **extra,
                    "cold": args.cold,
                    "ours_write_gbs": payload / ow / GB, "ours_read_gbs": payload / orr / GB,
                    "raw": raw_name, "raw_write_gbs": payload / rw / GB,
                    "raw_read_gbs": payload / rr / GB,
                })
    for row in rows:
        row["write_ratio"] = row["ours_write_gbs"] / row["raw_write_gbs"]
        row["read_ratio"] = row["ours_read_gbs"] / row["raw_read_gbs"]
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _mooncake_rows(mib: float, page_bytes: int, pages: int,
                   args: argparse.Namespace) -> list[dict[str, Any]]:
    """One Mooncake run per verify mode (its own master), each against the raw client."""
    from hicache.integration.bench.micro.l3_mooncake import bench_mooncake

    rows: list[dict[str, Any]] = []
    for mode in args.verify:
        res = bench_mooncake(page_bytes, pages, args.repeats, verify=mode,
                             span_pages=pages_per_object(args.object_mib, page_bytes))
        variants = [("", res["ours_put_gbps"], res["ours_get_gbps"]),
                    ("pool-sums", res["ours_put_pool_sums_gbps"], res["ours_get_gbps"]),
                    ("pool-sums, via transfer", res["ours_put_pool_sums_gbps"],
                     res["ours_get_transfer_gbps"])]
        if res["span_pages"] > 1:
            variants.append((f"spans of {res['span_pages']}", res["ours_span_put_gbps"],
                             res["ours_span_get_gbps"]))
        for variant, put, get in variants:
            spans = variant.startswith("spans")
            label = ", ".join(v for v in (variant, "" if mode == "inline" else f"verify {mode}")
                              if v)
            rows.append({
                "backend": "mooncake", "page_mib": mib, "pages": pages,
                **({"variant": label} if label else {}), "verify": mode,
                "ours_write_gbs": put, "ours_read_gbs": get,
                # MooncakeDistributedStore calls on the same buffer (for span rows:
                # objects of the same span's slots)
                "raw": "raw-client-spans" if spans else "raw-client",
                "raw_write_gbs": res["raw_span_put_gbps" if spans else "raw_put_gbps"],
                "raw_read_gbs": res["raw_span_get_gbps" if spans else "raw_get_gbps"],
                "l2_checksum_gbps": res["l2_checksum_gbps"],
            })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'backend':<40} {'page':>6} {'pages':>5} {'baseline':<18} {'write GB/s':>10} "
            f"{'raw':>6} {'ratio':>6} {'read GB/s':>9} {'raw':>6} {'ratio':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        side = ", ".join(str(r[k]) for k in ("verify", "variant") if r.get(k)
                         and (k == "variant" or r["backend"] != "mooncake"))
        backend = r["backend"] + (f"/{side}" if side else "")
        print(f"{backend:<40} {r['page_mib']:>4g}Mi {r['pages']:>5} {r['raw']:<18} "
              f"{r['ours_write_gbs']:>10.2f} {r['raw_write_gbs']:>6.2f} {r['write_ratio']:>5.2f}x "
              f"{r['ours_read_gbs']:>9.2f} {r['raw_read_gbs']:>6.2f} {r['read_ratio']:>5.2f}x")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['backend']}"
              f"{'/' + (r.get('verify') or r['variant']) if r.get('verify') or r.get('variant') else ''}\n"
              f"{r['page_mib']:g} MiB\nvs {r['raw']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["write_ratio"] for r in rows], 0.4, label="write")
    ax.bar([i + 0.2 for i in x], [r["read_ratio"] for r in rows], 0.4, label="read")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.7, color="red", lw=0.8, ls="--", label="goal (file) 0.7x")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ours / raw (GB/s ratio)")
    ax.set_title("HiCache L3 backends vs raw I/O of the same bytes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--page-mib", type=floats, default=[1.0, 4.0])
    parser.add_argument("--total-mib", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", type=lambda s: s.split(","),
                        default=["file", "nixl", "mooncake", "lmcache"])
    parser.add_argument("--dir", default=None, help="where file/nixl pages go (default: temp)")
    parser.add_argument("--direct-io", choices=["off", "auto", "on"], default="off",
                        help="the file backend's direct_io (O_DIRECT)")
    parser.add_argument("--verify", type=lambda s: s.split(","), default=["inline", "helper"],
                        help="the file and Mooncake backends' verify modes to time (each "
                        "its own row): "
                        "inline (checksums on the reading thread), helper (on a helper "
                        "thread behind it), auto")
    parser.add_argument("--object-mib", type=float, default=1.0,
                        help="file: also time span objects of up to this many MiB "
                        "(object_mib; a row 'ours-spans' where that is more than one page)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before every timed read")
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args()
    rows = run(args)
    print_table(rows)
    for r in rows:
        if "per_call_ms" in r:
            costs = ", ".join(f"{op} {ms:.2f}" for op, ms in r["per_call_ms"].items())
            print(f"lmcache server, ms per wire call ({r['page_mib']:g} MiB pages): {costs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "l3.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "l3.png")
    print(f"wrote {out / 'l3.json'} and {out / 'l3.png'}")


if __name__ == "__main__":
    main()
