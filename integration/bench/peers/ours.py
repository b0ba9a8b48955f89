"""Our side of the peer benchmarks: the same operations the peer scripts time, on our tiers.

Contract:
- ``measure(workload_json, workdir, parts)`` reads the workload written by
  ``workload.write_workload`` and returns ``{"metrics": {name: metric}}`` in
  the format the peer scripts emit (see ``metric``), so the runner compares
  names one to one. ``parts`` picks among ``radix``, ``file`` and ``kv``.
- Every timed operation runs ``repeats`` times on fresh state (new tree,
  empty store directory, empty pool), setup untimed; the runner takes medians.
  Timed writes to files start after an untimed ``os.sync()`` on both sides,
  so neither inherits the other's (or its own earlier) pending writeback.
- Radix (a), per page size P, on ``HiRadixTree``: ``request`` (each request
  in order, into an empty tree: match then insert, as the scheduler does for
  a new request; with ``+hash`` the request is keyed once and both calls use
  the keys), ``insert`` (all requests, in order, into an empty tree),
  ``match`` (every request again: full hits),
  ``miss`` (sequences whose first page is unknown), ``evict`` (half of the
  tree's pages, LRU). Names without a suffix take page keys computed before
  the clock starts; ``+hash`` names include ``page_keys`` over the request's
  token list, which is what SGLang's token-keyed tree is compared with.
- File (b): SGLang's file-store calls over our file backend (``_PeerFileStore``):
  ``batch_set`` of tensors (copied into host pool slots, then one ``write``),
  ``exists`` per key, ``batch_get`` into preallocated tensors (one ``read`` into
  slots, then copied out), data verified (``torch.equal``) after each get. The
  two copies are ours to pay: SGLang's store reads and writes the tensors.
- KV (c): a request's KV (L layers x T tokens) in vLLM-style per-layer block
  tensors. ``l2/store`` = page keys + tree match + slot alloc + copy into the
  host pool (our CPU copy path) + tree insert; ``l2/retrieve`` = page keys +
  match + key check + copy back into zeroed KV, verified. ``l3/store`` =
  ``l2/store`` then the new pages written to the file backend
  (``write``); ``l3/retrieve`` starts from an empty L2: keys, exists,
  ``read`` into fresh slots, tree insert, copy into zeroed KV, verified.
  One untimed warm-up round precedes the timed ones (the peer does the same).
- Metric: ``{"seconds": [..], "amount": float, "unit": "tok"|"B"|"op",
  "check": number|None, "verified": bool|None}``; rate = amount / median(seconds).
  ``check`` is a workload fact both sides must agree on (e.g. tokens matched).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.integration.bench.peers.scripts.peer_common import Metric, file_case, metric
from hicache.integration.bench.peers.scripts.peer_common import timed as _timed
from hicache.integration.bench.peers.workload import load_workload
from hicache.kernels import io_backend
from hicache.kernels.block_copy import BlockTransfer, block_byte_view
from hicache.tiers.index.page_keys import KeyNamespace, PageKey, page_keys
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.slot_allocator import SlotAllocator
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FileBackend

PARTS = ("radix", "file", "kv")


# ---------------------------------------------------------------------- (a) radix


def _slot_lists(key_counts: Sequence[int]) -> list[list[int]]:
    """A distinct slot per offered page (what an allocator would hand out)."""
    out, base = [], 0
    for n in key_counts:
        out.append(list(range(base, base + n)))
        base += n
    return out


def measure_radix(doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Metric]:
    hit = [row.tolist() for row in np.asarray(arrays["radix_hit"])]
    miss = [row.tolist() for row in np.asarray(arrays["radix_miss"])]
    out: dict[str, Metric] = {}
    for p in doc["radix"]["page_sizes"]:
        out.update(_radix_page_size(p, hit, miss, doc["repeats"]))
    return out


def _radix_page_size(p: int, hit: list[list[int]], miss: list[list[int]],
                     repeats: int) -> dict[str, Metric]:
    seed = KeyNamespace("peer-bench", "bfloat16", "peer", p, 1).seed()
    hit_keys = [page_keys(seed, t, p) for t in hit]
    miss_keys = [page_keys(seed, t, p) for t in miss]
    slots = _slot_lists([len(k) for k in hit_keys])
    offered = sum(len(k) for k in hit_keys) * p
    times: dict[str, list[float]] = {}
    checks: dict[str, float] = {}

    def rec(name: str, seconds: float, check: float | None) -> None:
        times.setdefault(name, []).append(seconds)
        if check is not None:
            checks[name] = check

    def insert(tree: HiRadixTree, hashed: bool) -> None:
        for tokens, keys, sl in zip(hit, hit_keys, slots, strict=True):
            tree.insert(page_keys(seed, tokens, p) if hashed else keys, sl)

    def match(tree: HiRadixTree, seqs: list[list[int]], keys: list[list[PageKey]],
              hashed: bool) -> int:
        if hashed:
            return sum(tree.match_prefix(page_keys(seed, t, p)).num_pages for t in seqs)
        return sum(tree.match_prefix(k).num_pages for k in keys)

    def request(tree: HiRadixTree, hashed: bool) -> None:
        # The scheduler's flow for a new request: key it once, match, insert the rest.
        for tokens, keys, sl in zip(hit, hit_keys, slots, strict=True):
            if hashed:
                keys = page_keys(seed, tokens, p)
            tree.match_prefix(keys)
            tree.insert(keys, sl)

    for _ in range(repeats):
        for hashed, suffix in ((False, ""), (True, "+hash")):
            tree = HiRadixTree()
            rec(f"request{suffix}", _timed(functools.partial(request, tree, hashed))[0],
                tree.total_pages() * p)
            tree = HiRadixTree()
            rec(f"insert{suffix}", _timed(functools.partial(insert, tree, hashed))[0],
                tree.total_pages() * p)
            s, n = _timed(functools.partial(match, tree, hit, hit_keys, hashed))
            rec(f"match{suffix}", s, n * p)
            s, n = _timed(functools.partial(match, tree, miss, miss_keys, hashed))
            rec(f"miss{suffix}", s, n * p)
        # Eviction takes no keys: timed once, on the last tree of the round.
        want = tree.total_pages() // 2
        s, freed = _timed(functools.partial(tree.evict, want))
        rec("evict", s, len(freed) * p)
        rec("hash-only", _timed(lambda: [page_keys(seed, t, p) for t in hit])[0], None)
    amounts = {"insert": offered, "match": checks["match"], "miss": len(miss),
               "evict": checks["evict"], "hash-only": offered, "request": offered}
    return {f"radix/p{p}/{name}": metric(secs, amounts[name.split("+")[0]],
                                         "op" if name.startswith("miss") else "tok",
                                         checks.get(name))
            for name, secs in times.items()}


# ---------------------------------------------------------------------- (b) file L3


def _file_backend(path: Path, page_bytes: int, pool: HostPagePool | None = None) -> FileBackend:
    shutil.rmtree(path, ignore_errors=True)
    ns = KeyNamespace("peer-bench", "uint8", "peer", 1, 1)
    cfg = StorageConfig(0, 1, ns.fingerprint(), "page_first_direct", page_bytes,
                        extra_config={"path": str(path)})
    backend = FileBackend(cfg)
    if pool is not None:
        backend.register_host_pool(pool)
    return backend


class _PeerFileStore:
    """SGLang's file-store calls (``batch_set``, ``exists``, ``batch_get`` of tensors)
    over our file backend, through a host pool of one slot per page."""

    def __init__(self, path: Path, page_bytes: int, pages: int) -> None:
        self.pool = HostPagePool(PoolGeometry(num_slots=pages, num_layers=1, blocks_per_page=1,
                                              block_bytes=page_bytes),
                                 layout="page_first_direct", pin_memory=False)
        self.backend = _file_backend(path, page_bytes, self.pool)

    def batch_set(self, keys: list[str], values: list[torch.Tensor]) -> list[bool]:
        for slot, value in enumerate(values):
            self.pool.write_page(slot, value.reshape(-1))
        return self.backend.write(WriteBatch(keys, list(range(len(keys)))))

    def exists(self, key: str) -> bool:
        return self.backend.exists_prefix([key]) == 1

    def batch_get(self, keys: list[str], targets: list[torch.Tensor]) -> list[bool]:
        ok = self.backend.read(ReadBatch(keys, list(range(len(keys)))))
        for slot, target in enumerate(targets):
            target.view(-1).copy_(self.pool.read_page(slot))
        return ok

    def close(self) -> None:
        self.backend.close()


def measure_file(doc: dict[str, Any], arrays: dict[str, np.ndarray],
                 workdir: Path) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for case in doc["file_cases"]:
        out.update(_file_case(case, arrays, doc["repeats"], workdir / "ours-file"))
    return out


def _file_case(case: dict[str, Any], arrays: dict[str, np.ndarray], repeats: int,
               directory: Path) -> dict[str, Metric]:
    return file_case(case, arrays, repeats, directory,
                     lambda path, page_bytes: _PeerFileStore(path, page_bytes, case["pages"]),
                     set_ok=all, get_ok=all)


# ---------------------------------------------------------------------- (c) KV paths


class _KVHarness:
    """One request's KV in vLLM-style block tensors plus our L2 (tree, slots, pool) and L3."""

    def __init__(self, doc: dict[str, Any], arrays: dict[str, np.ndarray], workdir: Path) -> None:
        k = doc["kv"]
        self.layers_n, self.tokens_n = k["layers"], k["tokens"]
        self.page, bs = k["chunk"], k["block_size"]
        hd = k["kv_heads"] * k["head_dim"]
        self.bpp = self.page // bs
        num_blocks = self.tokens_n // bs
        self.num_pages = self.tokens_n // self.page
        # [2, L, T, HD] (LMCache's order) -> per layer [block, K|V, token-in-block, HD]
        src = torch.from_numpy(np.array(arrays["kv"])).view(torch.bfloat16)
        self.kv = (src.view(2, self.layers_n, num_blocks, bs, hd)
                   .permute(1, 2, 0, 3, 4).contiguous())
        self.reference = self.kv.clone()
        self.nbytes = self.kv.numel() * self.kv.element_size()
        self.layers = [block_byte_view(self.kv[i], num_blocks) for i in range(self.layers_n)]
        block_bytes = self.layers[0].shape[1]
        geom = PoolGeometry(self.num_pages, self.layers_n, self.bpp, block_bytes)
        self.pool = HostPagePool(geom, layout="page_first_direct", pin_memory=False)
        self.pool.buffer.fill_(0)  # touch it once, as a long-lived pool is
        self.path = io_backend.select("direct", "cpu")
        self.tokens = [int(t) for t in np.asarray(arrays["kv_tokens"])]
        self.seed = KeyNamespace("peer-bench", "bfloat16", "page_first_direct",
                                 self.page, 1).seed()
        self.alloc = SlotAllocator(self.num_pages)
        self.tree = HiRadixTree()
        self.backend = _file_backend(workdir / "ours-kv-l3", geom.page_bytes, self.pool)
        # Warm both directions (numba compiles or loads its cache on first use).
        warm = self._transfer(range(1), [0])
        self.path.save(self.layers, self.pool.canonical, warm, None)
        self.path.load(self.pool.canonical, self.layers, warm, None)

    def _transfer(self, pages: Sequence[int], slots: Sequence[int]) -> BlockTransfer:
        bpp = self.bpp
        return BlockTransfer.from_lists(
            [p * bpp + i for p in pages for i in range(bpp)],
            [s for s in slots for _ in range(bpp)],
            [i for _ in slots for i in range(bpp)],
        )

    def clear_l2(self) -> None:
        self.alloc.free(self.tree.reset())
        self.pool.invalidate_all()

    def store_l2(self) -> tuple[list[PageKey], list[int]]:
        """New pages' (keys, slots), already copied into the pool and in the tree."""
        keys = page_keys(self.seed, self.tokens, self.page)
        match = self.tree.match_prefix(keys)
        slots = self.alloc.alloc(len(keys) - match.num_pages)
        assert slots is not None, "L2 pool full"
        pages = range(match.num_pages, len(keys))
        self.path.save(self.layers, self.pool.canonical, self._transfer(pages, slots), None)
        for page, slot in zip(pages, slots, strict=True):
            self.pool.set_key(slot, keys[page])
        self.tree.insert(keys, list(match.host_slots) + slots)
        return keys[match.num_pages:], slots

    def store_l3(self) -> None:
        keys, slots = self.store_l2()
        assert all(self.backend.write(WriteBatch([k.hex() for k in keys], slots))), "L3 set failed"

    def retrieve_l2(self) -> int:
        keys = page_keys(self.seed, self.tokens, self.page)
        match = self.tree.match_prefix(keys)
        self.tree.lock(match.node)
        try:
            slots = match.host_slots
            assert all(self.pool.holds(s, k) for s, k in zip(slots, keys, strict=False))
            self.path.load(self.pool.canonical, self.layers,
                           self._transfer(range(match.num_pages), slots), None)
        finally:
            self.tree.unlock(match.node)
        return match.num_pages * self.page

    def retrieve_l3(self) -> int:
        keys = page_keys(self.seed, self.tokens, self.page)
        match = self.tree.match_prefix(keys)
        hex_keys = [k.hex() for k in keys[match.num_pages:]]
        n = self.backend.exists_prefix(hex_keys)
        slots = self.alloc.alloc(n)
        assert slots is not None, "L2 pool full"
        ok = self.backend.read(ReadBatch(hex_keys[:n], slots))
        n_ok = ok.index(False) if False in ok else n
        for slot, key in zip(slots[:n_ok], keys[match.num_pages:], strict=False):
            self.pool.set_key(slot, key)
        self.alloc.free(slots[n_ok:])
        total = match.num_pages + n_ok
        self.tree.insert(keys[:total], list(match.host_slots) + slots[:n_ok])
        return self.retrieve_l2()

    def verify(self) -> bool:
        return torch.equal(self.kv, self.reference)

    def close(self, workdir: Path) -> None:
        self.backend.close()
        shutil.rmtree(workdir / "ours-kv-l3", ignore_errors=True)


def measure_kv(doc: dict[str, Any], arrays: dict[str, np.ndarray],
               workdir: Path) -> dict[str, Metric]:
    h = _KVHarness(doc, arrays, workdir)
    times: dict[str, list[float]] = {"l2/store": [], "l2/retrieve": [],
                                     "l3/store": [], "l3/retrieve": []}
    verified = {"l2": True, "l3": True}
    got = {"l2": 0, "l3": 0}
    for rep in range(doc["repeats"] + 1):  # round 0 warms up (first touch) and is dropped
        if rep == 1:
            times = {name: [] for name in times}
        h.clear_l2()
        times["l2/store"].append(_timed(h.store_l2)[0])
        h.kv.zero_()
        s, got["l2"] = _timed(h.retrieve_l2)
        times["l2/retrieve"].append(s)
        verified["l2"] = verified["l2"] and h.verify() and got["l2"] == h.tokens_n

        h.clear_l2()
        h.backend.clear()
        os.sync()
        times["l3/store"].append(_timed(h.store_l3)[0])
        h.clear_l2()
        h.kv.zero_()
        s, got["l3"] = _timed(h.retrieve_l3)
        times["l3/retrieve"].append(s)
        verified["l3"] = verified["l3"] and h.verify() and got["l3"] == h.tokens_n
        h.kv.copy_(h.reference)
    h.close(workdir)
    out = {}
    for name, secs in times.items():
        tier, op = name.split("/")
        out[f"kv/{name}"] = metric(secs, h.nbytes, "B", h.tokens_n,
                                   verified[tier] if op == "retrieve" else None)
    return out


def measure(workload_json: Path, workdir: Path,
            parts: Sequence[str] = PARTS) -> dict[str, Any]:
    doc, arrays = load_workload(workload_json)
    workdir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, Metric] = {}
    if "radix" in parts:
        metrics.update(measure_radix(doc, arrays))
    if "file" in parts:
        metrics.update(measure_file(doc, arrays, workdir))
    if "kv" in parts:
        metrics.update(measure_kv(doc, arrays, workdir))
    return {"metrics": metrics, "versions": {"torch": torch.__version__,
                                             "copy_path": io_backend.select("direct",
                                                                            "cpu").name}}
