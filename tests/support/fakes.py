"""vLLM's Request as the scheduler half reads it, for engine-free scheduler tests.

The request is the simulator's (``SimRequest``): block hashes from the
engine-free stand-in (``token_block_hashes``), which is also the scheduler's
default prefix hasher, so flushes by prefix find the same keys as requests.
``file_store`` / ``write_pages``: the real file backend as the scheduler's L3
view, and pages put into it as another engine would have. ``prefill`` / ``serve``:
a request through one prefill step (and its end). ``GatedStore``: a
store whose lookups wait for the test to open a gate (no clock involved).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from hicache.integration.bench.sim_engine import SimRequest
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import (
    KeyNamespace,
    PageKey,
    block_page_keys,
    token_block_hashes,
)
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import Capabilities, StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded


def request(rid: str, tokens: list[int], computed: int = 0, block_size: int = 4) -> SimRequest:
    return SimRequest(rid, list(tokens), computed, block_size=block_size)


def prefill(sched: Any, req: SimRequest, block_ids: list[int]) -> Any:
    """Admit ``req`` with no hit and run its whole prompt in one step; the step's plan.
    (The scheduler's ``block_ids_of`` reads ``sched.tables``.)"""
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [block_ids], 0)
    sched.tables[req.request_id] = block_ids
    meta = sched.build_connector_meta({req.request_id: req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    return meta


def serve(sched: Any, req: SimRequest) -> int:
    """``req`` through admission (with whatever hit it gets), one step for the rest of
    its prompt, its end and the plan after it; the hit in tokens."""
    rid = req.request_id
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    blocks = list(range(1, len(req.all_token_ids) // req.block_size + 2))  # 0: null block
    sched.update_state_after_alloc(req, [blocks], hit)
    sched.tables[rid] = blocks
    sched.build_connector_meta({rid: req.num_tokens - hit})
    req.num_computed_tokens = req.num_tokens
    sched.request_finished(req, [blocks])
    sched.build_connector_meta({})
    return int(hit or 0)


def keys_of(seed: bytes, tokens: list[int], page: int, block_size: int = 4) -> list[PageKey]:
    """The page keys a request of ``tokens`` gets."""
    return block_page_keys(seed, token_block_hashes(tokens, block_size), page // block_size)


def file_store(path: Path, namespace: KeyNamespace, geometry: PoolGeometry) -> FileBackend:
    """The real file backend in ``path``, for pages of ``geometry``."""
    return guarded(FileBackend(StorageConfig(0, 1, namespace.fingerprint(), "page_first",
                                     geometry.page_bytes, extra_config={"path": str(path)})))


def write_pages(path: Path, namespace: KeyNamespace, geometry: PoolGeometry,
                keys: list[str]) -> None:
    """Pages under ``keys`` (hex) in the file store in ``path``, as another engine
    would have written them."""
    writer = file_store(path, namespace, geometry)
    writer.register_host_pool(HostPagePool(geometry, layout="page_first", pin_memory=False))
    assert all(writer.write(WriteBatch(keys, list(range(len(keys))))))


def write_prompt_pages(path: Path, namespace: KeyNamespace, geometry: PoolGeometry,
                       tokens: list[int], page: int) -> None:
    """Every full page of a prompt of ``tokens``, keyed as its request's pages, in
    the file store in ``path``, as another engine would have written them."""
    write_pages(path, namespace, geometry,
                [k.hex() for k in keys_of(namespace.seed(), tokens, page)])


class GatedStore:
    """exists_prefix blocks until ``gate`` opens; counts the callers inside."""

    capabilities = Capabilities(concurrent_lookups=True)

    def __init__(self, store=None, found: int | None = None, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.inside = threading.Semaphore(0)
        self.store, self.found, self.fail = store, found, fail

    def exists_prefix(self, keys):
        self.inside.release()
        assert self.gate.wait(30), "gate never opened"
        if self.fail:
            raise OSError("store down")
        return self.store.exists_prefix(keys) if self.store is not None else self.found

    def entered(self, n: int) -> None:
        for _ in range(n):
            assert self.inside.acquire(timeout=30), "probe never reached the store"


def scheduler_args(policy: SchedulerPolicy | None = None, **kw: Any) -> dict[str, Any]:
    """``HiCacheScheduler`` keywords for a test helper that takes policy fields among
    its own (``write_policy="write_back"``...): those folded into ``policy``."""
    names = {f.name for f in dataclasses.fields(SchedulerPolicy)}
    fields = {k: kw.pop(k) for k in list(kw) if k in names}
    kw["policy"] = dataclasses.replace(policy or SchedulerPolicy(), **fields)
    return kw
