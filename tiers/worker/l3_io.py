"""Worker-side L3 I/O: one thread fetches L3 pages for waiting requests and backs up new L2 pages.

See DESIGN.md "Processes and threads".

Contract:
- ``submit_fetch(fetch)``: L3 pages are read into their reserved L2 slots
  in order, in batches (``BATCH_PAGES`` pages; at least ``TIMED_BATCH_BYTES``
  for backends with ``capabilities.timed``, which stop at the deadline inside a
  batch), until one fails, the fetch's deadline passes
  (``timeout_s`` from submission; None = no deadline; 0 = best effort: stop
  at the second ``poll`` after submission, i.e. after about one engine
  step) or the store errs. Then every page of the plan that is in L2 (its
  L2 pages whose slots still hold their keys, then the fetched L3 pages) is
  copied into the request's vLLM blocks, on this thread. ``poll`` returns
  finished fetches as ``FetchResult``: how many L3 pages arrived (a prefix)
  and the blocks that were not filled, for vLLM to recompute. A prefetch
  (``RequestFetch.prefetch``, a request not admitted yet) stops in L2.
- ``submit_backup(pages)``: (page key, slot, L3 key) triples just written to
  L2 are copied to L3 under the L3 key (the page key, or the key of its
  body, see tiers/index/page_keys.py ``body_key``) in the background
  (``write``), after pending fetches. A fetched page is read from
  its plan's ``l3_key`` when it has one.
- Span objects (tiers/index/spans.py), where the backend has
  ``capabilities.spans``: a backup's pages whose span is there whole are
  stored as span objects (a ``WriteBatch`` with spans) and the rest, or what
  that did not store, page by page; a fetch reads the pages that name a span
  from it (a ``ReadBatch`` with spans) and the others, or what the span lacked, from
  their page objects. A page counts as stored and fetched either way.
  A slot must not be overwritten while its backup reads it: the worker
  calls ``release_slots`` before writing to L2 slots, which drops queued
  backups of those slots and waits for a running one (bounded by the
  backend's own timeouts). Without this a backup could store another
  page's bytes, with a valid checksum, under this page's key.
  ``take_backed_up()`` returns the L3 keys stored since the last call, for
  the scheduler's tree (``WorkerReport.l3_stored``), but none while a
  removal waits: when it starts it forgets those it deletes.
- ``submit_removal(keys)`` (admin flush): drops queued backups of those
  pages and deletes them from this rank's store after the backup already
  running, so a flushed page is not written back later.
- ``submit_retention(keys, until)`` (a request's ``retain_s``, an admin pin):
  the backend's ``retain``, in order with removals, counted in
  ``stats.retained_pages``.
- Its threads run on ``helper_cpus`` (helper_cpus.py; empty: where started).
- Fetches run first, then removals, then backups; a fetch never waits for
  the backup queue. With ``yield_to_forward`` (a CPU engine whose forward
  pass shares its cores with these threads: OpenMP threads stall at each
  barrier for one taken away), no backup starts between ``forward_started()`` and
  ``forward_ended()`` (the worker's step hooks; tiers/worker/forward_gate.py)
  unless the pass has run for ``max_defer_s``: backups run in the gaps
  between forward passes. A step's backup is written ``GATED_BACKUP_PAGES``
  pages at a time (whole span objects, l3_jobs.py ``split_backup``) and the
  gate is asked again before each part, so a slow store overruns into a pass
  by one part at most; the part already running finishes (it may hold slots
  ``release_slots`` waits for). Fetches and removals never wait for the gate.
  With a backend that allows concurrent reads
  (``capabilities.concurrent_io``), up to ``FETCH_THREADS`` fetches run at once (helper
  threads take fetches only, each after any running backup of its slots),
  so the prefetches of many queued requests overlap their store latency.
- Nothing raises into the engine: the backend's guard (tiers/l3/guard.py)
  turns a failing store into misses; a job that raises anyway (a bug on this
  side) is logged and ends as a failed fetch (its blocks recompute) or a
  backup that stored nothing.
- ``wait_backups(timeout_s)``: blocks until every backup handed over is done
  (tests and shutdown-minded callers; not on the engine's path).
- ``wait_fetches(timeout_s)``: blocks until every fetch handed over has a
  result (True) or ``timeout_s`` passed; for tests and tools that read the
  counters once a burst is over (a fetch counts when it ends).
- ``wait_results(timeout_s)`` blocks the caller, the GIL released, until a
  submitted fetch has finished or the timeout passed. The worker calls it
  at the end of an engine step in which nothing computes (``IDLE_WAIT_S``):
  vLLM would otherwise run its step loop back to back in Python while the
  request waits for this fetch, and a thread that keeps the GIL busy makes
  this one wait up to the interpreter's switch interval (5 ms) for the GIL
  after every system call (docs/gpu.md). With no fetch pending it waits the
  same way for the backups queued or running (an idle engine that steps for
  the L3 catch-up, tiers/controller/catch_up.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from hicache.tiers.host_cpus import pin_current_thread
from hicache.tiers.index.plans import PagePlan, RequestFetch
from hicache.tiers.index.spans import SpanRef
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3.base import ReadBatch, StorageBackend, WriteBatch
from hicache.tiers.worker import l3_jobs
from hicache.tiers.worker.forward_gate import MAX_DEFER_S, ForwardGate
from hicache.tiers.worker.l3_jobs import Backup, FetchResult, Job, Retention, StorageIOStats

logger = logging.getLogger(__name__)

BATCH_PAGES = 32
# Backends with timed batches (``Capabilities.timed``: the batch runs without the GIL
# and stops at the fetch's deadline itself) get batches of at least this many bytes:
# each batch costs the thread one GIL hand-back beside vLLM's busy loop
# (docs/benchmarks-l3.md, integration/bench/micro/l3_fetch.py).
TIMED_BATCH_BYTES = 128 << 20
# Threads that read fetches when the backend allows concurrent reads
# (``Capabilities.concurrent_io``): the I/O thread plus helpers.
FETCH_THREADS = 4
# Longest an idle engine step waits for a fetch: bounds how late the engine
# notices a new request arriving meanwhile.
IDLE_WAIT_S = 0.005
# Pages of a backup written between two looks at the forward gate (``yield_to_forward``):
# at most one such part runs on into a pass (docs/benchmarks-trace.md).
GATED_BACKUP_PAGES = 8


class StorageIO:
    """The L3 I/O thread of one worker; see the module docstring."""

    def __init__(
        self,
        backend: StorageBackend,
        pool: HostPagePool,
        load_pages: Callable[[list[PagePlan]], object],
        fetch_threads: int = FETCH_THREADS,
        yield_to_forward: bool = False,
        max_defer_s: float = MAX_DEFER_S,
        helper_cpus: frozenset[int] = frozenset(),
    ) -> None:
        self.backend = backend
        self.pool = pool
        self._load_pages = load_pages
        self.stats = StorageIOStats()
        self._cv = threading.Condition()
        self.gate = ForwardGate(self._cv, yield_to_forward, max_defer_s)
        self._fetch_q: deque[Job] = deque()
        self._backup_q: deque[list[Backup]] = deque()
        self._running_backup: set[int] = set()
        # Removals (keys, None = all) and retentions, in the order submitted.
        self._removals: deque[list[bytes] | Retention | None] = deque()
        self._jobs: list[Job] = []  # submitted, not yet returned by poll
        self._backed_up: list[bytes] = []  # L3 keys stored, not yet taken
        self._stopping = False
        self.helper_cpus = helper_cpus  # where its threads run (empty: where started)
        self._thread = threading.Thread(target=self._run, name="hicache-l3", daemon=True)
        self._thread.start()
        helpers = fetch_threads - 1 if backend.capabilities.concurrent_io else 0
        self._helpers = [threading.Thread(target=self._run_fetches, daemon=True,
                                          name=f"hicache-l3-fetch-{i}")
                         for i in range(max(0, helpers))]
        for helper in self._helpers:
            helper.start()

    # ---- called by the worker (engine thread) ----------------------------------

    def submit_fetch(self, fetch: RequestFetch) -> None:
        job = Job(fetch, time.monotonic(), slots={p.slot for p in fetch.l3_pages})
        with self._cv:
            self._drop_backups(lambda _, s: s in job.slots)
            self._jobs.append(job)
            self._fetch_q.append(job)
            self._cv.notify_all()

    def submit_backup(self, pages: list[tuple[bytes, int, bytes]],
                      spans: Sequence[SpanRef | None] | None = None) -> None:
        """``spans``: each page's span object (tiers/index/spans.py), if any."""
        if not pages:
            return
        places = list(spans) if spans is not None else [None] * len(pages)
        with self._cv:
            self._backup_q.append([(k, s, at, span) for (k, s, at), span
                                   in zip(pages, places, strict=True)])
            self._cv.notify_all()

    def forward_started(self) -> None:
        """A forward pass begins: backups wait for its end (``yield_to_forward``)."""
        self.gate.started()

    def forward_ended(self) -> None:
        """The forward pass is over: queued backups may run."""
        self.gate.ended()

    def release_slots(self, slots: Iterable[int]) -> None:
        """Make ``slots`` safe to overwrite: drop queued backups of them, wait for a running one."""
        wanted = set(slots)
        with self._cv:
            self._drop_backups(lambda _, s: s in wanted)
            while self._running_backup & wanted:
                self._cv.wait()

    def cancel_fetches(self, fetch_ids: set[str]) -> int:
        """Stop these fetches' reads after the batch in flight (a queued one reads
        nothing); each still ends with a result. Returns how many were found."""
        with self._cv:
            found = [j for j in self._jobs if j.fetch.req_id in fetch_ids]
            for job in found:
                job.cancel = True
            self._cv.notify_all()
        return len(found)

    def poll(self) -> list[FetchResult]:
        done: list[FetchResult] = []
        with self._cv:
            for job in self._jobs:
                job.polls += 1
                if job.fetch.timeout_s == 0 and job.polls >= 2:
                    job.cancel = True
            for job in [j for j in self._jobs if j.result is not None]:
                self._jobs.remove(job)
                done.append(job.result)  # type: ignore[arg-type]
        return done

    def take_backed_up(self) -> list[bytes]:
        """L3 keys whose backups succeeded since the last call; none while a removal
        waits (what it deletes must not be reported stored after it was asked for)."""
        with self._cv:
            if any(not isinstance(r, Retention) for r in self._removals):
                return []
            done, self._backed_up = self._backed_up, []
        return done

    def wait_results(self, timeout_s: float) -> bool:
        """Until a submitted fetch has a result (True) or ``timeout_s`` passed (False);
        with no fetch pending, until the backups queued or running are done, a fetch
        arrives or ``timeout_s`` passed (False); see the module docstring."""
        with self._cv:
            if self._jobs:
                return self._cv.wait_for(
                    lambda: any(j.result is not None for j in self._jobs), timeout_s)
            self._cv.wait_for(lambda: bool(self._jobs) or not (
                self._backup_q or self._running_backup), timeout_s)
            return False

    def wait_fetches(self, timeout_s: float) -> bool:
        """Until every submitted fetch has a result (True) or ``timeout_s`` passed."""
        with self._cv:
            return self._cv.wait_for(
                lambda: all(j.result is not None for j in self._jobs), timeout_s)

    def submit_removal(self, keys: list[bytes] | None) -> None:
        """Delete pages from L3 (None = everything) after any running backup, and
        drop the queued backups of those pages (or all), so none lands later."""
        with self._cv:
            wanted = None if keys is None else set(keys)
            self._drop_backups(lambda k, _: wanted is None or k in wanted)
            self._removals.append(keys)
            self._cv.notify_all()

    def submit_retention(self, keys: list[bytes], until: float) -> None:
        """Ask the backend to keep ``keys`` until ``until`` (epoch seconds; 0 ends it),
        in order with removals, ahead of queued backups (the backend keeps names, so
        pages backed up later are covered too)."""
        with self._cv:
            self._removals.append(Retention(keys, until))
            self._cv.notify_all()

    def cancel_backups(self) -> None:
        """Forget every queued backup (detaching the store)."""
        with self._cv:
            self._drop_backups(lambda _k, _s: True)

    def wait_backups(self, timeout_s: float) -> bool:
        """Until no backup is queued or running (True), or ``timeout_s`` passed."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not self._backup_q and not self._running_backup, timeout_s)

    def queue_depths(self) -> tuple[int, int]:
        with self._cv:
            return len(self._fetch_q), sum(len(b) for b in self._backup_q)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish queued backups (within ``timeout_s``), cancel fetches, stop the thread."""
        with self._cv:
            self._stopping = True
            for job in self._jobs:
                job.cancel = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        for helper in self._helpers:
            helper.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("HiCache L3: backups still running after %.0f s at shutdown", timeout_s)

    # ---- the I/O thread --------------------------------------------------------

    def _drop_backups(self, drop: Callable[[bytes, int], bool]) -> None:
        """Remove queued (page key, slot) backups for which ``drop`` is true; caller holds _cv."""
        kept: deque[list[Backup]] = deque()
        for batch in self._backup_q:
            rest = [b for b in batch if not drop(b[0], b[1])]
            self.stats.backups_dropped += len(batch) - len(rest)
            if rest:
                kept.append(rest)
        self._backup_q = kept

    def _run(self) -> None:
        pin_current_thread(self.helper_cpus)
        while True:
            with self._cv:
                while not (self._fetch_q or self._removals or self._stopping):
                    if not self._backup_q:
                        self._cv.wait()
                        continue
                    wait_s = self.gate.wait_s(self._stopping)
                    if wait_s <= 0:
                        break
                    self._cv.wait(wait_s)
                removal: list[bytes] | Retention | None | bool = False
                if self._fetch_q:
                    job: Job | None = self._fetch_q.popleft()
                    backup = None
                elif self._removals:
                    job, backup, removal = None, None, self._removals.popleft()
                    if not isinstance(removal, Retention):
                        # Stored before this removal, then deleted: not in L3.
                        wanted = None if removal is None else set(removal)
                        self._backed_up = [k for k in self._backed_up
                                           if wanted is not None and k not in wanted]
                elif self._backup_q:  # the wait above let it through the gate
                    job, backup = None, self._backup_q.popleft()
                    if self.gate.enabled:  # the rest waits for the gate again
                        backup, rest = l3_jobs.split_backup(backup, GATED_BACKUP_PAGES)
                        if rest:
                            self._backup_q.appendleft(rest)
                    self._running_backup = {b[1] for b in backup}
                else:
                    return  # stopping, nothing left
            try:
                if job is not None:
                    self._fetch_safely(job)
                elif isinstance(removal, Retention):
                    self._retain(removal)
                elif removal is not False:
                    self._remove(removal)  # type: ignore[arg-type]
                else:
                    self._backup(backup or [])
            except Exception:  # noqa: BLE001 - a bug here never stops the thread
                logger.exception("HiCache L3: an L3 job failed on this rank")
            finally:
                with self._cv:
                    self._running_backup = set()
                    self._cv.notify_all()

    def _run_fetches(self) -> None:
        """A helper: fetches only, beside the I/O thread (``concurrent_io`` backends)."""
        pin_current_thread(self.helper_cpus)
        while True:
            with self._cv:
                while not (self._fetch_q or self._stopping):
                    self._cv.wait()
                if not self._fetch_q:
                    return  # stopping
                job = self._fetch_q.popleft()
                # Its slots may have held pages a running backup still reads.
                while self._running_backup & job.slots:
                    self._cv.wait()
            try:
                self._fetch_safely(job)
            finally:
                with self._cv:
                    self._cv.notify_all()

    def _retain(self, retention: Retention) -> None:
        self.stats.retained_pages += self.backend.retain(
            [k.hex() for k in retention.keys], retention.until)

    def _remove(self, keys: list[bytes] | None) -> None:
        if keys is None:
            self.backend.clear()
        else:
            self.stats.deleted_pages += self.backend.delete([k.hex() for k in keys])

    def _batch_pages(self) -> int:
        """Pages per backend call (see ``TIMED_BATCH_BYTES``)."""
        if not self.backend.capabilities.timed:
            return BATCH_PAGES
        return max(BATCH_PAGES, TIMED_BATCH_BYTES // max(1, self.pool.geometry.page_bytes))

    def _backup(self, pages: list[Backup]) -> None:
        per = self._batch_pages()
        # A slot may have been reused since (dropped backups cover queued ones; this
        # covers a key the worker invalidated meanwhile).
        pages = [b for b in pages if self.pool.holds(b[1], b[0])]
        spans = l3_jobs.whole_spans(pages) if self.backend.capabilities.spans else []
        if spans:  # span objects first; what they did not store goes page by page
            done = self._set(spans, [b[3] for b in spans])  # type: ignore[misc]
            pages = [b for b in pages if b[3] is None or b[2] not in done]
        for i in range(0, len(pages), per):
            self._set(pages[i : i + per], None)

    def _set(self, batch: list[Backup], spans: list[SpanRef] | None) -> set[bytes]:
        """Store ``batch`` (as span objects where ``spans``); the L3 keys stored."""
        if not batch:
            return set()
        ok = self.backend.write(WriteBatch([b[2].hex() for b in batch], [b[1] for b in batch],
                                           spans))
        stored = [b[2] for b, x in zip(batch, ok, strict=True) if x]
        with self._cv:
            self._backed_up.extend(stored)
        self.stats.backup_pages += len(stored)
        if spans is None:
            self.stats.backup_failed_pages += len(batch) - len(stored)
        return set(stored)

    def _get(self, batch: list[PagePlan], deadline: float | None) -> list[bool]:
        """Read ``batch`` into its slots: from span objects where the pages have one,
        then, for what those lacked, from page objects."""
        ok = [False] * len(batch)
        # A backend that does not stop at the deadline inside a batch gets none: this
        # thread checks it between batches.
        deadline = deadline if self.backend.capabilities.timed else None
        spanned = ([i for i, p in enumerate(batch) if p.span is not None]
                   if self.backend.capabilities.spans else [])
        for spans in ((True, False) if spanned else (False,)):
            todo = spanned if spans else [i for i, x in enumerate(ok) if not x]
            if not todo:
                continue
            got = self.backend.read(ReadBatch(
                [(batch[i].l3_key or batch[i].key).hex() for i in todo],
                [batch[i].slot for i in todo],
                [batch[i].span for i in todo] if spans else None,  # type: ignore[misc]
                deadline))
            for i, x in zip(todo, got, strict=True):
                ok[i] = x
        return ok

    def _fetch_safely(self, job: Job) -> None:
        """``_fetch``; a fetch that raised (a bug on this side) ends failed, so its
        request recomputes instead of waiting for ever."""
        try:
            self._fetch(job)
        except Exception:  # noqa: BLE001 - the request recomputes
            logger.exception("HiCache L3: fetch of %s failed on this rank", job.fetch.req_id)
            fetch = job.fetch
            blocks = set(fetch.unloadable_block_ids)
            for page in [*fetch.l2_pages, *fetch.l3_pages]:
                blocks.update(page.block_ids)
            with self._cv:
                self.stats.fetches += 1
                self.stats.fetch_failed_pages += len(fetch.l3_pages)
                job.result = FetchResult(fetch.req_id, 0, blocks,
                                         time.monotonic() - job.submitted, fetch.prefetch)

    def _fetch(self, job: Job) -> None:
        fetch = job.fetch
        deadline = None if fetch.timeout_s is None else job.submitted + fetch.timeout_s
        errors: set[int] = set(fetch.unloadable_block_ids)
        loadable: list[PagePlan] = []
        failed = False
        for page in fetch.l2_pages:
            if failed or not self.pool.holds(page.slot, page.key):
                failed = True
                errors.update(page.block_ids)
            else:
                loadable.append(page)
        fetched = missed = 0
        pages = list(fetch.l3_pages)
        per = self._batch_pages()
        if deadline is not None and fetch.timeout_s == 0:
            deadline = None  # best effort: cancelled by poll, not by a clock
        while not failed and fetched < len(pages):
            if job.cancel or (deadline is not None and time.monotonic() > deadline):
                missed = 1
                break
            batch = pages[fetched : fetched + per]
            for page in batch:
                self.pool.set_key(page.slot, None)
            ok = self._get(batch, deadline)
            n = 0
            while n < len(batch) and ok[n]:
                self.pool.set_key(batch[n].slot, batch[n].key)
                n += 1
            fetched += n
            if n < len(batch):
                # A timed batch stops at the deadline by itself.
                missed = int(deadline is not None and time.monotonic() > deadline)
                break
        for page in pages[fetched:]:
            errors.update(page.block_ids)
        loadable.extend(pages[:fetched])
        if loadable and not fetch.prefetch:
            try:
                self._load_pages(loadable)
            except Exception:  # noqa: BLE001 - recompute instead
                logger.exception("HiCache: L2 -> L1 copy of a fetched prefix failed")
                for page in loadable:
                    errors.update(page.block_ids)
        result = FetchResult(fetch.req_id, fetched, errors, time.monotonic() - job.submitted,
                             fetch.prefetch)
        with self._cv:  # fetches may finish on several threads
            self.stats.fetches += 1
            self.stats.fetched_pages += fetched
            if missed or job.cancel:
                self.stats.fetch_late_pages += len(pages) - fetched
            else:
                self.stats.fetch_failed_pages += len(pages) - fetched
            self.stats.fetch_deadline_misses += missed
            job.result = result
