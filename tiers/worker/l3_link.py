"""One rank's link to L3: the backend and its I/O thread, attached and detached at run time.

Contract:
- ``start(pool, load_fetched, yield_to_forward, helper_cpus)`` binds the link
  to this rank's pool and the worker's L2 -> L1 copy of fetched pages, builds
  this rank's backend from the current spec, registers the pool with it
  (zero-copy slots) and starts the I/O thread (tiers/worker/l3_io.py;
  ``yield_to_forward``: its backups wait for the gaps between forward passes,
  which ``forward_started`` and ``forward_ended`` mark; ``helper_cpus``: where
  its threads run, and the backend is built there, so that the threads its
  client starts run there too). An attach command later builds with the same pool, copy
  and placement. A backend that cannot start leaves the
  rank without L3 (logged, False): its fetches fail and vLLM recomputes.
- ``apply(command)`` runs one admin storage command
  (tiers/index/commands.py) on this rank: retention and deletions go to the
  I/O thread when this rank writes L3 (``writer``; MLA: rank 0 only, the
  pages being the same on every rank); attach / detach replace the backend.
  A failing command is logged, never raised into the engine. ``changes``
  counts the L3-changing ones applied (``L3_CHANGES``, failed or not): the
  worker reports it with the backups stored (``take_backed_up``), so the
  scheduler drops what a change the rank had not applied yet removed.
- ``detach()`` drops queued backups, finishes the running I/O and closes
  the backend. Fetches it cancelled are kept for ``take_retired`` (their
  requests still wait in vLLM), and its counters are added to the totals,
  so ``counters()`` never goes back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hicache.tiers.host_cpus import running_on
from hicache.tiers.index.commands import (
    L3_CHANGES,
    AttachStore,
    CancelFetches,
    ClearStore,
    DeletePages,
    RetainPages,
)
from hicache.tiers.index.plans import PagePlan
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import StorageBackend
from hicache.tiers.l3.guard import GuardedBackend, guarded
from hicache.tiers.metrics import WorkerGauge as G
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.l3_io import StorageIO
from hicache.tiers.worker.l3_jobs import FetchResult

logger = logging.getLogger(__name__)

StorageBuilder = Callable[[str, dict[str, Any]], StorageBackend]


class L3Link:
    """This rank's L3 backend and I/O thread, or none (see the module docstring)."""

    def __init__(self, builder: StorageBuilder | None, spec: tuple[str, dict] | None,
                 writer: bool = True) -> None:
        self.builder = builder
        # (backend name, extra config) to build at start; None: no L3.
        self.spec = spec if builder is not None else None
        self.writer = writer
        self.backend: GuardedBackend | None = None
        self.io: StorageIO | None = None
        self._retired: list[FetchResult] = []
        self._retired_counters: dict[str, float] = {}
        # What start() bound: the pool and the worker's copy of fetched pages.
        self._pool: HostPagePool | None = None
        self._load_fetched: Callable[[list[PagePlan]], Any] | None = None
        self._yield_to_forward = False
        self._helper_cpus: frozenset[int] = frozenset()
        self.changes = 0  # L3-changing commands applied

    @property
    def writes(self) -> bool:
        """Whether this rank backs pages up to L3 now."""
        return self.io is not None and self.writer

    def start(self, pool: HostPagePool, load_fetched: Callable[[list[PagePlan]], Any],
              yield_to_forward: bool | None = None,
              helper_cpus: frozenset[int] | None = None) -> bool:
        self._pool, self._load_fetched = pool, load_fetched
        if yield_to_forward is not None:
            self._yield_to_forward = yield_to_forward
        if helper_cpus is not None:
            self._helper_cpus = helper_cpus
        if self.spec is None or self.builder is None:
            return False
        try:
            with running_on(self._helper_cpus):  # threads a client starts inherit them
                backend = guarded(self.builder(*self.spec))
                backend.register_host_pool(pool)
        except Exception:  # noqa: BLE001 - an unreachable L3 degrades to recompute
            logger.exception("HiCache: L3 backend unavailable on this rank; continuing "
                             "without L3 (its hits will be recomputed)")
            return False
        self.backend = backend
        self.io = StorageIO(backend, pool, load_fetched,
                            yield_to_forward=self._yield_to_forward,
                            helper_cpus=self._helper_cpus)
        return True

    def forward_started(self) -> None:
        if self.io is not None:
            self.io.forward_started()

    def forward_ended(self) -> None:
        if self.io is not None:
            self.io.forward_ended()

    def apply(self, command: object) -> None:
        self.changes += isinstance(command, L3_CHANGES)
        if isinstance(command, CancelFetches):
            if self.io is not None:
                self.io.cancel_fetches(set(command.fetch_ids))
            return
        if isinstance(command, RetainPages):
            if self.writes:
                assert self.io is not None
                self.io.submit_retention(list(command.keys), command.until)
            return
        if isinstance(command, (DeletePages, ClearStore)):
            if self.writes:
                assert self.io is not None
                self.io.submit_removal(
                    list(command.keys) if isinstance(command, DeletePages) else None)
            return
        try:
            if self._pool is None or self._load_fetched is None:
                raise RuntimeError("an L3 command before the worker registered its KV cache")
            self.detach()
            self.spec = None
            if isinstance(command, AttachStore) and self.builder is not None:
                self.spec = (command.backend, dict(command.extra_config))
                self.start(self._pool, self._load_fetched)
        except Exception:  # noqa: BLE001 - an admin command never kills the engine
            logger.exception("HiCache: storage command %s failed on this rank",
                             type(command).__name__)

    def detach(self) -> None:
        if self.io is not None:
            self.io.cancel_backups()
            self.io.shutdown()  # queued fetches end at once (cancelled)
            self._retired.extend(self.io.poll())
            for name, value in self._live_counters().items():
                self._retired_counters[name] = self._retired_counters.get(name, 0) + value
        if self.backend is not None:
            self.backend.close()
        self.backend, self.io = None, None

    def take_results(self, wait_s: float = 0.0) -> tuple[list[FetchResult], bool]:
        """Finished fetches (those a detach cancelled first), and whether waiting up
        to ``wait_s`` for one saw it finish."""
        results, self._retired = self._retired, []
        waited = self.io is not None and wait_s > 0 and self.io.wait_results(wait_s)
        if self.io is not None:
            results.extend(self.io.poll())
        return results, waited

    def take_backed_up(self) -> list[bytes]:
        return self.io.take_backed_up() if self.writes and self.io is not None else []

    def counters(self) -> dict[str, float]:
        """L3 counters of every backend attached since start."""
        out = dict(self._retired_counters)
        for name, value in self._live_counters().items():
            out[name] = self._retired_counters.get(name, 0) + value
        return out

    def gauges(self) -> dict[str, float]:
        """Queue depths, and whether this rank's L3 breaker is open (1) or not (0)."""
        fetches, backups = self.io.queue_depths() if self.io else (0, 0)
        down = self.backend is not None and not self.backend.reachable
        return {G.L3_FETCH_QUEUE: fetches, G.L3_BACKUP_QUEUE_PAGES: backups,
                G.L3_BREAKER_OPEN: float(down)}

    def shutdown(self) -> None:
        if self.io is not None:
            self.io.shutdown()
        if self.backend is not None:
            self.backend.close()

    def _live_counters(self) -> dict[str, float]:
        if self.io is None or self.backend is None:
            return {}
        io, backend = self.io.stats, self.backend.stats()
        return {
            K.L3_FETCHED_PAGES: io.fetched_pages,
            K.L3_FETCH_FAILED_PAGES: io.fetch_failed_pages,
            K.L3_FETCH_LATE_PAGES: io.fetch_late_pages,
            K.L3_FETCH_DEADLINE_MISSES: io.fetch_deadline_misses,
            K.L3_BACKUP_PAGES: io.backup_pages,
            K.L3_BACKUP_FAILED_PAGES: io.backup_failed_pages,
            K.L3_BYTES_READ: backend.bytes_read, K.L3_BYTES_WRITTEN: backend.bytes_written,
            K.L3_CORRUPT_PAGES: backend.corrupt_pages, K.L3_ERRORS: backend.errors,
            K.L3_REFUSED_CALLS: backend.refused_calls,
            K.L3_PAGES_IN_PLACE: backend.pages_in_place,
            K.L3_FLUSHED_PAGES: io.deleted_pages, K.L3_RETAINED_PAGES: io.retained_pages,
        }
