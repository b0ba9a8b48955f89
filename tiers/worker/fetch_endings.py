"""How a step's fetches end: an L2 hit served at once, an L3 fetch finished, a fetch failed.

Contract:
- A fetch with no L3 pages (an asynchronous L2 hit, which every hit is with
  several KV-cache groups) is served at once (``serve_from_l2``): vLLM does
  not run the request in this step, and it is reported received at the
  step's end. A page whose slot does not hold its key ends the copy there:
  that slot is bad, the rest of the request's blocks are recomputed.
- ``on_results`` takes the L3 I/O thread's finished fetches
  (tiers/worker/l3_io.py): the pages that arrived are already in vLLM's
  blocks, the rest are recomputed.
- A prefetch (a request vLLM has not admitted, ``RequestFetch.prefetch``)
  stops in L2: its page count goes to the scheduler, nothing to vLLM.
- A fetch that cannot run (no L3 on this rank) fails whole (``fail``).
- Failed blocks of a request whose hit was asynchronous go to vLLM as block
  ids (``load_errors``), or, with several KV-cache groups, where vLLM cannot
  map block ids to requests, as the request's id (``failed_recv``): vLLM
  then recomputes that request.
"""

from __future__ import annotations

import logging

from hicache.tiers.index.plans import NULL_BLOCK_ID, PagePlan, RequestFetch
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.copies import KVCopies
from hicache.tiers.worker.l3_jobs import FetchResult
from hicache.tiers.worker.outcome import StepOutcome
from hicache.tiers.worker.stats import WorkerStats

logger = logging.getLogger(__name__)


class FetchEndings:
    """Ends this rank's fetches (see the module docstring)."""

    def __init__(self, copies: KVCopies, outcome: StepOutcome, stats: WorkerStats, *,
                 per_request_failures: bool) -> None:
        self._copies = copies
        self._outcome = outcome
        self._stats = stats
        self.per_request_failures = per_request_failures

    def serve_from_l2(self, fetch: RequestFetch) -> None:
        """An asynchronous hit that L2 holds whole: copy it now."""
        pool = self._copies.pool
        errors = set(fetch.unloadable_block_ids)
        pages: list[PagePlan] = []
        for i, page in enumerate(fetch.l2_pages):
            if not pool.holds(page.slot, page.key):
                logger.warning("HiCache: L2 slot %d does not hold the expected page for "
                               "request %s; recomputing it", page.slot, fetch.req_id)
                self._outcome.bad_slots.add(page.slot)
                errors.update(b for p in fetch.l2_pages[i:] for b in p.block_ids)
                break
            pages.append(page)
        if pages:
            try:
                transfer = self._copies.load_pages(pages)
                self._stats.loaded_blocks += transfer.num_blocks
                self._stats.loaded_bytes += transfer.num_bytes(self._copies.block_bytes)
            except Exception:  # noqa: BLE001 - recompute instead
                logger.exception("HiCache: L2 -> L1 copy of request %s failed", fetch.req_id)
                errors.update(b for p in pages for b in p.block_ids)
        self._end(fetch.req_id, 0, errors)

    def fail(self, fetch: RequestFetch) -> None:
        if fetch.prefetch:  # nothing for vLLM: the scheduler frees the slots
            self._outcome.fetched[fetch.req_id] = [0]
            return
        errors = set(fetch.unloadable_block_ids)
        for page in (*fetch.l2_pages, *fetch.l3_pages):
            errors.update(page.block_ids)
        self._end(fetch.req_id, 0, errors)

    def on_results(self, results: list[FetchResult]) -> None:
        for result in results:
            self._stats.observe(K.L3_FETCH_SECONDS, result.seconds)
            if result.prefetch:  # L3 -> L2 for a request vLLM has not admitted
                self._outcome.fetched[result.req_id] = [result.fetched_pages]
                continue
            self._end(result.req_id, result.fetched_pages, set(result.error_block_ids))

    def _end(self, req_id: str, fetched: int, errors: set[int]) -> None:
        """A fetch ended with ``fetched`` L3 pages in L2; ``errors``: blocks not filled."""
        errors.discard(NULL_BLOCK_ID)
        self._outcome.fetched[req_id] = [fetched]
        self._outcome.received.add(req_id)
        if not errors:
            return
        if self.per_request_failures:
            self._outcome.failed_recv.add(req_id)
            self._stats.load_errors += len(errors)
        else:
            self._outcome.load_errors.update(errors)
