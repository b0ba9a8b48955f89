"""The admin endpoint's view of one engine: what integration/admin/ serves.

The protocol it implements is ``AdminTarget`` in integration/admin/target.py.

See DESIGN.md "Admin actions".

Contract:
- ``SchedulerAdmin`` implements ``AdminTarget`` over the scheduler half. It
  runs in the admin server's threads; every read or change of the tree,
  the slots or the scheduler's storage instance holds the scheduler lock
  that the connector also holds around vLLM's calls, so the admin never
  sees or leaves a half-updated tree and never blocks the engine for longer
  than one such operation.
- ``stats()`` merges the scheduler's counters with the workers' (copies,
  L3 traffic, corrupt pages, queue depths, latency histograms), which
  arrive with every step's worker report (``record_worker_report``);
  per-tier fields are in pages and bytes per TP rank, ``recent_*_gbps``
  over the last ~10 s. Its sections are the sources named in
  tiers/metrics.py, from which the admin ``/metrics`` is rendered.
- Work for the workers (a prefetch, an L3 command, an L3 retention) goes with
  the next engine step, and the admin calls ``wake`` (the connector's:
  connector/vllm_wake.py) so that an idle engine takes that step now.
- ``prefetch`` plans a prompt's L3 pages into L2 for the next engine step; a
  request's ``return_in_s`` books the same for its prompt and answer, started
  when due by ``returns`` (returns.py: ``booked`` in ``prefetch_status`` until
  then, and cancellable);
  ``pin`` / ``unpin`` keep a prefix's L2 pages ahead of LRU until a deadline
  (pins.py; ``stats()["pins"]`` shows them, expired ones never);
  ``forget`` removes a conversation's own pages from L2 and L3 (flush.py) the
  way ``flush`` removes a prefix's; ``lookup`` says how many leading tokens
  of a prompt L2 and L3 hold and how long loading them should take;
  ``session`` / ``close_session`` show and close a session (sessions.py:
  closing ends its pins and ranks its own pages below every open session's,
  or with ``forget`` removes them from L2 and L3 like ``forget``).
- ``flush`` and ``detach_storage`` / ``attach_storage`` change the
  scheduler (and its own L3 instance) at once; the matching commands reach
  every worker with the next engine step, where queued backups of flushed
  pages are dropped and each rank deletes its own shard after any backup
  already running. L3 calls run outside the scheduler lock.
- Client mistakes raise a kind of ``AdminError`` whose message names the
  allowed values: ``BadRequest`` (the request names something invalid: a tier,
  a prefix, a backend, a backend configuration that cannot be built),
  ``Conflict`` (the cache's state refuses it now: no L3 attached, pins over
  their share, no room in L2), ``NotFound``. No HTTP here: the admin app
  (integration/admin/target.py) maps each kind to its status.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from hicache.tiers.controller.fetches import L3Store
from hicache.tiers.controller.pins import PinRefused
from hicache.tiers.controller.prefetch_ops import OpConflict, PrefetchOps
from hicache.tiers.controller.returns import ReturnPrefetches
from hicache.tiers.controller.scheduler import NoRoom
from hicache.tiers.index.commands import (
    AttachStore,
    ClearStore,
    DetachStore,
    L3Removal,
)
from hicache.tiers.l3.base import StorageBackend, StorageConfigError
from hicache.tiers.metrics import LatencyBuckets, section_metrics
from hicache.tiers.metrics import WorkerGauge as G
from hicache.tiers.metrics import WorkerKey as K

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from hicache.tiers.config import HiCacheConfig
    from hicache.tiers.controller.scheduler import HiCacheScheduler
    from hicache.tiers.index.page_keys import PageKey
    from hicache.tiers.index.plans import WorkerReport
    from hicache.tiers.index.tree_node import TreeNode

TIERS = ("l2", "l3", "all")
RATE_WINDOW_S = 10.0


class AdminError(Exception):
    """A client error of an admin action; its kind (below) says which, its message
    what is wrong and what is allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = str(message)


class BadRequest(AdminError):
    """The request names something invalid (a tier, a prefix, a backend)."""


class Conflict(AdminError):
    """The cache's state refuses the action now (no L3 attached, pins over their share)."""


class NotFound(AdminError):
    """What the request names is not in the cache."""


class SchedulerAdmin:
    """``AdminTarget`` of one engine core (see the module docstring)."""

    def __init__(
        self,
        scheduler: HiCacheScheduler,
        config: HiCacheConfig,
        *,
        engine: dict[str, Any],
        build_storage: Any,
        l1_pages: int,
        wake: Callable[[], object] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.hicache_config = config
        self.engine = engine
        # (backend name, extra config) -> a scheduler-side StorageBackend
        self._build_storage = build_storage
        self.storage_name: str | None = config.hicache_storage_backend
        self._l1_pages = l1_pages
        self.worker_counters: dict[str, float] = {}
        # rank -> its latest gauges (tiers/metrics.py WorkerGauge)
        self.worker_gauges: dict[int, dict[str, float]] = {}
        self.worker_latency: dict[str, LatencyBuckets] = {
            m.key: LatencyBuckets(m.buckets) for m in section_metrics("latency")}
        self._samples: deque[tuple[float, float, float]] = deque()
        self._lock = threading.Lock()
        # POST /prefetch operations: ids, status, cancel (prefetch_ops.py).
        self.prefetches = PrefetchOps(scheduler)
        # Wakes an idle engine so that it steps and carries work to the workers
        # (connector/vllm_wake.py); a no-op where the engine cannot be woken.
        self._wake: Callable[[], object] = wake or (lambda: None)
        # Requests' return_in_s prefetches, started when due (returns.py).
        self.returns = ReturnPrefetches(self._start_return)
        scheduler.returning = self._book_return

    # ---- fed by the connector (engine thread) ----------------------------------

    def record_worker_report(self, report: WorkerReport) -> None:
        with self._lock:
            for name, value in report.counters.items():
                self.worker_counters[name] = self.worker_counters.get(name, 0) + value
            for rank, latest in report.gauges.items():
                self.worker_gauges.setdefault(rank, {}).update(latest)
            for name, values in report.observations.items():
                if name in self.worker_latency:
                    self.worker_latency[name].observe(values)
            now = time.monotonic()
            c = self.worker_counters
            self._samples.append((now, c.get(K.LOADED_BYTES, 0), c.get(K.SAVED_BYTES, 0)))
            while len(self._samples) > 2 and now - self._samples[1][0] > RATE_WINDOW_S:
                self._samples.popleft()

    def record_observations(self, observations: dict[str, list[float]]) -> None:
        """Histogram observations of the scheduler's own (per finished request)."""
        with self._lock:
            for name, values in observations.items():
                if name in self.worker_latency:
                    self.worker_latency[name].observe(values)

    # ---- AdminTarget -----------------------------------------------------------

    def config(self) -> dict[str, Any]:
        return {"hicache": self.hicache_config.to_dict(),
                "storage_backend": self.storage_name, "engine": dict(self.engine)}

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        with s.lock:
            st = s.stats
            page_bytes = s.geometry.page_bytes
            l2_used, l2_cap = s.slots.num_used, s.slots.capacity
            inflight = len(s.fetches.in_flight)
            l3_indexed = s.tree.l3_pages()
            backlog = s.catch_up.backlog
            pins = s.pins.stats()
            sessions = s.sessions.stats()
            counters = st.as_dict()
        with self._lock:
            w = dict(self.worker_counters)
            g: dict[str, float] = {}
            for values in self.worker_gauges.values():
                for name, value in values.items():
                    g[name] = g.get(name, 0) + value
            latency = {k: v.as_dict() for k, v in self.worker_latency.items()}
            load_gbps, save_gbps = self._rates()
        tiers: dict[str, dict[str, Any]] = {
            "l1": {"capacity_pages": self._l1_pages, "hits": st.l1_hit_pages},
            "l2": {
                "capacity_pages": l2_cap, "used_pages": l2_used,
                "capacity_bytes": l2_cap * page_bytes, "used_bytes": l2_used * page_bytes,
                "hits": st.l2_hit_pages, "misses": st.l2_miss_pages,
                "evictions": st.evicted_pages,
                "pages_loaded": st.loaded_pages, "bytes_loaded": int(w.get(K.LOADED_BYTES, 0)),
                "pages_saved": int(w.get(K.SAVED_PAGES, 0)),
                "bytes_saved": int(w.get(K.SAVED_BYTES, 0)),
                "recent_load_gbps": load_gbps, "recent_save_gbps": save_gbps,
            },
        }
        if self.storage_name is not None:
            tiers["l3"] = {
                "hits": st.l3_hit_pages, "misses": st.l3_miss_pages,
                "pages_loaded": int(w.get(K.L3_FETCHED_PAGES, 0)),
                "bytes_loaded": int(w.get(K.L3_BYTES_READ, 0)),
                "pages_saved": int(w.get(K.L3_BACKUP_PAGES, 0)),
                "bytes_saved": int(w.get(K.L3_BYTES_WRITTEN, 0)),
                "corrupt_pages": int(w.get(K.L3_CORRUPT_PAGES, 0)),
                "indexed_pages": l3_indexed,
                "backlog_pages": backlog,
                "catch_up_pages": counters["l3_catch_up_pages"],
                "unreachable_ranks": int(g.get(G.L3_BREAKER_OPEN, 0)),
            }
        return {
            "tiers": tiers,
            "queues": {
                "l3_fetch_requests_inflight": inflight,
                G.L3_FETCH_QUEUE.value: int(g.get(G.L3_FETCH_QUEUE, 0)),
                G.L3_BACKUP_QUEUE_PAGES.value: int(g.get(G.L3_BACKUP_QUEUE_PAGES, 0)),
            },
            "policy": {
                "write_policy": self.hicache_config.hicache_write_policy,
                "prefetch_policy": self.hicache_config.hicache_storage_prefetch_policy,
                "mem_layout": self.hicache_config.hicache_mem_layout,
                "storage_backend": self.storage_name or "none",
                "write_through_threshold": self.hicache_config.hicache_write_through_threshold,
            },
            "pins": pins,
            "sessions": sessions,
            "scheduler": {k: v for k, v in counters.items() if isinstance(v, (int, float))},
            "worker": {k: v for k, v in w.items()},
            "latency": latency,
        }

    def _gbps(self, bytes_key: str, seconds_key: str) -> float | None:
        """GB/s of ``bytes_key`` over the summed time of ``seconds_key``'s observations
        (None until measured). Holds ``self._lock``."""
        seconds = self.worker_latency.get(seconds_key)
        moved = self.worker_counters.get(bytes_key, 0)
        if seconds is None or seconds.total <= 0 or not moved:
            return None
        return moved / seconds.total / 1e9

    def _rates(self) -> tuple[float, float]:
        if len(self._samples) < 2:
            return 0.0, 0.0
        (t0, l0, s0), (t1, l1, s1) = self._samples[0], self._samples[-1]
        dt = max(t1 - t0, 1e-9)
        return (l1 - l0) / dt / 1e9, (s1 - s0) / dt / 1e9

    def flush(self, tiers: list[str], prefix: list[int] | None,
              cache_salt: str | None) -> dict[str, int]:
        unknown = sorted(set(tiers) - set(TIERS))
        if unknown or not tiers:
            raise BadRequest(f"unknown tier(s) {unknown or tiers}: allowed values "
                             f"{list(TIERS)} (L1 is vLLM's own cache: use vLLM's "
                             "/reset_prefix_cache)")
        chosen = {"l2", "l3"} if "all" in tiers else set(tiers)
        if "l3" in chosen and self.storage_name is None and "all" not in tiers:
            raise Conflict("no L3 storage backend is attached")
        s = self.scheduler
        try:
            with s.lock:
                counts, l3_op = s.flush(chosen, prefix, cache_salt)
                storage = s.storage
        except ValueError as exc:  # token ids out of range
            raise BadRequest(f"prefix: {exc}") from exc
        return self._remove_from_l3(counts, l3_op, storage)

    def forget(self, prefix: list[int], cache_salt: str | None,
               keep_tokens: int) -> dict[str, int]:
        """A conversation's own pages out of L2 and L3 (tiers/controller/flush.py)."""
        s = self.scheduler
        try:
            with s.lock:
                counts, l3_op = s.forget(prefix, cache_salt, keep_tokens=keep_tokens)
                storage = s.storage
        except ValueError as exc:  # token ids out of range
            raise BadRequest(f"prefix: {exc}") from exc
        return self._remove_from_l3(counts, l3_op, storage)

    def session(self, session_id: str) -> dict[str, Any]:
        """A session's state (tiers/controller/sessions.py); 404 for an unknown id."""
        s = self.scheduler
        with s.lock:
            session = s.sessions.get(session_id)
            if session is None:
                raise NotFound(_unknown_session(session_id))
            return session.view(s.sessions.clock())

    def close_session(self, session_id: str, forget: bool) -> dict[str, Any]:
        """Close a session: its pins end and its own pages are evicted before any
        open session's, or with ``forget`` leave L2 and L3 (the scheduler's close_session)."""
        s = self.scheduler
        with s.lock:
            try:
                counts, l3_op = s.close_session(session_id, forget)
            except KeyError:
                raise NotFound(_unknown_session(session_id)) from None
            storage = s.storage
        if forget:
            counts = self._remove_from_l3(counts, l3_op, storage)
        return {"session_id": session_id, **counts}

    def lookup(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        """How many leading tokens of ``prefix`` L2 and L3 hold, and what loading
        them should take at the bandwidths measured so far (None: not measured yet).
        L2 is read from the tree without touching it; L3 is asked (outside the
        scheduler lock), so pages other engines wrote count too."""
        s = self.scheduler
        keys = self._prompt_keys(prefix, cache_salt)
        with s.lock:
            l2_pages = s.tree.peek(keys)
            storage, spans = s.storage, s.l2.spans
            page, page_bytes = s.page_size, s.geometry.page_bytes
        l3_pages = 0
        if storage is not None and keys:
            try:  # through span objects and page objects (tiers/index/spans.py)
                l3_pages = spans.run_in_store(storage.exists_prefix, keys, 0, len(keys))
            except Exception:  # noqa: BLE001 - a failing store holds nothing we can load
                l3_pages = 0
        with self._lock:
            # Each tier's bytes over its copies' own time (every rank's of both), not
            # over the wall clock: an idle server would otherwise look slow.
            l2_gbps = self._gbps(K.LOADED_BYTES, K.L2_LOAD_SECONDS)
            l3_gbps = self._gbps(K.L3_BYTES_READ, K.L3_FETCH_SECONDS)
        # A load reads L2's pages from L2 and what L2 lacks from L3.
        from_l3 = max(0, l3_pages - l2_pages)
        return {
            "prefix_tokens": len(prefix), "page_size": page,
            "tokens": {"l2": l2_pages * page, "l3": l3_pages * page},
            "load_gbps": {"l2": l2_gbps, "l3": l3_gbps},
            "expected_load_s": {
                "l2": l2_pages * page_bytes / (l2_gbps * 1e9) if l2_gbps else None,
                "l3": from_l3 * page_bytes / (l3_gbps * 1e9) if l3_gbps else None,
            },
        }

    def prefetch(self, prefix: list[int], cache_salt: str | None, op_id: str | None = None,
                 ttl_s: float | None = None) -> dict[str, Any]:
        """Read what L3 holds of ``prefix`` beyond L2 into L2, starting with the next
        engine step, which an idle engine takes now (woken for it), as the operation
        ``op_id`` (prefetch_ops.py: idempotent per id and prompt, ``ttl_s`` bounds
        the read); 409 when the id names another prompt or too many run."""
        planned = self._plan_prefetch(self._prompt_keys(prefix, cache_salt), op_id, ttl_s)
        if planned is None:
            raise Conflict("no L3 storage backend is attached")
        op, pages, in_l3, in_l2 = planned
        page = self.scheduler.page_size
        return {"prefetch_tokens": pages * page, "l3_tokens": in_l3 * page,
                "l2_tokens": in_l2 * page, **op}

    def _plan_prefetch(self, keys: Sequence[PageKey], op_id: str | None, ttl_s: float | None,
                       ) -> tuple[dict[str, Any], int, int, int] | None:
        """Plan the read of what L3 holds of ``keys`` beyond L2 as the operation
        ``op_id`` and wake the engine for it: (the operation, pages planned, pages L3
        holds, pages L2 holds); None without an L3. ``Conflict`` when the store
        cannot be asked, L2 has no room or the operations refuse it."""
        s = self.scheduler
        with s.lock:
            storage, spans = s.storage, s.l2.spans
        if storage is None:
            return None
        try:  # outside the lock: a slow store must not stall the engine; through span
            # objects and page objects, as lookups count (tiers/index/spans.py)
            in_l3 = spans.run_in_store(storage.exists_prefix, keys, 0, len(keys)) if keys else 0
        except Exception as exc:  # noqa: BLE001 - a failing store holds nothing to read
            raise Conflict(f"the L3 store could not be asked: {exc}") from exc
        try:
            with s.lock:
                op, pages = self.prefetches.start(op_id, keys, in_l3, ttl_s)
                in_l2 = s.tree.peek(keys)
        except (NoRoom, OpConflict) as exc:
            raise Conflict(str(exc)) from exc
        if pages:
            self._wake()
        return op, pages, in_l3, in_l2

    def _book_return(self, req_id: str, keys: Sequence[PageKey], return_in_s: float) -> str:
        """A finished request's ``return_in_s``: book its prefetch (engine thread)."""
        self.returns.start_thread()
        return self.returns.book(req_id, keys, return_in_s)

    def _start_return(self, op_id: str, keys: Sequence[PageKey]) -> None:
        """A booked ``return_in_s`` prefetch is due: planned as ``prefetch`` plans one
        (nothing without keys or an L3)."""
        if keys:
            self._plan_prefetch(keys, op_id, None)

    def close(self) -> None:
        """Stop starting booked prefetches (the engine is shutting down)."""
        self.returns.close()

    def prefetch_status(self, op_id: str) -> dict[str, Any]:
        # Bookings first: one being started is known there until the operations know it.
        op = self.returns.view(op_id)
        if op is None or op["status"] == "failed":
            with self.scheduler.lock:
                op = self.prefetches.status(op_id) or op
        if op is None:
            raise NotFound(f"no prefetch with id {op_id!r} (ended ones are kept for the "
                           f"last {self.prefetches.keep} that ended)")
        return op

    def cancel_prefetch(self, op_id: str) -> dict[str, Any]:
        cancelled = self.returns.cancel(op_id)  # a booking not started yet
        if cancelled is not None:
            return cancelled
        with self.scheduler.lock:
            op = self.prefetches.cancel(op_id)
        if op is None:
            op = self.returns.view(op_id)  # one that could not start: nothing to cancel
            if op is not None:
                return op
            raise NotFound(f"no prefetch with id {op_id!r}")
        self._wake()  # a running read is stopped by a command with the next step
        return op

    def pin(self, prefix: list[int], cache_salt: str | None, ttl_s: float) -> dict[str, Any]:
        """Keep what L2 holds of ``prefix`` ahead of LRU for ``ttl_s`` seconds (pins.py),
        and ask L3 to keep it as long where the backend can; 409 when pins would hold
        more than hicache_retain_max_share of L2."""
        s = self.scheduler
        keys = self._prompt_keys(prefix, cache_salt)
        try:
            with s.lock:
                pages = s.pins.pin(keys, ttl_s)
                if s.storage is not None:
                    s.retain_in_l3(keys, ttl_s)
        except PinRefused as exc:
            raise Conflict(str(exc)) from exc
        self._wake()  # the workers' L3 retention goes with a step
        return {"pinned_pages": pages, "ttl_s": ttl_s}

    def unpin(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        """End the pin of ``prefix`` now (its pages become evictable), in L3 too."""
        s = self.scheduler
        keys = self._prompt_keys(prefix, cache_salt)
        with s.lock:
            pages = s.pins.unpin(keys)
            if s.storage is not None:
                s.retain_in_l3(keys, 0)
        self._wake()
        return {"unpinned_pages": pages}

    def _prompt_keys(self, prefix: list[int], cache_salt: str | None) -> list[PageKey]:
        """The page keys of a prompt, as its requests get them; 400 for token ids
        the engine's hasher refuses."""
        s = self.scheduler
        try:
            with s.lock:
                return s.prefix_keys(prefix, cache_salt)
        except ValueError as exc:  # token ids out of range
            raise BadRequest(f"prefix: {exc}") from exc

    def _remove_from_l3(self, counts: dict[str, int], l3_op: L3Removal | None,
                        storage: L3Store | None) -> dict[str, int]:
        """Apply a flush's or forget's L3 removal: the scheduler's store, then the
        workers' shards (at the next engine step). A store that cannot remove
        single pages fails the request (400) and the workers are not asked."""
        s = self.scheduler
        counts["l3_pages"] = 0
        if l3_op is None:
            return counts
        queued = False
        try:
            if storage is not None:
                # The scheduler's own instance first (lookups miss from now on),
                # outside the lock: a slow store must not stall the engine.
                try:
                    if isinstance(l3_op, ClearStore):
                        storage.clear()
                        counts["l3_pages"] = -1  # all; the store does not count
                    else:
                        counts["l3_pages"] = storage.delete(
                            [k.hex() for k in l3_op.keys])
                except NotImplementedError as exc:
                    if isinstance(l3_op, ClearStore):
                        raise BadRequest(f"L3 backend {self.storage_name!r} cannot be "
                                         f"flushed ({exc})") from exc
                    raise BadRequest(f"L3 backend {self.storage_name!r} cannot flush a "
                                     f"prefix ({exc}); flush all of L3 instead") from exc
            queued = True
        finally:
            with s.lock:
                if queued:  # every worker drops queued backups of those pages, deletes them
                    s.queue_command(l3_op)
                    s.stats.flushed_l3_pages += max(0, counts["l3_pages"])
                else:
                    s.l3_change_dropped()
            self._wake()
        return counts

    def attach_storage(self, backend: str, extra_config: dict[str, Any]) -> dict[str, Any]:
        from hicache.tiers.l3.factory import STORAGE_BACKENDS

        if backend not in STORAGE_BACKENDS:
            raise BadRequest(f"backend={backend!r}: allowed values {list(STORAGE_BACKENDS)}")
        try:
            instance: StorageBackend = self._build_storage(backend, dict(extra_config))
        except StorageConfigError as exc:
            raise BadRequest(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - unreachable store: the client's problem
            raise BadRequest(f"cannot reach the {backend} store: {exc}") from exc
        s = self.scheduler
        with s.lock:
            old, s.storage = s.storage, instance
            self.storage_name = backend
            s.l3_changed()
            s.queue_command(AttachStore(backend, dict(extra_config)))
        self._wake()
        if old is not None:
            old.close()
        return {"attached": backend, "workers": "at the next engine step"}

    def detach_storage(self) -> dict[str, Any]:
        s = self.scheduler
        with s.lock:
            if s.storage is None:
                raise Conflict("no L3 storage backend is attached")
            old, s.storage = s.storage, None
            name, self.storage_name = self.storage_name, None
            s.l3_changed()
            s.queue_command(DetachStore())
        self._wake()
        old.close()
        return {"detached": name, "workers": "at the next engine step: queued backups are "
                "dropped, running I/O finishes first"}

    def tree(self, prefix: list[int] | None, depth: int) -> dict[str, Any]:
        s = self.scheduler
        with s.lock:
            node: TreeNode | None = s.tree.root
            if prefix:
                keys = s.prefix_keys(prefix)
                node = s.tree.find(keys)
                if node is None:
                    raise NotFound(f"the first {len(keys)} pages of prefix are in "
                                     "neither L2 nor L3 as far as this engine knows")
            assert node is not None
            return {"page_size": s.page_size, "total_pages": s.tree.total_pages(),
                    "l3_pages": s.tree.l3_pages(), "l3_only_pages": s.tree.l3_only_pages(),
                    "node": _node_view(node, depth, time.monotonic())}


MAX_CHILDREN = 32


def _unknown_session(session_id: str) -> str:
    return (f"session_id {session_id!r}: no such session (a session starts with a request "
            "whose kv_transfer_params.hicache.session_id names it; the least recently used "
            "are forgotten beyond the bound)")


def _node_view(node: TreeNode, depth: int, now: float) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": node.id, "pages": len(node.keys),
        "first_key": node.keys[0].hex()[:16] if node.keys else None,
        "in_l2": node.host_slots is not None, "l3_pages": sum(node.in_l3),
        "lock_ref": node.lock_ref, "hits": node.hit_count,
        "idle_s": round(now - node.last_access, 3), "children": len(node.children),
    }
    if depth > 0 and node.children:
        kids = sorted(node.children.values(), key=lambda c: -c.last_access)[:MAX_CHILDREN]
        view["child_nodes"] = [_node_view(c, depth - 1, now) for c in kids]
    return view
