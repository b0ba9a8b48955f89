"""Throughput of the lmcache L3 backend versus a raw client of the same LMCache server.

Contract: ``bench_lmcache(page_bytes, num_pages, repeats)`` starts its own
``lmcache server`` on 127.0.0.1 (``lmcache_service``; DRAM tier only, sized
for both sides' pages) and in this one process measures:
- ours: ``LMCacheBackend.write`` / ``read`` on a
  ``HostPagePool`` (page_first_direct, one layer, one block per page):
  integrity header and xxh3 checksum, one session per page; get with
  header check and checksum verification;
- raw: the same wire calls a page-addressed client of this server needs at
  least (``RawClient``): store = prepare_store / copy / commit_store +
  end_session; read = lookup + wait_prefetch_status / prepare_retrieve /
  copy / commit_retrieve + end_session, pipelined in batches of the same
  size, objects of the bare page under their own model name; no header, no
  checks.
Before every put both sides' objects are deleted through the HTTP API, so no
write is skipped. Each repeat runs ours then raw. Returns medians in GB/s
(1e9 bytes of payload per second) and every sample. Data read back is
checked bit-exact once per side. Everything it starts is stopped before it
returns. ``per_call_ms`` is the server's cost of each wire operation (64
pipelined calls each), the number a batch API would cut.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import httpx
import numpy as np
import torch

from hicache.integration.bench.lmcache_service import start_lmcache
from hicache.integration.bench.micro.store_rounds import ours_round, source_pool, timed
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.lmcache.backend import MAX_BATCH, LMCacheBackend
from hicache.tiers.l3.lmcache.objects import ShmPool, delete_body, ipc_key, registration
from hicache.tiers.l3.lmcache.wire import Request, WireClient

TIMEOUT_S = 60.0


class RawClient:
    """The fewest wire calls that store and read one object per page (no header, no checks)."""

    def __init__(self, server_url: str, http_url: str, page_bytes: int) -> None:
        self.wire = WireClient(server_url, connect_timeout_s=TIMEOUT_S)
        self.http_url, self.page_bytes = http_url, page_bytes
        self.iid = (1 << 30) | os.getpid()
        self.model = f"raw-bench-{page_bytes}"
        self.chunk = int(self.wire.call("get_chunk_size", timeout_s=TIMEOUT_S))
        reply = self.wire.call("register_kv_cache_engine_driven_context",
                               registration(self.iid, self.model, self.chunk, page_bytes),
                               timeout_s=TIMEOUT_S)
        self.shm = ShmPool(reply["shm_name"], int(reply["pool_size"]))

    def _key(self, key: str) -> dict[str, Any]:
        return ipc_key(self.model, key, self.chunk, f"raw-{key}")

    def put(self, keys: list[str], pages: list[np.ndarray]) -> int:
        replies = self.wire.call_many([("prepare_store", (self._key(k), self.iid)) for k in keys],
                                      TIMEOUT_S)
        for reply, page in zip(replies, pages, strict=True):
            slot = self.shm.slot(reply["context"]["slots"][0], self.page_bytes)
            assert slot is not None
            slot[:] = page
        done = self.wire.call_many(
            [("commit_store", (self._key(k), self.iid, b"")) for k in keys]
            + [("end_session", (f"raw-{k}",)) for k in keys], TIMEOUT_S)
        return sum(1 for ok in done[:len(keys)] if ok is True)

    def get(self, keys: list[str], pages: list[np.ndarray]) -> int:
        requests: list[Request] = []
        for k in keys:
            requests += [("lookup", (self._key(k), 1)),
                         ("wait_prefetch_status", (f"raw-{k}", TIMEOUT_S))]
        self.wire.call_many(requests, TIMEOUT_S)
        replies = self.wire.call_many(
            [("prepare_retrieve", (self._key(k), self.iid)) for k in keys], TIMEOUT_S)
        got = 0
        for reply, page in zip(replies, pages, strict=True):
            if reply["success"]:
                slot = self.shm.slot(reply["context"]["slots"][0], self.page_bytes)
                assert slot is not None
                page[:] = slot
                got += 1
        self.wire.call_many([("commit_retrieve", (self._key(k), self.iid)) for k in keys]
                            + [("end_session", (f"raw-{k}",)) for k in keys], TIMEOUT_S)
        return got

    def delete(self, keys: list[str]) -> None:
        body = delete_body(keys, self.model, self.chunk, "l1")  # the server has no L2 here
        httpx.request("DELETE", f"{self.http_url}/cache/objects", json=body,
                      timeout=TIMEOUT_S).raise_for_status()

    def close(self) -> None:
        self.wire.close()
        self.shm.close()


def per_call_ms(wire: WireClient, backend: LMCacheBackend, keys: list[str]) -> dict[str, float]:
    """Milliseconds per call of each wire operation, 64 pipelined calls each (``keys``
    already stored)."""
    out: dict[str, float] = {}
    batch = keys[:64]
    wait = TIMEOUT_S * 0.5
    plans: dict[str, list[Request]] = {
        "ping": [("ping", [backend.instance_id])] * len(batch),
        "lookup": [("lookup", (backend._ipc_key(k), 1)) for k in batch],
        "wait_prefetch_status": [("wait_prefetch_status", (backend._session(k), wait))
                                 for k in batch],
        "free_lookup_locks": [("free_lookup_locks", (backend._ipc_key(k), 1)) for k in batch],
        "end_session": [("end_session", (backend._session(k),)) for k in batch],
    }
    for name, requests in plans.items():
        t0 = time.perf_counter()
        wire.call_many(requests, TIMEOUT_S)
        secs = time.perf_counter() - t0
        out[name] = secs / len(requests) * 1e3
    return out


def bench_lmcache(page_bytes: int, num_pages: int, repeats: int) -> dict[str, Any]:
    """GB/s of put and get through LMCacheBackend versus ``RawClient`` on one server."""
    pool = source_pool(page_bytes, num_pages)
    payload = num_pages * page_bytes
    # both sides' objects at once, with room to spare (its eviction starts before full)
    l1_gb = max(0.25, 3 * num_pages * (page_bytes + 4096) / 2**30)
    batches = [(lo, min(lo + MAX_BATCH, num_pages)) for lo in range(0, num_pages, MAX_BATCH)]
    rows = pool.buffer.view(2 * num_pages, page_bytes).numpy()
    samples: dict[str, list[float]] = {"ours_put": [], "ours_get": [], "raw_put": [],
                                       "raw_get": []}
    with start_lmcache(None, l1_size_gb=l1_gb) as svc:
        backend = LMCacheBackend(StorageConfig(
            tp_rank=0, tp_size=1, namespace="bench", mem_layout="page_first_direct",
            page_bytes=page_bytes, extra_config=svc.extra_config(request_timeout_s=TIMEOUT_S)))
        raw = RawClient(svc.server_url, svc.http_url, page_bytes)
        try:
            backend.register_host_pool(pool)
            keys = [f"{i:064x}" for i in range(1, num_pages + 1)]
            raw_checked = False
            for rep in range(repeats):
                backend.delete(keys)
                ours_round(backend, pool, keys, MAX_BATCH, samples, check=rep == 0)
                # ---- raw, same bytes
                raw.delete(keys)
                secs, ok = timed(lambda: sum(raw.put(keys[lo:hi], list(rows[lo:hi]))
                                              for lo, hi in batches))
                if ok != num_pages:
                    raise RuntimeError(f"raw client stored {ok}/{num_pages} pages")
                samples["raw_put"].append(payload / secs / 1e9)
                pool.buffer[num_pages:].zero_()
                secs, ok = timed(lambda: sum(
                    raw.get(keys[lo:hi], list(rows[num_pages + lo:num_pages + hi]))
                    for lo, hi in batches))
                if ok != num_pages:
                    raise RuntimeError(f"raw client loaded {ok}/{num_pages} pages")
                samples["raw_get"].append(payload / secs / 1e9)
                if not raw_checked:
                    assert torch.equal(pool.buffer[:num_pages], pool.buffer[num_pages:])
                    raw_checked = True
            calls = per_call_ms(raw.wire, backend, keys)
        finally:
            raw.close()
            backend.close()
    med = {name: statistics.median(vals) for name, vals in samples.items()}
    return {
        "page_bytes": page_bytes, "num_pages": num_pages, "repeats": repeats,
        "batch_pages": MAX_BATCH,
        "ours_put_gbps": med["ours_put"], "ours_get_gbps": med["ours_get"],
        "raw_put_gbps": med["raw_put"], "raw_get_gbps": med["raw_get"],
        "per_call_ms": calls, "samples_gbps": samples,
    }
