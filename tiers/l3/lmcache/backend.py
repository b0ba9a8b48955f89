"""L3 backend on a stock LMCache multi-process server (``lmcache server``, "MP mode").

Contract (on top of ``base.py``):
- A pure client: never imports lmcache (its pins conflict with vLLM's; the
  server runs from its own venv). The wire is ``wire.py``, the objects
  ``objects.py``; the data
  moves through the server's shared-memory pool (``/dev/shm``): the server
  hands out slots, we copy, then commit. Its pickle transfer path (which
  unpickles client bytes) is never used.
- Extra-config keys (``LMCacheExtraConfig``; anything else is a
  ``StorageConfigError`` naming the key and the allowed keys):
    ``server_url``            "tcp://127.0.0.1:5555", the server's ``--host``/``--port``
    ``http_url``              None, or the server's ``--http-host``/``--http-port``
                              ("http://127.0.0.1:8080"); deletes and flushes need it
    ``transfer_mode``         "shm" (the only one)
    ``request_timeout_s``     5.0, bound on every round trip (and HTTP call)
    ``heartbeat_interval_s``  30.0, must stay under the server's 120 s reap
- Objects: one LMCache chunk per page, holding the 128-byte integrity header
  then the payload (``integrity.py``; every read is verified, a mismatch is
  a corrupt miss and the object is deleted when ``http_url`` is set).
  Registered as a uint8 "MLA" layout of shape ``[1, 1, header + page]``
  under model name ``hicache-<fingerprint>``: pages of another model, dtype,
  layout, page size or TP rank never alias, and LMCache never mistakes them
  for its own KV. A page key becomes the chunk's tokens: its 8 little-endian
  uint32 words, zero-padded to the server's chunk size (which must be >= 8).
  The server derives the object key from them (blake3 chain, its default);
  ``delete`` derives the same key locally (``chunk_hash``) and checks once,
  on a probe object, that the server agrees.
- Every page operation uses its own LMCache session (request id
  ``hicache-<instance>-<key>``, ended after use), because LMCache caches a
  session's hashes. A batch costs a few pipelined round trips whatever its
  size: store = prepare / commit+end; read = lookup+wait / prepare /
  commit+end; exists = lookup+wait / unlock+end.
- Writes: the server's ``prepare_store`` skips pages its DRAM tier holds
  (``set_skipped_existing``); a page only in its L2 is written again (an
  exists probe would load it from L2 first, costing more than the write).
- Store failures are reported (``report.failed``). A missing reply or a dropped
  connection is reported ``down`` and the guard's breaker opens
  (tiers/l3/guard.py): calls fail at once while a probe thread asks the server
  (``answers``) every half second; when it answers, the instance registers
  again (new shared memory if the server restarted) and the breaker closes.
  A heartbeat thread pings and re-registers (idempotent)
  every ``heartbeat_interval_s`` so the server never reaps a quiet client.
- ``clear`` deletes the pages this instance wrote or found (up to
  ``KNOWN_KEYS``, most recent first); LMCache's fs and Redis adapters cannot
  list objects, so pages written by earlier processes stay until the server
  evicts them. Prefix flushes (``delete``) delete exactly the pages
  named, from the DRAM tier and the L2; the count returned is what the DRAM
  tier held (L2 adapters report every key asked as deleted).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
import torch
from cachetools import LRUCache

from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import (
    Capabilities,
    ReadBatch,
    StorageBackend,
    StorageConfig,
    StorageConfigError,
    StorageUnavailable,
    WriteBatch,
    validate_extra,
)
from hicache.tiers.l3.lmcache.config import LMCacheExtraConfig
from hicache.tiers.l3.lmcache.objects import (
    TOKENS_PER_KEY,
    ShmPool,
    delete_body,
    end_sessions,
    first_of,
    ipc_key,
    registration,
)
from hicache.tiers.l3.lmcache.wire import Request, ServerGone, ServerTimeout, WireClient

logger = logging.getLogger(__name__)

HEADER = integrity.HEADER_BYTES
MAX_BATCH = 64  # pages per pipelined batch (bounds the slots held at once)
KNOWN_KEYS = 1 << 18
DELETE_BATCH = 5000  # the server refuses deletes of more than 10,000 keys
_PROBE_KEY = "00" * 31 + "01"


class LMCacheBackend(StorageBackend):
    """HiCache L3 pages as LMCache MP-server chunks (header || payload)."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.settings = validate_extra(config.extra_config, LMCacheExtraConfig, "lmcache")
        # The wire client serialises calls on its lock; lookups may come from the
        # scheduler's probe threads, off vLLM's scheduling thread.
        self.capabilities = Capabilities(concurrent_lookups=True, probe=True)
        s = self.settings
        self.model_name = f"hicache-{config.fingerprint.hex()}"
        self.object_bytes = HEADER + config.page_bytes
        # Above any PID, so never the id of a vLLM + LMCache worker on the same server.
        self.instance_id = (1 << 30) | secrets.randbits(30)
        self._fp = config.fingerprint
        self._lock = threading.Lock()  # registration, known keys, close
        self._closed = False
        self._stop = threading.Event()  # the heartbeat's
        self._shm: ShmPool | None = None
        self._known: LRUCache[str, bool] = LRUCache(KNOWN_KEYS)
        self._deletes_ok: bool | None = None  # None: not checked yet
        self._no_l2 = False  # the server said it has no L2 adapter
        self._wire = WireClient(s.server_url, connect_timeout_s=s.request_timeout_s)
        try:
            chunk = self._wire.call("get_chunk_size", timeout_s=s.request_timeout_s)
        except (ServerTimeout, ServerGone) as exc:
            self._wire.close()
            raise StorageUnavailable(
                f"LMCache server {s.server_url} does not answer ({exc}) "
                "(hicache_storage_backend_extra_config.server_url)") from None
        if not isinstance(chunk, int) or chunk < TOKENS_PER_KEY:
            self._wire.close()
            raise StorageConfigError(
                f"LMCache server {s.server_url} has chunk size {chunk!r}; the lmcache "
                f"backend needs >= {TOKENS_PER_KEY} (lmcache server --chunk-size)")
        self.chunk_size = chunk
        try:
            self._register()
        except (ServerTimeout, ServerGone, OSError, ValueError) as exc:
            self._wire.close()
            raise StorageUnavailable(
                f"LMCache server {s.server_url} refused the registration: {exc}") from None
        self._heartbeat = threading.Thread(target=self._beat, daemon=True,
                                           name="hicache-lmcache-heartbeat")
        self._heartbeat.start()

    # ---- registration, heartbeat, breaker --------------------------------------------------

    def _register(self, remap: bool = True) -> None:
        """Register (idempotent on the server) and map the pool it names: again when
        ``remap`` (the server may have restarted), else only if it names another one."""
        reply = self._wire.call(
            "register_kv_cache_engine_driven_context",
            registration(self.instance_id, self.model_name, self.chunk_size, self.object_bytes),
            timeout_s=self.settings.request_timeout_s)
        name = reply.get("shm_name", "") if isinstance(reply, dict) else ""
        size = int(reply.get("pool_size", 0)) if isinstance(reply, dict) else 0
        if not name or size <= 0:
            raise StorageUnavailable(
                f"LMCache server {self.settings.server_url} has no shared-memory pool: "
                "start it with --shm-name <name> (and without --l1-use-lazy)")
        with self._lock:
            old = self._shm
            if not remap and old is not None and (old.name, old.size) == (name, size):
                return
            self._shm = ShmPool(name, size)
        if old is not None:
            old.close()

    def _beat(self) -> None:
        s = self.settings
        while not self._stop.wait(s.heartbeat_interval_s):
            if self.report.down:
                continue
            try:
                self._wire.call_many([("ping", [self.instance_id])],
                                     timeout_s=s.request_timeout_s)
                self._register(remap=False)  # back in if the server reaped us
            except (ServerTimeout, ServerGone, StorageUnavailable, OSError) as exc:
                self._failed(exc)

    def _available(self) -> bool:
        """Whether to call the server now (breaker closed, same server as registered)."""
        if self.report.down or self._closed:
            return False
        if self._wire.reconnected():  # the server may have restarted: new pool, no us
            try:
                self._register()
            except (ServerTimeout, ServerGone, StorageUnavailable, OSError) as exc:
                self._failed(exc)
                return False
        return True

    def _failed(self, exc: BaseException) -> None:
        """Report the server down: the guard's breaker opens, ``answers`` closes it."""
        self.report.failed(f"{type(exc).__name__}: {exc}", down=not self._closed)

    def answers(self) -> bool:
        """The breaker's probe: the server answers, and takes this instance afresh."""
        if not self._wire.connected:
            return False
        try:
            self._wire.call("get_chunk_size", timeout_s=self.settings.request_timeout_s)
            # Drop what the server may still hold for us, then register afresh.
            self._wire.call("unregister_kv_cache_engine_driven_context", self.instance_id,
                            timeout_s=self.settings.request_timeout_s)
            self._wire.reconnected()
            self._register()
        except (ServerTimeout, ServerGone, StorageUnavailable, OSError):
            return False
        return True

    def _calls(self, requests: Sequence[Request]) -> list[Any] | None:
        """One pipelined round trip; None when the breaker is open or it failed (opening it)."""
        if self.report.down:
            return None
        try:
            return self._wire.call_many(requests, timeout_s=self.settings.request_timeout_s)
        except (ServerTimeout, ServerGone) as exc:
            self._failed(exc)
            return None

    # ---- keys ----------------------------------------------------------------------------

    def _ipc_key(self, key: str) -> dict[str, Any]:
        return ipc_key(self.model_name, key, self.chunk_size, self._session(key))

    def _session(self, key: str) -> str:
        return f"hicache-{self.instance_id:x}-{key}"

    def _remember(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = True

    # ---- the data path -------------------------------------------------------------------

    @staticmethod
    def _distinct_batches(keys: list[str], pages: list[np.ndarray],
                          run: Callable[[list[str], list[np.ndarray]], list[bool]],
                          first: list[int]) -> list[bool]:
        """``run`` over batches of ``MAX_BATCH`` distinct keys (``first``: ``first_of(keys)``);
        a repeated key gets its first occurrence's result."""
        todo = sorted(set(first))
        done: dict[int, bool] = {}
        for lo in range(0, len(todo), MAX_BATCH):
            batch = todo[lo:lo + MAX_BATCH]
            oks = run([keys[i] for i in batch], [pages[i] for i in batch])
            done.update(zip(batch, oks, strict=True))
        return [done[j] for j in first]

    def _write(self, keys: list[str], payloads: list[np.ndarray]) -> list[bool]:
        """Store pages (a key twice in ``keys`` is written once: the repeats are
        reported skipped)."""
        first = first_of(keys)
        results = self._distinct_batches(keys, payloads, self._write_batch, first)
        self.report.skipped(sum(1 for i, j in enumerate(first) if i != j and results[i]))
        return results

    def _write_batch(self, keys: list[str], payloads: list[np.ndarray]) -> list[bool]:
        n = len(keys)
        if not self._available():
            return [False] * n
        ipc = [self._ipc_key(k) for k in keys]
        replies = self._calls([("prepare_store", (k, self.instance_id)) for k in ipc])
        shm = self._shm
        if replies is None or shm is None:
            return [False] * n
        results = [False] * n
        commit: list[int] = []
        skipped = 0
        for i, reply in enumerate(replies):
            context = reply.get("context") if isinstance(reply, dict) else None
            slots = context.get("slots") if isinstance(context, dict) else None
            if slots == []:  # the server's DRAM tier already holds it
                results[i] = True
                skipped += 1
                continue
            slot = shm.slot(slots[0], self.object_bytes) if isinstance(slots, list) \
                and len(slots) == 1 else None
            if slot is None:  # not a slot we can fill: its reservation expires on the server
                continue
            slot[:HEADER] = np.frombuffer(
                integrity.pack_header(self.page_key_bytes(keys[i]), self._fp, payloads[i]),
                dtype=np.uint8)
            slot[HEADER:] = payloads[i]
            commit.append(i)
            results[i] = True
        done = self._calls([("commit_store", (ipc[i], self.instance_id, b"")) for i in commit]
                           + end_sessions(ipc))
        for j, i in enumerate(commit):
            results[i] = results[i] and done is not None and done[j] is True
        self._remember([k for k, ok in zip(keys, results, strict=True) if ok])
        self.report.skipped(skipped)
        return results

    def _lookup(self, ipc: list[dict[str, Any]]) -> list[int] | None:
        """Ask the server to hold each page (``ipc``: their ``_ipc_key``) in DRAM;
        1 per page it holds, else 0."""
        wait_s = self.settings.request_timeout_s * 0.8
        requests: list[Request] = []
        for k in ipc:
            requests += [("lookup", (k, 1)), ("wait_prefetch_status", (k["request_id"], wait_s))]
        replies = self._calls(requests)
        if replies is None:
            return None
        return [1 if replies[2 * i + 1] == 1 else 0 for i in range(len(ipc))]

    def _read(self, keys: list[str], targets: list[np.ndarray]) -> list[bool]:
        """Read pages into ``targets`` (a key twice in ``keys`` is read once, then copied)."""
        first = first_of(keys)
        results = self._distinct_batches(keys, targets, self._read_batch, first)
        for i, j in enumerate(first):
            if i != j and results[i]:
                targets[i][:] = targets[j]
        return results

    def _read_batch(self, keys: list[str], targets: list[np.ndarray]) -> list[bool]:
        n = len(keys)
        results = [False] * n
        ipc = [self._ipc_key(k) for k in keys]
        hits = self._lookup(ipc) if self._available() else None
        held = [i for i in range(n) if hits is not None and hits[i]]
        replies = self._calls([("prepare_retrieve", (ipc[i], self.instance_id))
                               for i in held]) if held else []
        corrupt: list[str] = []
        shm = self._shm
        for j, i in enumerate(held):
            reply = replies[j] if replies is not None else None
            slots = (reply.get("context") or {}).get("slots") if isinstance(reply, dict) \
                and reply.get("success") else None
            slot = shm.slot(slots[0], self.object_bytes) if shm and isinstance(slots, list) \
                and len(slots) == 1 else None
            if slot is None:
                continue
            header = bytes(slot[:HEADER])
            targets[i][:] = slot[HEADER:]
            why = integrity.verify(header, self.page_key_bytes(keys[i]), self._fp, targets[i])
            if why is None:
                results[i] = True
            else:
                logger.warning("LMCache page %s is corrupt (%s)", keys[i], why)
                corrupt.append(keys[i])
        if hits is not None:
            self._calls([("commit_retrieve", (ipc[i], self.instance_id)) for i in held]
                        + end_sessions(ipc))
        self._remember([k for k, ok in zip(keys, results, strict=True) if ok])
        if corrupt:
            self.report.corrupt(len(corrupt))
            self._delete(corrupt)
        return results

    # ---- the verbs ---------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        found = 0
        for lo in range(0, len(keys), MAX_BATCH):
            batch = keys[lo:lo + MAX_BATCH]
            ipc = [self._ipc_key(k) for k in batch]
            hits = self._lookup(ipc) if self._available() else None
            if hits is None:
                return found
            # Release what the lookups pinned in the server's DRAM, and the sessions.
            self._calls([("free_lookup_locks", (k, 1)) for k, hit in zip(ipc, hits, strict=True)
                         if hit] + end_sessions(ipc))
            run = hits.index(0) if 0 in hits else len(batch)
            self._remember(batch[:run])
            found += run
            if run < len(batch):
                break
        return found

    def read(self, batch: ReadBatch) -> list[bool]:
        pool = self._require_pool()
        views = self._slot_views(batch.slots)
        if views is not None:
            return self._read(list(batch.keys), views)
        # layer_first: through staging pages
        staging = [np.empty(self.config.page_bytes, dtype=np.uint8) for _ in batch.keys]
        results = self._read(list(batch.keys), staging)
        for ok, slot, data in zip(results, batch.slots, staging, strict=True):
            if ok:
                pool.write_page(slot, torch.from_numpy(data))
        return results

    def _slot_views(self, slots: Sequence[int]) -> list[np.ndarray] | None:
        """Byte views of the pool slots, or None where slots are not contiguous."""
        views = [self._require_pool().page_view(s) for s in slots]
        if any(v is None for v in views):
            return None
        return [v.numpy() for v in views if v is not None]

    def write(self, batch: WriteBatch) -> list[bool]:
        pool = self._require_pool()
        views = self._slot_views(batch.slots)
        if views is not None:
            return self._write(list(batch.keys), views)
        return self._write(list(batch.keys),
                           [pool.read_page(s).reshape(-1).contiguous().numpy()
                            for s in batch.slots])

    # ---- deletes, through the server's HTTP API ---------------------------------------------

    def _check_deletes(self) -> bool:
        """Once: whether the server derives object keys as ``chunk_hash`` does (a probe
        object written, then deleted by the key computed here)."""
        if self._deletes_ok is not None:
            return self._deletes_ok
        probe = np.zeros(self.config.page_bytes, dtype=np.uint8)
        if not self._write([_PROBE_KEY], [probe])[0]:
            return False  # the server is down: ask again next time
        deleted = self._http_delete([_PROBE_KEY], "l1")  # just written: in the DRAM tier
        if deleted is None:
            return False
        self._deletes_ok = deleted > 0
        if not self._deletes_ok:
            logger.warning("LMCache server %s names objects differently from this client "
                           "(it must run with --hash-algorithm blake3, the default); "
                           "pages cannot be deleted", self.settings.server_url)
        return self._deletes_ok

    def _http_delete(self, keys: list[str], tier: str) -> int | None:
        """Objects the server deleted from ``tier`` (l1 / l2 / all); None on failure."""
        url = self.settings.http_url
        assert url is not None
        if tier == "l2" and self._no_l2:
            return 0
        body = delete_body(keys, self.model_name, self.chunk_size, tier)
        try:
            reply = httpx.request("DELETE", url.rstrip("/") + "/cache/objects", json=body,
                                  timeout=self.settings.request_timeout_s)
            if tier == "l2" and reply.status_code == 503 and "L2" in reply.text:
                self._no_l2 = True  # a server without L2 adapters: nothing to delete there
                return 0
            reply.raise_for_status()
            return int(reply.json().get("deleted", 0))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.warning("LMCache delete through %s failed: %s", url, exc)
            self.report.failed(f"delete: {exc}")
            return None

    def _delete(self, keys: list[str]) -> int:
        if self.settings.http_url is None or not keys or not self._check_deletes():
            return 0
        found = 0
        for lo in range(0, len(keys), DELETE_BATCH):
            batch = keys[lo:lo + DELETE_BATCH]
            # The DRAM tier counts what it held; L2 adapters count every key asked
            # (fs, Redis), so pages only in L2 are deleted but not counted.
            found += self._http_delete(batch, "l1") or 0
            self._http_delete(batch, "l2")
        with self._lock:
            for key in keys:
                self._known.pop(key, None)
        return min(found, len(keys))

    def _require_http(self) -> None:
        if self.settings.http_url is None:
            raise NotImplementedError(
                "the lmcache backend deletes pages through the server's HTTP API: set "
                "hicache_storage_backend_extra_config.http_url")

    def delete(self, keys: Sequence[str]) -> int:
        self._require_http()
        return self._delete(list(keys))

    def clear(self) -> None:
        self._require_http()
        with self._lock:
            keys = list(self._known.keys())
        self._delete(keys)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if not self.report.down and self._wire.connected:
            with contextlib.suppress(ServerTimeout, ServerGone):
                self._wire.call("unregister_kv_cache_engine_driven_context", self.instance_id,
                                timeout_s=min(1.0, self.settings.request_timeout_s))
        self._wire.close()
        with self._lock:
            shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
