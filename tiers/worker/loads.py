"""L2 -> L1 loads of one step, layer by layer, each page's key checked first.

Contract:
- ``start(loads)`` checks every planned page: a page whose slot does not
  hold the expected key is not loaded, its blocks and every later block of
  that request go to ``load_errors`` (vLLM recomputes them) and the slot to
  ``bad_slots`` (the scheduler drops it). A page whose store is still queued
  (store_queue.py ``owner_of``) is loaded after that store on the same
  copy queue; if that store failed, the load's blocks are load errors.
- The copies run on the layer pipeline: on a CPU in the forward thread
  before the forward pass, one copy of every layer per group; elsewhere
  layer by layer in the background, and ``wait_layer`` (vLLM's
  wait_for_layer_load, before each layer's attention) waits for that
  layer only.
- ``finish()`` (the end of the step) waits for the step's loads, counts
  them or marks every block of them a load error if a copy failed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from hicache.kernels.layer_pipeline import Checkpoint
from hicache.tiers.index.plans import NULL_BLOCK_ID, PagePlan, RequestLoad
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.copies import KVCopies
from hicache.tiers.worker.outcome import StepOutcome
from hicache.tiers.worker.stats import WorkerStats
from hicache.tiers.worker.transfers import PendingStore

logger = logging.getLogger(__name__)


class L2Loads:
    """One step's L2 -> L1 copies (see the module docstring)."""

    def __init__(self, copies: KVCopies, outcome: StepOutcome, stats: WorkerStats,
                 owner_of: Callable[[int], PendingStore | None]) -> None:
        self._copies = copies
        self._outcome = outcome
        self._stats = stats
        self._owner_of = owner_of
        self._clock = copies.new_clock()
        self._blocks: list[int] = []  # this step's blocks being loaded
        self._bytes = 0
        self._mark: Checkpoint | None = None
        # Loads from slots whose store was still queued: (that store, the blocks).
        self._deps: list[tuple[PendingStore, tuple[int, ...]]] = []

    @property
    def active(self) -> bool:
        return bool(self._blocks)

    def start(self, loads: Sequence[RequestLoad]) -> None:
        pool = self._copies.pool
        pages: list[PagePlan] = []
        for load in loads:
            self._outcome.load_errors.update(load.unloadable_block_ids)
            failed = False
            for page in load.pages:
                owner = self._owner_of(page.slot)
                if not failed and owner is not None and owner.keys.get(page.slot) == page.key:
                    # Still being stored: the copy queue runs this load after it.
                    self._deps.append((owner, page.block_ids))
                elif failed or not pool.holds(page.slot, page.key):
                    if not failed:
                        logger.warning(
                            "HiCache: L2 slot %d does not hold the expected page for request "
                            "%s; recomputing from there", page.slot, load.req_id,
                        )
                        self._outcome.bad_slots.add(page.slot)
                    failed = True
                    self._outcome.load_errors.update(page.block_ids)
                    continue
                pages.append(page)
        self._copy(pages)

    def _copy(self, pages: list[PagePlan]) -> None:
        copies = self._copies
        transfer = copies.transfer(pages)
        if not transfer.num_blocks:
            return
        self._blocks = [b for p in pages for b in p.block_ids if b != NULL_BLOCK_ID]
        self._bytes = transfer.num_bytes(copies.block_bytes)
        copy_in = self._clock.wrap(copies.copy_fn("load"))
        pool, layers, pipeline = copies.pool, copies.layers, copies.pipeline
        if pipeline.inline:
            # Before the forward pass, in its thread: one copy of every layer per group.
            for group, rows in enumerate(copies.group_rows):
                if len(transfer.groups[group]):
                    pipeline.submit("load", functools.partial(
                        copy_in, pool.canonical, layers, transfer.groups[group], rows))
        else:
            group_of = copies.group_of_row
            pipeline.start_load(
                lambda row: copy_in(pool.canonical, layers, transfer.groups[group_of[row]],
                                    [row]),
                len(layers))
        self._mark = copies.pipeline.checkpoint()

    def wait_layer(self, layer_name: str) -> None:
        """Return once this layer's planned loads are in vLLM's KV cache."""
        index = self._copies.row_of_layer.get(layer_name)
        if index is not None and self._blocks:
            self._stats.layer_waits += 1
            self._copies.pipeline.wait_layer(index)

    def finish(self) -> None:
        """Wait for the step's copies (and, queued before them, earlier stores)."""
        if not self._blocks:
            return
        assert self._mark is not None
        ok = self._mark.wait()
        failures = self._copies.pipeline.take_failures()
        failed = not ok or any(kind == "load" for kind, _ in failures)
        seconds = self._clock.take_seconds()
        if failed:
            self._outcome.load_errors.update(self._blocks)
        else:
            if seconds is not None:
                self._stats.observe(K.L2_LOAD_SECONDS, seconds)
            self._stats.loaded_blocks += len(self._blocks)
            self._stats.loaded_bytes += self._bytes
        for store, block_ids in self._deps:
            if store.mark is not None:
                store.mark.wait()  # done already: queued before the load
            if store.failed:  # it copied a slot its store did not fill
                self._outcome.load_errors.update(block_ids)
        self._blocks, self._deps, self._mark = [], [], None
