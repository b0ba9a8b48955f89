"""SGLang side of the peer benchmarks; runs in the SGLang peer venv, never imports hicache.

Usage: ``python sglang_peer.py <workload.json> <result.json> [radix,file]`` with
``scripts/stubs`` on ``PYTHONPATH`` (torchvision import stand-in).

Contract: times the same operations as ``hicache.integration.bench.peers.ours`` on
SGLang's own classes and writes metrics under the same names:
- ``radix/p{P}/{request,insert,match,miss,evict}`` on ``RadixCache.create_simulated``
  with page size P and a do-nothing allocator: each request is an
  ``array('q')`` of tokens; the timed loop builds the ``RadixKey`` and params
  objects as SGLang's scheduler does and inserts a precomputed int64 index
  tensor per request (its KV indices). ``request`` = match then insert of
  each request into an empty tree (a new request's flow). ``evict`` asks for half of
  ``evictable_size()`` (SGLang evicts whole leaves, so it may free more).
- ``file/{K}k/{set,exists,get}`` on ``HiCacheFile`` (``batch_set``,
  ``exists`` per key, ``batch_get`` into preallocated tensors, verified).
Each repeat starts from a fresh tree or an empty directory (setup untimed);
timed writes start after an untimed ``os.sync()``, as on our side.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peer_common import Metric, file_case, main, metric, timed


class _NullAllocator:
    """The two calls RadixCache makes on its KV allocator when evicting."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, value: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += len(value)

    def free(self, idx: torch.Tensor) -> None:
        self.freed += len(idx)


def radix(doc: dict[str, Any], arrays: dict[str, np.ndarray], workdir: Path) -> dict[str, Metric]:
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    r, repeats = doc["radix"], doc["repeats"]
    hit = [array("q", row.tolist()) for row in np.asarray(arrays["radix_hit"])]
    miss = [array("q", row.tolist()) for row in np.asarray(arrays["radix_miss"])]
    out: dict[str, Metric] = {}
    for p in r["page_sizes"]:
        values, base = [], 0
        for tokens in hit:
            n = len(tokens) // p * p
            values.append(torch.arange(base, base + n, dtype=torch.int64))
            base += n
        offered = base
        times: dict[str, list[float]] = {"request": [], "insert": [], "match": [], "miss": [],
                                         "evict": []}
        checks: dict[str, float] = {}
        for _ in range(repeats):
            tree = RadixCache.create_simulated(mock_allocator=_NullAllocator(), page_size=p)
            s, _ = timed(lambda t=tree, vs=values: _requests(t, hit, vs))
            times["request"].append(s)
            checks["request"] = tree.evictable_size()
            tree = RadixCache.create_simulated(mock_allocator=_NullAllocator(), page_size=p)
            s, _ = timed(lambda t=tree, vs=values: [
                t.insert(InsertParams(key=RadixKey(tok), value=v))
                for tok, v in zip(hit, vs, strict=True)])
            times["insert"].append(s)
            checks["insert"] = tree.evictable_size()
            s, res = timed(lambda t=tree: [
                t.match_prefix(MatchPrefixParams(key=RadixKey(tok))).device_prefix_len
                for tok in hit])
            times["match"].append(s)
            checks["match"] = sum(res)
            s, res = timed(lambda t=tree: [
                t.match_prefix(MatchPrefixParams(key=RadixKey(tok))).device_prefix_len
                for tok in miss])
            times["miss"].append(s)
            checks["miss"] = sum(res)
            want = tree.evictable_size() // 2
            s, res = timed(lambda t=tree, w=want: t.evict(EvictParams(num_tokens=w)))
            times["evict"].append(s)
            checks["evict"] = res.num_tokens_evicted
        amounts = {"insert": offered, "match": checks["match"], "miss": len(miss),
                   "evict": checks["evict"], "request": offered}
        for name, secs in times.items():
            out[f"radix/p{p}/{name}"] = metric(secs, amounts[name],
                                               "op" if name == "miss" else "tok", checks[name])
    return out


def _requests(tree: Any, hit: list[array], values: list[torch.Tensor]) -> None:
    """A new request's flow in SGLang's scheduler: match the prefix, then insert it all."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    for tokens, value in zip(hit, values, strict=True):
        tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        tree.insert(InsertParams(key=RadixKey(tokens), value=value))


def file(doc: dict[str, Any], arrays: dict[str, np.ndarray], workdir: Path) -> dict[str, Metric]:
    out: dict[str, Metric] = {}
    for case in doc["file_cases"]:
        out.update(_file_case(case, arrays, doc["repeats"], workdir / "sglang-file"))
    return out


def _open_file_store(directory: Path, page_bytes: int) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="peer/bench", extra_config={"file_storage_path": str(directory)})
    return HiCacheFile(cfg)


def _file_case(case: dict[str, Any], arrays: dict[str, np.ndarray], repeats: int,
               directory: Path) -> dict[str, Metric]:
    # HiCacheFile.batch_set answers one bool; batch_get a list with None per miss.
    return file_case(case, arrays, repeats, directory, _open_file_store,
                     set_ok=bool, get_ok=lambda got: all(g is not None for g in got))


def versions() -> dict[str, str]:
    import sglang

    return {"sglang": sglang.__version__, "torch": torch.__version__,
            "numpy": np.__version__}


if __name__ == "__main__":
    main({"radix": radix, "file": file}, versions)
