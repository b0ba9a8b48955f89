"""L1 -> L2 stores of each step, from the copy queue to published slot keys and L3 backups.

Contract:
- A step's stores are one ``PendingStore`` (transfers.py), built once per
  plan (``store_of``): its slots' keys are cleared until it lands, and
  queued L3 backups of those slots are dropped first (worker/l3_io.py
  ``release_slots``). ``save_layer`` copies a layer's share as soon as that
  layer's attention has run, when the share is big enough
  (copies.py ``PER_LAYER_SAVE_MIN_BYTES``); ``finish`` queues the rest.
- Stores across steps (``async_stores``; off for sliding-window and Mamba
  groups, whose blocks vLLM frees or overwrites while the request runs)
  are finished in plan order without blocking (``settle``). Only then are
  their slot keys recorded, their L3 backups queued, their finished
  requests released (vLLM's finished_sending) and ``done_seq`` advanced.
  Waits happen only where the copy queue does not order things: more than
  ``MAX_STORE_STEPS_IN_FLIGHT`` steps queued, a preempted request's stores
  (``flush_stores``), an L3 read into or a fetch out of a slot being stored
  (``wait_into``), an L3 deletion (its pages must not be backed up after
  it: ``settle_all``). Each is counted in ``store_waits``. Without
  ``async_stores`` every step waits for its stores.
- A small store on a CPU, in a step that waits for its stores anyway, is
  copied in the calling thread (``INLINE_STORE_MAX_BYTES``).
- Where the L3 backend reuses the pool's checksums (Mooncake), a CPU
  store's pages are checksummed right after their copy, on the copy thread.
- A failed copy marks its slots bad (the scheduler drops them); it never
  raises.
"""

from __future__ import annotations

import logging
from collections import deque

from hicache.kernels.block_copy import BlockTransfer
from hicache.kernels.layer_pipeline import Checkpoint
from hicache.tiers.index.plans import PagePlan, StepPlan
from hicache.tiers.l3 import native_io
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.copies import KVCopies
from hicache.tiers.worker.l3_link import L3Link
from hicache.tiers.worker.outcome import StepOutcome
from hicache.tiers.worker.stats import WorkerStats
from hicache.tiers.worker.transfers import PendingStore, l3_keys

logger = logging.getLogger(__name__)

# Steps whose stores may be queued at once; a step beyond waits for the oldest.
MAX_STORE_STEPS_IN_FLIGHT = 4
# On a CPU, when each step waits for its stores, a step's store below this many bytes
# (all layers) is copied in the calling thread when the copy thread is idle: handing a
# few KiB to the thread and waiting for it costs more than the copy (a pool submit, a
# future, a condition wait).
INLINE_STORE_MAX_BYTES = 1 << 20


class StoreQueue:
    """The stores in flight and their publication (see the module docstring)."""

    def __init__(self, copies: KVCopies, l3: L3Link, outcome: StepOutcome,
                 stats: WorkerStats, *, async_stores: bool) -> None:
        self._copies = copies
        self._l3 = l3
        self._outcome = outcome
        self._stats = stats
        self.async_stores = async_stores
        # Queued in plan order; slot -> the last store into it.
        self.pending: deque[PendingStore] = deque()
        self._slot_owner: dict[int, PendingStore] = {}
        self._queued = 0  # stores queued since start; PendingStore.order
        # This step's: its store, and the layers already saved during the forward pass.
        self._storing: PendingStore | None = None
        self._saved_layers: set[int] = set()

    def owner_of(self, slot: int) -> PendingStore | None:
        """The store in flight into ``slot``, if any."""
        return self._slot_owner.get(slot)

    def save_layer(self, layer_name: str, meta: StepPlan) -> None:
        """This layer's KV is final for the step: copy its planned stores while later
        layers compute (unless small: one copy of every layer at the end costs less)."""
        copies = self._copies
        index = copies.row_of_layer.get(layer_name)
        if (not meta.stores or index is None or index in self._saved_layers
                or copies.pipeline.inline):  # inline: one copy of every layer at the end
            return
        store = self.store_of(meta)
        group = copies.group_of_row[index]
        if len(store.transfer.groups[group]) * copies.block_bytes < copies.per_layer_min:
            return
        self._saved_layers.add(index)
        self._stats.layer_saves_in_forward += 1
        self._submit_save(store, store.transfer.groups[group], [index])

    def finish(self, meta: StepPlan) -> None:
        """The end of the step: queue the layers not saved yet (or copy them here)."""
        if meta.stores:
            store = self.store_of(meta)
            inline = self._inline_store(store)
            for group, rows in enumerate(self._copies.group_rows):
                rest = [i for i in rows if i not in self._saved_layers]
                if rest and inline:
                    self._save_now(store, store.transfer.groups[group], rest)
                elif rest:
                    self._submit_save(store, store.transfer.groups[group], rest)
            store.release.extend(meta.release_after_store)
            self._checksum_after(store, inline)
            store.mark = Checkpoint() if inline else self._copies.pipeline.checkpoint()
            self._queued += 1
            store.order = self._queued
            self.pending.append(store)
        else:
            if meta.release_after_store:
                # Stores of earlier steps may still read these requests' blocks.
                if self.pending:
                    self.pending[-1].release.extend(meta.release_after_store)
                else:
                    self._outcome.released.update(meta.release_after_store)
            # L2 pages only, no store of this plan to wait for (a slot a store still
            # fills is skipped by the I/O thread: its key is not set yet).
            self.back_up(meta)

    def end_step(self) -> None:
        """After the step's loads: settle what the queue allows."""
        if not self.async_stores:
            self.settle_all()
        elif len(self.pending) > MAX_STORE_STEPS_IN_FLIGHT:
            self._stats.store_waits += 1
            self.settle(wait_through=self.pending[-MAX_STORE_STEPS_IN_FLIGHT - 1].order)
        else:
            self.settle()
        self._saved_layers, self._storing = set(), None

    def flush(self) -> None:
        """Wait for every store in flight (a preempted request's blocks, an L3 deletion),
        counted as a store wait."""
        if self.pending:
            self._stats.store_waits += 1
            self.settle_all()

    def wait_into(self, slots: set[int]) -> None:
        """Wait for the stores in flight into any of ``slots``."""
        owners = [self._slot_owner[s].order for s in slots if s in self._slot_owner]
        if any(owners):
            self._stats.store_waits += 1
            self.settle(wait_through=max(owners))

    def settle_all(self) -> None:
        """Wait for every queued store and publish it."""
        self.settle(wait_through=self._queued)

    def settle(self, wait_through: int = 0) -> None:
        """Finish queued stores in queue order: up to the ``wait_through``-th queued
        (waiting for them), then every later one already done."""
        while self.pending:
            store = self.pending[0]
            assert store.mark is not None
            if store.order <= wait_through:
                store.mark.wait()
            elif not store.mark.done():
                return
            self.pending.popleft()
            self._publish(store)

    def store_of(self, meta: StepPlan) -> PendingStore:
        """The step's stores, built once; their slots are invalid until they land."""
        if self._storing is None or self._storing.plan is not meta:
            pool = self._copies.pool
            if self._l3.io is not None:
                self._l3.io.release_slots(p.slot for p in meta.stores)
            store = PendingStore(meta, self._copies.transfer(meta.stores),
                                 self._copies.new_clock())
            for page in meta.stores:
                pool.set_key(page.slot, None)
                self._slot_owner[page.slot] = store
            self._storing = store
        return self._storing

    def back_up(self, plan: StepPlan) -> None:
        """Back up the plan's ``backups``, pages already in L2 (plans.py: pages a store
        cut out of a span, pages the L3 admission rule admitted late, the L3
        catch-up's) under their L3 keys; the I/O thread skips a slot that no longer
        holds its page."""
        self._back_up_pages(plan.backups)

    def _back_up_pages(self, pages: list[PagePlan]) -> None:
        io = self._l3.io if self._l3.writes else None
        if io is not None and pages:
            backups = [(p, at) for p in pages for at in l3_keys(p)]
            io.submit_backup([(p.key, p.slot, at) for p, at in backups],
                             [p.span if at == p.key else None for p, at in backups])

    def _publish(self, store: PendingStore) -> None:
        """A finished store: record its slots' keys and back them up, or mark them bad."""
        pool = self._copies.pool
        # A slot stored again by a later plan belongs to that plan now.
        owned = [p for p in store.pages if self._slot_owner.get(p.slot) is store]
        for page in owned:
            del self._slot_owner[page.slot]
        if store.failed:
            self._outcome.bad_slots.update(p.slot for p in owned)
            self._stats.save_errors += len(store.pages)
        else:
            for page in owned:
                pool.set_key(page.slot, page.key)
            if store.sums is not None:
                by_slot = dict(zip((p.slot for p in store.pages), store.sums, strict=True))
                pool.set_checksums([p.slot for p in owned], [by_slot[p.slot] for p in owned])
            self._back_up_pages(owned)
            self.back_up(store.plan)
            self._stats.saved_pages += len(store.pages)
            seconds = store.clock.take_seconds()
            if seconds is not None:
                self._stats.observe(K.L2_STORE_SECONDS, seconds)
            self._stats.saved_bytes += len(store.pages) * pool.geometry.page_bytes
        self._outcome.released.update(store.release)
        self._outcome.done_seq = max(self._outcome.done_seq, store.plan.seq)

    def _inline_store(self, store: PendingStore) -> bool:
        """Whether this step's store is copied here, not on the copy thread: a small
        store on a CPU in a step that waits for its stores anyway, no layer of it
        queued yet, and nothing else in the queue."""
        pipeline = self._copies.pipeline
        if pipeline.inline:
            return True
        return (not self.async_stores and not pipeline.on_cuda and not self._saved_layers
                and store.transfer.num_bytes(self._copies.block_bytes)
                < INLINE_STORE_MAX_BYTES and pipeline.idle())

    def _save_now(self, store: PendingStore, transfer: BlockTransfer, rows: list[int]) -> None:
        """The copy of ``_submit_save``, in this thread; a failure marks the store failed."""
        copies = self._copies
        try:
            store.clock.wrap(copies.copy_fn("save"))(copies.layers, copies.pool.canonical,
                                                     transfer, rows)
        except Exception:  # noqa: BLE001 - a failed store is published as bad slots
            logger.exception("HiCache: save copy failed")
            store.copy_failed = True

    def _submit_save(self, store: PendingStore, transfer: BlockTransfer,
                     rows: list[int]) -> None:
        copies = self._copies
        save = store.clock.wrap(copies.copy_fn("save"))
        layers, canonical = copies.layers, copies.pool.canonical

        def run() -> None:
            try:
                save(layers, canonical, transfer, rows)
            except BaseException:
                store.copy_failed = True
                raise

        copies.pipeline.submit("save", run)

    def _checksum_after(self, store: PendingStore, inline: bool) -> None:
        """Checksum the store's slots right after their copy, on the copy thread (the
        bytes are still in the CPU's caches), for the L3 writes to reuse
        (host_pool.py ``set_checksums``), where the backend takes them
        (``capabilities.pool_checksums``: Mooncake; the file batch path hashes as it writes).
        CPU copies only: a GPU's copies land by DMA later, and the L3 write checksums
        those pages itself. The job runs in the copy thread's queue: loads queued
        behind it wait for it (about 1 ms per 11 MB here)."""
        pool, backend = self._copies.pool, self._l3.backend
        if (backend is None or not self._l3.writes
                or self._copies.on_cuda or not backend.capabilities.pool_checksums
                or pool.layout == "layer_first" or not native_io.available()):
            return
        base, page = pool.buffer.data_ptr(), pool.geometry.page_bytes
        slots = [p.slot for p in store.pages]

        def run() -> None:
            if store.copy_failed:
                return
            try:
                store.sums = [int(x) for x in native_io.checksums_at(
                    [base + s * page for s in slots], page).tolist()]
            except Exception:  # noqa: BLE001 - without them the L3 write computes its own
                logger.exception("HiCache: checksums of stored pages failed")

        if inline:
            run()
        else:
            self._copies.pipeline.submit("checksum", run)
