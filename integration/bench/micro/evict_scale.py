"""L2 eviction as L2 grows: the tree's kept heap against ranking every leaf on each call.

A store into a full L2 evicts as many pages as it brings (tiers/controller/l2_manager.py
``allocate``). This builds a tree shaped like a busy server's L2 (``--prefixes``
shared prefixes of ``--prefix-pages`` pages, each with many conversations of
``--tail-pages`` pages hanging off it, until L2 holds ``--slots`` pages), then
times ``--stores`` stores into it, each an access of its prefix, an eviction of
``--tail-pages`` pages and the insert of a new conversation, two ways on the same
tree state:

- ``kept``: ``HiRadixTree.evict`` with its default rank (the heap kept between
  calls; what the server runs);
- ``scan``: the same rank passed as a function without ``rank_rises``, so every
  unlocked leaf is ranked and heapified on each call (what a rank that may
  fall gets).

Both must evict the same pages (checked); it prints microseconds per store and
``scan / kept`` for each L2 size. The first store of each run is not timed: it
builds the kept heap, once in a server's life (a ranking of every leaf, as
``scan`` pays on every store).

    python -m hicache.integration.bench.micro.evict_scale [--slots 1000,4000,16000,64000]
"""

from __future__ import annotations

import argparse
import hashlib
import time

from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode


def _key(*parts: object) -> PageKey:
    return PageKey(hashlib.sha256(repr(parts).encode()).digest())


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def tail_keys(n: int, pages: int) -> list[PageKey]:
    """The keys of conversation ``n``'s own pages (``fill`` makes conversations
    0, 1, ...; a later store continues the numbering)."""
    return [_key("t", n, j) for j in range(pages)]


def fill(tree: HiRadixTree, args: argparse.Namespace, slots: int,
         ) -> tuple[list[list[PageKey]], list[list[PageKey]]]:
    """A busy server's L2 in ``tree``: ``args.prefixes`` prefixes of ``args.prefix_pages``
    pages, then conversations of ``args.tail_pages`` pages hanging off them in turn
    until ``slots`` pages are used. Returns the prefixes and each conversation's keys."""
    prefixes = [[_key("p", p, i) for i in range(args.prefix_pages)] for p in range(args.prefixes)]
    paths: list[list[PageKey]] = []
    used = 0
    for keys in prefixes:
        tree.insert(keys, list(range(used, used + len(keys))))
        used += len(keys)
    while used + args.tail_pages <= slots:
        n = len(paths)
        prefix = prefixes[n % len(prefixes)]
        tail = tail_keys(n, args.tail_pages)
        hit = tree.match_prefix(prefix).host_slots
        tree.insert(prefix + tail, hit + list(range(used, used + args.tail_pages)))
        paths.append(prefix + tail)
        used += args.tail_pages
    return prefixes, paths


def tree_args(p: argparse.ArgumentParser) -> None:
    """The options of ``fill``'s tree: L2 sizes and the shape of what fills them."""
    p.add_argument("--slots", default="1000,4000,16000,64000",
                   help="L2 sizes in pages, comma-separated")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-pages", type=int, default=48)
    p.add_argument("--tail-pages", type=int, default=2)


def _fill(args: argparse.Namespace, slots: int) -> tuple[HiRadixTree, list[list[PageKey]], int]:
    tree = HiRadixTree(_Clock())
    prefixes, paths = fill(tree, args, slots)
    return tree, prefixes, len(paths)


def _stores(args: argparse.Namespace, slots: int, scan: bool) -> tuple[float, list[int], int]:
    tree, prefixes, n = _fill(args, slots)
    leaves = len(tree._leaves)  # noqa: SLF001 - the figure this benchmark is about

    def rank(node: TreeNode) -> tuple[float, ...]:
        return (node.priority, node.last_access)

    freed_all: list[int] = []
    seconds = 0.0
    for i in range(-1, args.stores):  # store -1 (untimed): the kept heap is built once
        prefix = prefixes[(n + i) % len(prefixes)]
        tail = tail_keys(n + i, args.tail_pages)
        t0 = time.perf_counter()
        hit = tree.match_prefix(prefix)
        tree.lock(hit.node)  # the prefix a store extends survives its eviction
        freed = (tree.evict(args.tail_pages, rank=rank) if scan
                 else tree.evict(args.tail_pages))
        tree.unlock(hit.node)
        tree.insert(prefix + tail, hit.host_slots + freed)
        if i >= 0:
            seconds += time.perf_counter() - t0
        freed_all.extend(freed)
    return seconds / args.stores, freed_all, leaves


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tree_args(p)
    p.add_argument("--stores", type=int, default=400)
    args = p.parse_args(argv)
    print("| L2 pages | leaves | kept heap, us per store | every leaf ranked, us | scan / kept |")
    print("|---:|---:|---:|---:|---:|")
    for slots in (int(x) for x in args.slots.split(",")):
        kept_s, kept_freed, leaves = _stores(args, slots, scan=False)
        scan_s, scan_freed, _ = _stores(args, slots, scan=True)
        if kept_freed != scan_freed:
            raise SystemExit(f"L2 of {slots} pages: the two ways evicted different pages")
        print(f"| {slots:,} | {leaves:,} | {kept_s * 1e6:.1f} | {scan_s * 1e6:.1f} | "
              f"{scan_s / kept_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
