"""LMCache side of the peer benchmarks; runs in the LMCache peer venv, never imports hicache.

Usage: ``python lmcache_peer.py <workload.json> <result.json> [kv]``.

Contract: drives LMCache's own engine (``LMCacheEngineBuilder``) on CPU and
writes metrics under the names the runner compares with ours:
- The KV of one request, ``[2, L, T, H*D]`` bf16 from the workload, sits in
  a CPU tensor; ``CPUTensorConnector`` (ours, written here: LMCache ships no
  CPU connector) copies chunk slices between it and LMCache's ``MemoryObj``
  tensors (format KV_2LTD, ``[2, L, n, H*D]``) with numpy memcpys, which is
  what its GPU connectors do against device memory with CUDA kernels.
- ``kv/local_cpu/{store,retrieve}``: an engine with the LocalCPUBackend only.
  ``store(tokens)`` (token-chunk hashing, allocation, copy, put) and
  ``retrieve(tokens)`` (hashing, lookup, copy back into the zeroed tensor,
  verified byte-exact, all T tokens returned).
- ``kv/local_disk/{store,retrieve}``: an engine with LocalCPUBackend plus
  LocalDiskBackend. ``store`` is timed until every chunk's file is written
  (LMCache writes to disk asynchronously; the clock stops when the disk
  backend has indexed all chunks). ``retrieve`` first drops the CPU tier
  (untimed), so the bytes come from the chunk files.
- Each repeat starts from an engine emptied with ``engine.clear(tokens)``
  (untimed); one untimed warm-up round comes first (first touch of LMCache's
  buffer; ours does the same). Tokens are given as a Python list (LMCache's faster path).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peer_common import Metric, main, metric, timed


def _connector_class() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CPUTensorConnector(GPUConnectorInterface):
        """Copies between a CPU KV tensor [2, L, T, H*D] and KV_2LTD memory objects.

        The copies go through numpy (one single-threaded strided memcpy per
        chunk): torch's ``copy_`` of the same strided slices ran ~5x slower on
        this 2-core VM (its 2 OpenMP threads stall when a core is busy), which
        would have charged LMCache for torch, not for its engine.
        """

        def __init__(self, kv: torch.Tensor) -> None:
            self.kv = kv
            self.kv_np = kv.view(torch.int16).numpy()  # bf16 bits; numpy has no bf16
            self.kvcaches = None

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.kv.shape[1], num_tokens, self.kv.shape[3]])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            dst = memory_obj.tensor.view(torch.int16).numpy()
            np.copyto(dst, self.kv_np[:, :, start:end, :])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            src = memory_obj.tensor.view(torch.int16).numpy()
            np.copyto(self.kv_np[:, :, start:end, :], src)

        def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                             **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None,
                           ends: Any = None, **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end)

    return CPUTensorConnector


def _engine(name: str, kv: torch.Tensor, doc: dict[str, Any], disk: Path | None) -> Any:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    k = doc["kv"]
    nbytes = kv.numel() * kv.element_size()
    gb = max(0.25, 3 * nbytes / 2**30)  # room for the stored chunks plus read staging
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=k["chunk"], local_cpu=True, max_local_cpu_size=gb,
        local_disk=None if disk is None else f"file://{disk}/",
        max_local_disk_size=0 if disk is None else 4 * gb * doc["repeats"],
        remote_url=None)
    meta = LMCacheMetadata(
        model_name="peer-bench", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16,
        kv_shape=(k["layers"], 2, k["chunk"], k["kv_heads"], k["head_dim"]),
        role="worker", chunk_size=k["chunk"])
    engine = LMCacheEngineBuilder.get_or_create(name, cfg, meta, _connector_class()(kv),
                                                lambda t, r: None, lambda o, r: o)
    engine.post_init()  # builds the storage manager (vLLM's adapter calls this too)
    return engine


def _wait_on_disk(backend: Any, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while len(backend.dict) < n:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"LMCache wrote {len(backend.dict)} of {n} chunks to disk")
        time.sleep(0.0002)


def kv(doc: dict[str, Any], arrays: dict[str, np.ndarray], workdir: Path) -> dict[str, Metric]:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    k = doc["kv"]
    reference = torch.from_numpy(np.array(arrays["kv"])).view(torch.bfloat16)
    kv_tensor = reference.clone()
    tokens = [int(t) for t in np.asarray(arrays["kv_tokens"])]
    n_tokens, n_chunks = len(tokens), len(tokens) // k["chunk"]
    nbytes = kv_tensor.numel() * kv_tensor.element_size()
    out: dict[str, Metric] = {}
    for tier in ("local_cpu", "local_disk"):
        disk = workdir / "lmcache-disk" if tier == "local_disk" else None
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
            disk.mkdir(parents=True)
        name = f"peer-bench-{tier}-{os.getpid()}"
        engine = _engine(name, kv_tensor, doc, disk)
        try:
            disk_backend = (engine.storage_manager.storage_backends["LocalDiskBackend"]
                            if disk is not None else None)
            store_s: list[float] = []
            retrieve_s: list[float] = []
            verified = True
            for rep in range(doc["repeats"] + 1):  # round 0 warms up and is dropped
                if rep == 1:
                    store_s, retrieve_s = [], []
                engine.clear(tokens)
                if disk_backend is not None:
                    assert not disk_backend.dict, "LMCache disk tier not empty after clear"
                kv_tensor.copy_(reference)
                os.sync()  # no earlier writeback pending when the clock starts (ours: same)

                def store(eng: Any = engine, db: Any = disk_backend) -> None:
                    eng.store(tokens)
                    if db is not None:
                        _wait_on_disk(db, n_chunks)

                store_s.append(timed(store)[0])
                if disk_backend is not None:
                    engine.clear(locations=["LocalCPUBackend"])
                kv_tensor.zero_()
                s, mask = timed(lambda eng=engine: eng.retrieve(tokens))
                retrieve_s.append(s)
                verified = (verified and int(mask.sum()) == n_tokens
                            and torch.equal(kv_tensor, reference))
            out[f"kv/{tier}/store"] = metric(store_s, nbytes, "B", n_tokens)
            out[f"kv/{tier}/retrieve"] = metric(retrieve_s, nbytes, "B", n_tokens, verified)
        finally:
            LMCacheEngineBuilder.destroy(name)
            if disk is not None:
                shutil.rmtree(disk, ignore_errors=True)
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {"lmcache": version("lmcache"), "torch": torch.__version__,
            "numpy": np.__version__}


if __name__ == "__main__":
    main({"kv": kv}, versions)
