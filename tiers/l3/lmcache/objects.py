"""How HiCache pages become LMCache chunks: tokens, hashes, IPC keys, the shared-memory pool.

Contract: a page key becomes a chunk's tokens (its 8 little-endian uint32
words, zero-padded to the server's chunk size); ``chunk_hash`` is the
object hash the server derives from them (its blake3 chain, the default);
``registration``, ``ipc_key`` and ``delete_body`` are the payloads of
the server's calls for objects of one uint8 "MLA" layout
``[1, 1, header + page]``; ``ShmPool`` maps the server's shared-memory pool
and hands out the slot a descriptor names, checked against the pool's size.
No lmcache import.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import blake3
import numpy as np

from hicache.tiers.l3.lmcache.wire import Request

TOKENS_PER_KEY = 8  # a 32-byte page key as uint32 tokens
# LMCache's kv_rank bitmap for world size 1, rank 0: every shard is its own model name.
KV_RANK = 0x01000100
# blake3(prefix) as LMCache seeds its chain: the hash of (0, (0,)).
_NONE_HASH = blake3.blake3(struct.pack(">q", 0) + struct.pack(">I", 0)).digest()


def page_tokens(key: str, chunk_size: int) -> list[int]:
    """The chunk of tokens that stands for page ``key`` (64 hex chars) in LMCache."""
    return list(struct.unpack("<8I", bytes.fromhex(key))) + [0] * (chunk_size - TOKENS_PER_KEY)


def chunk_hash(key: str, chunk_size: int) -> bytes:
    """LMCache's object hash of page ``key`` (its blake3 chain over one chunk)."""
    tokens = page_tokens(key, chunk_size)
    return blake3.blake3(_NONE_HASH + struct.pack(f">{len(tokens)}I", *tokens)).digest()


def registration(instance_id: int, model_name: str, chunk_size: int,
                 object_bytes: int) -> dict[str, Any]:
    """The ``register_kv_cache_engine_driven_context`` payload for objects of
    ``object_bytes`` bytes, one per chunk (a uint8 "MLA" layout ``[1, 1, object_bytes]``)."""
    return {"instance_id": instance_id, "model_name": model_name, "world_size": 1,
            "block_size": chunk_size, "num_layers": 1, "hidden_dim_size": object_bytes,
            "dtype_str": "uint8", "use_mla": True, "num_physical_slots": 1}


def ipc_key(model_name: str, key: str, chunk_size: int, request_id: str) -> dict[str, Any]:
    """LMCache's ``IPCCacheServerKey`` for page ``key``: one chunk, in session ``request_id``."""
    return {"model_name": model_name, "world_size": 1, "worker_id": 0,
            "token_ids": page_tokens(key, chunk_size), "start": 0, "end": chunk_size,
            "request_id": request_id, "num_kv_readers": 1}


def delete_body(keys: Sequence[str], model_name: str, chunk_size: int,
                tier: str) -> dict[str, Any]:
    """The ``DELETE /cache/objects`` body removing these pages from ``tier``."""
    return {"tier": tier, "force": True, "keys": [
        {"chunk_hash_hex": chunk_hash(k, chunk_size).hex(), "model_name": model_name,
         "kv_rank": KV_RANK} for k in keys]}


def end_sessions(ipc: Sequence[dict[str, Any]]) -> list[Request]:
    """Requests ending the sessions of these IPC keys."""
    return [("end_session", (k["request_id"],)) for k in ipc]


def first_of(keys: Sequence[str]) -> list[int]:
    """For each position, the position of the first occurrence of its key."""
    seen: dict[str, int] = {}
    return [seen.setdefault(k, i) for i, k in enumerate(keys)]


class ShmPool:
    """The server's shared-memory pool, mapped into this process."""

    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        self._shm = shared_memory.SharedMemory(name=name, create=False)
        # The server owns the segment: this process must never unlink it.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(f"/{self._shm.name}", "shared_memory")
        self.bytes: np.ndarray | None = np.ndarray((size,), np.uint8, self._shm.buf)

    def slot(self, desc: Any, length: int) -> np.ndarray | None:
        """The slot a server descriptor names, if it is exactly ``length`` bytes in the pool."""
        try:
            offset, size = int(desc["offset"]), int(desc["length"])
        except (KeyError, TypeError, ValueError):
            return None
        if self.bytes is None or size != length or offset < 0 or offset + size > self.size:
            return None
        return self.bytes[offset:offset + size]

    def close(self) -> None:
        self.bytes = None
        with contextlib.suppress(Exception):
            self._shm.close()
