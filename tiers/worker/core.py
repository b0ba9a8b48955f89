"""The worker half's core: owns this rank's L2 bytes and performs the planned copies.

See DESIGN.md "Flow of one request" (steps 4 and 5).

Contract:
- Engine-free: it takes a plain ``StepPlan`` and returns a plain
  ``WorkerReport`` (tiers/index/plans.py); connector/connector.py calls it
  from vLLM's hooks and wraps the report in vLLM's envelope.
- ``register_kv_caches`` views each layer's KV as pool rows of raw bytes
  (tiers/worker/kv_layers.py) and allocates the host pool once, sized by
  the same ``PoolGeometry`` the scheduler uses; each group's layers are
  copied with that group's blocks (tiers/worker/transfers.py).
- A fetch with no L3 pages (an asynchronous L2 hit, which every hit is with
  several groups) is served at once in ``start_load``: vLLM does not run
  the request in this step, and reports it received at the step's end.
  A prefetch (a request vLLM has not admitted, ``RequestFetch.prefetch``)
  stops in L2: its count goes to the scheduler, nothing to vLLM.
- Failed loads of a request whose hit was asynchronous go back to vLLM as
  block ids (``take_load_errors``), or, with several KV-cache groups, where
  vLLM cannot map block ids to requests, as the request's id
  (``take_failed_recving``): vLLM then recomputes that request.
- ``start_load`` checks every planned L2 -> L1 page's key, then copies layer
  by layer on a background thread; ``wait_for_layer`` (vLLM calls it before
  each layer's attention) waits for that layer only. A page whose slot does
  not hold the expected key is not loaded: its blocks and every later block
  of that request go to ``take_load_errors`` so vLLM recomputes them, and
  the slot is reported back to the scheduler.
- ``save_layer`` starts copying a layer's planned L1 -> L2 pages as soon as
  that layer's attention has run; ``finish_step`` (vLLM's wait_for_save)
  queues the rest and waits for the step's loads only. A failed copy
  invalidates slots or reports blocks; it never raises.
- Stores across steps (``async_stores``; off for sliding-window and Mamba
  groups, whose blocks vLLM frees or overwrites while the request runs): a
  step's stores are a ``PendingStore`` on the copy queue, finished in plan
  order without blocking (``finish_step``, ``take_released``). Only then
  are their slot keys recorded, their L3 backups queued, their finished
  requests released (vLLM's finished_sending) and ``stores_done`` reported.
  Waits happen only where the copy queue does not order things: more than
  ``MAX_STORE_STEPS_IN_FLIGHT`` steps queued, a preempted request's stores
  (``flush_stores`` in vLLM's handle_preemptions), an L3 read into or a
  fetch out of a slot being stored, an admin L3 deletion (its pages must
  not be backed up after it). Each is counted in ``store_waits``. A load
  from a slot still being stored runs after that store on the same queue;
  if the store failed, the load's blocks are reported as load errors.
  Without ``async_stores`` every step waits for its stores, as before.
- Nothing here raises into the engine for a cache problem: failures degrade
  to recompute.
- With L3 (``storage_spec``), the backend is built once the pool exists
  (tiers/worker/l3_link.py); fetches and backups run on ``StorageIO``'s
  thread (tiers/l3/io_thread.py). Every page stored into L2 is then backed
  up to L3 (whatever the write policy chose for L2 is what reaches L3).
- Counters and latencies (tiers/worker/stats.py) leave the worker once
  per step, in ``take_report``: counter increments since the previous
  report, latency observations (copy time of the step's L2 loads and
  stores, time of each finished L3 fetch), this rank's changed gauges (queue
  depths, whether its L3 breaker is open), the L3 keys its backups stored
  with how many L3-changing commands it had applied then. That
  report feeds both the admin view and vLLM's stats
  (connector/vllm_metrics.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hicache.kernels import block_copy, io_backend
from hicache.kernels.block_copy import BlockTransfer
from hicache.kernels.layer_pipeline import Checkpoint, LayerPipeline
from hicache.tiers.index.commands import L3_CHANGES, CancelFetches, RetainPages
from hicache.tiers.index.plans import NULL_BLOCK_ID, PagePlan, RequestFetch, StepPlan, WorkerReport
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import StorageBackend
from hicache.tiers.l3.io_thread import StorageIO
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.kv_layers import KVLayers
from hicache.tiers.worker.l3_link import L3Link, StorageBuilder
from hicache.tiers.worker.stats import CopyClock, CounterDeltas, WorkerStats
from hicache.tiers.worker.transfers import GroupTransfer, PendingStore, group_transfer, l3_keys

logger = logging.getLogger(__name__)

# Steps whose stores may be queued at once; a step beyond waits for the oldest.
MAX_STORE_STEPS_IN_FLIGHT = 4
# A step stores layer by layer during the forward pass (each layer's copy overlapping
# the next layers' compute) only when a layer's share is at least this many bytes;
# smaller stores go as one copy of every layer at the end of the step. Each per-layer
# save costs the host an enqueue (GPU: an event pair, a stream switch and a kernel
# launch, ~0.1 ms of Python; CPU: a hand-off to the copy thread): on an H200 with
# 16-token pages and 32 decoding requests nearly every decode step stores a page or
# two, and 8 per-layer saves per step cost ~20% throughput (docs/gpu.md, "Serving under
# load on a GPU"). 4 MiB copies in ~0.1 ms at 45 GB/s.
PER_LAYER_SAVE_MIN_BYTES = {"cuda": 4 << 20, "cpu": 256 << 10}
# On a CPU, when each step waits for its stores, a step's store below this many bytes
# (all layers) is copied in the calling thread when the copy thread is idle: handing a
# few KiB to the thread and waiting for it costs more than the copy (a pool submit, a
# future, a condition wait: ~4% of a decode step of the tiny model, py-spy).
INLINE_STORE_MAX_BYTES = 1 << 20


class HiCacheWorker:
    """Copies between vLLM's KV blocks and the L2 host pool of this rank."""

    def __init__(
        self,
        geometry: PoolGeometry,
        l1_num_blocks: int,
        *,
        layout: str = "page_first_direct",
        io: str = "direct",
        storage_builder: StorageBuilder | None = None,
        storage_spec: tuple[str, dict] | None = None,
        l3_writer: bool = True,
        group_layer_names: Sequence[Sequence[str]] | None = None,
        rank: int = 0,
        async_stores: bool = False,
    ) -> None:
        self.geometry = geometry
        self.rank = rank
        self.async_stores = async_stores
        self.l1_num_blocks = l1_num_blocks
        self.layout = layout
        self.io = io
        self.copy_path = io_backend.TORCH_SLICES
        self.pool: HostPagePool | None = None
        self.layers: list[torch.Tensor] = []
        # Layer names per KV-cache group (None: one group, every layer vLLM registers).
        self._group_layer_names = group_layer_names
        # Pool rows of each group, and each row's group.
        self._group_rows: list[list[int]] = [[]]
        self._group_of_row: list[int] = []
        self._layer_index: dict[str, int] = {}
        # Several groups: failed loads are reported per request, not per block.
        self.per_request_failures = bool(group_layer_names and len(group_layer_names) > 1)
        self._failed_recv: set[str] = set()
        self.stats = WorkerStats()
        self._load_clock = CopyClock()
        self._load_errors: set[int] = set()
        self._bad_slots: set[int] = set()
        self._released: set[str] = set()
        self._released_recv: set[str] = set()
        # CPU: copies in the forward thread, between forward passes (kernels/layer_pipeline.py
        # "Inline mode"); a copy thread only where stores finish across steps.
        self._pipeline = LayerPipeline(inline=not async_stores)
        self._per_layer_min = PER_LAYER_SAVE_MIN_BYTES["cpu"]
        # Per-step state, reset by finish_step.
        self._loading: list[int] = []
        self._loading_bytes = 0
        self._saved_layers: set[int] = set()
        self._storing: PendingStore | None = None
        self._load_mark: Checkpoint | None = None
        # Loads from slots whose store was still queued: (that store, the blocks).
        self._load_deps: list[tuple[PendingStore, tuple[int, ...]]] = []
        # Stores across steps: queued in plan order; slot -> the last store into it.
        self._pending: deque[PendingStore] = deque()
        self._slot_owner: dict[int, PendingStore] = {}
        self._queued = 0  # stores queued since start; PendingStore.order
        self._done_seq = 0
        self._done_reported = 0
        # Whether this rank backs pages up to L3 and deletes them there (MLA:
        # rank 0 only, the pages being the same on every rank).
        self.l3 = L3Link(storage_builder, storage_spec, writer=l3_writer)
        self._fetched: dict[str, list[int]] = {}
        self._deltas = CounterDeltas()
        self._gauges_reported: dict[str, float] = {}
        self._commands_applied: object = None
        # L3-changing commands applied (flush, forget, attach, detach), reported
        # with the backups stored (tiers/index/commands.py).
        self._l3_changes = 0
        self._side_stream: torch.cuda.Stream | None = None

    @property
    def storage(self) -> StorageBackend | None:
        return self.l3.backend

    @property
    def storage_io(self) -> StorageIO | None:
        return self.l3.io

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        kv = KVLayers.of(kv_caches, self._group_layer_names, self.l1_num_blocks,
                         self.geometry.block_bytes, self.geometry.num_layers)
        layers, block_bytes = kv.rows, self.geometry.block_bytes
        self._group_rows, self._group_of_row = kv.group_rows, kv.group_of_row
        self._layer_index = kv.row_of_layer
        self.layers = layers
        self.copy_path = io_backend.select(self.io, layers[0].device.type)
        if layers[0].device.type == "cuda":
            # Side stream + per-layer events; copies only enqueue (never block the host).
            self._pipeline.shutdown()
            self._pipeline = LayerPipeline(layers[0].device)
            self._per_layer_min = PER_LAYER_SAVE_MIN_BYTES["cuda"]
            self._load_clock = CopyClock(cuda=True)
            self._side_stream = torch.cuda.Stream(layers[0].device)
        geometry = PoolGeometry(
            self.geometry.num_slots, len(layers), self.geometry.blocks_per_page, block_bytes
        )
        self.pool = HostPagePool(geometry, layout=self.layout, device=layers[0].device)
        if self.copy_path.precompile is not None:
            # Triton's JIT (GPU) or numba's (CPU) now, not on the first copy of a
            # serving engine. A failure here costs only that: the first copy
            # compiles as before.
            try:
                compiled = self.copy_path.precompile(layers, self.pool.canonical)
                logger.info("HiCache: %d copy kernels compiled ahead", compiled)
            except Exception:  # noqa: BLE001 - an optimisation, never a start failure
                logger.exception("HiCache: compiling the copy kernels ahead failed; the "
                                 "first copy will compile them")
        memory = self.pool.memory
        logger.info(
            "HiCache L2 pool: %d pages x %.2f MiB = %.2f GiB, %s, %s, copies: %s",
            geometry.num_slots,
            geometry.page_bytes / 2**20,
            geometry.buffer_bytes / 2**30,
            self.layout,
            ("pinned (cudaHostRegister" + ("" if memory.numa_node is None
                                           else f", NUMA node {memory.numa_node}") + ")")
            if memory.pinned else "pageable",
            self.copy_path.name,
        )
        self.l3.start(self.pool, self._load_fetched_pages)

    def _load_fetched_pages(self, pages: list[PagePlan]) -> GroupTransfer:
        """L2 -> L1 for a fetched request, on the L3 thread (torch copies: thread-safe;
        on CUDA a side stream, synchronised before the request is reported)."""
        pool = self._require_pool()
        transfer = self._transfer(pages)
        stream = (torch.cuda.stream(self._side_stream) if self._side_stream is not None
                  else contextlib.nullcontext())
        with stream:
            for group, rows in enumerate(self._group_rows):
                if len(transfer.groups[group]):
                    block_copy.load_blocks(pool.canonical, self.layers, transfer.groups[group],
                                           rows)
        return transfer

    def _transfer(self, pages: Sequence[PagePlan]) -> GroupTransfer:
        """The copies of ``pages``, one ``BlockTransfer`` per KV-cache group."""
        return group_transfer(pages, self._group_rows)

    # ---- loads ----------------------------------------------------------------

    def start_load(self, meta: StepPlan) -> None:
        """Check every planned page's key, then copy layer by layer in the background;
        hand this step's L3 fetches to the L3 thread."""
        pool = self._require_pool()
        self.apply_commands(meta)
        for fetch in meta.fetches:
            # Read or written off the copy queue: a store into its slots must end first.
            self._wait_stores_into({p.slot for p in (*fetch.l2_pages, *fetch.l3_pages)})
            if not fetch.l3_pages:
                self._serve_from_l2(fetch)
            elif self.storage_io is None:
                self._fail_fetch(fetch)
            else:
                self.storage_io.submit_fetch(fetch)
        pages: list[PagePlan] = []
        for load in meta.loads:
            self._load_errors.update(load.unloadable_block_ids)
            failed = False
            for page in load.pages:
                owner = self._slot_owner.get(page.slot)
                if not failed and owner is not None and owner.keys.get(page.slot) == page.key:
                    # Still being stored: the copy queue runs this load after it.
                    self._load_deps.append((owner, page.block_ids))
                elif failed or not pool.holds(page.slot, page.key):
                    if not failed:
                        logger.warning(
                            "HiCache: L2 slot %d does not hold the expected page for request "
                            "%s; recomputing from there", page.slot, load.req_id,
                        )
                        self._bad_slots.add(page.slot)
                    failed = True
                    self._load_errors.update(page.block_ids)
                    continue
                pages.append(page)
        transfer = self._transfer(pages)
        if not transfer.num_blocks:
            return
        self._loading = [b for p in pages for b in p.block_ids if b != NULL_BLOCK_ID]
        self._loading_bytes = transfer.num_bytes(self.geometry.block_bytes)
        copy_in = self._load_clock.wrap(self._copy_fn("load"))
        if self._pipeline.inline:
            # Before the forward pass, in its thread: one copy of every layer per group.
            for group, rows in enumerate(self._group_rows):
                if len(transfer.groups[group]):
                    self._pipeline.submit("load", functools.partial(
                        copy_in, pool.canonical, self.layers, transfer.groups[group], rows))
        else:
            group_of = self._group_of_row
            self._pipeline.start_load(
                lambda row: copy_in(pool.canonical, self.layers, transfer.groups[group_of[row]],
                                    [row]),
                len(self.layers))
        self._load_mark = self._pipeline.checkpoint()

    def _serve_from_l2(self, fetch: RequestFetch) -> None:
        """An asynchronous hit that L2 holds whole: copy it now (vLLM does not run
        the request this step) and report it received at the step's end."""
        pool = self._require_pool()
        errors = set(fetch.unloadable_block_ids)
        pages: list[PagePlan] = []
        for i, page in enumerate(fetch.l2_pages):
            if not pool.holds(page.slot, page.key):
                logger.warning("HiCache: L2 slot %d does not hold the expected page for "
                               "request %s; recomputing it", page.slot, fetch.req_id)
                self._bad_slots.add(page.slot)
                errors.update(b for p in fetch.l2_pages[i:] for b in p.block_ids)
                break
            pages.append(page)
        if pages:
            try:
                transfer = self._load_fetched_pages(pages)
                self.stats.loaded_blocks += transfer.num_blocks
                self.stats.loaded_bytes += transfer.num_bytes(self.geometry.block_bytes)
            except Exception:  # noqa: BLE001 - recompute instead
                logger.exception("HiCache: L2 -> L1 copy of request %s failed", fetch.req_id)
                errors.update(b for p in pages for b in p.block_ids)
        self._end_fetch(fetch.req_id, 0, errors)

    def _end_fetch(self, req_id: str, fetched: int, errors: set[int]) -> None:
        """A fetch ended with ``fetched`` L3 pages in L2; ``errors``: blocks not filled."""
        errors.discard(NULL_BLOCK_ID)
        self._fetched[req_id] = [fetched]
        self._released_recv.add(req_id)
        if not errors:
            return
        if self.per_request_failures:
            self._failed_recv.add(req_id)
            self.stats.load_errors += len(errors)
        else:
            self._load_errors.update(errors)

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this layer's planned loads are in vLLM's KV cache."""
        index = self._layer_index.get(layer_name)
        if index is not None and self._loading:
            self.stats.layer_waits += 1
            self._pipeline.wait_layer(index)

    def _fail_fetch(self, fetch: RequestFetch) -> None:
        if fetch.prefetch:  # nothing for vLLM: the scheduler frees the slots
            self._fetched[fetch.req_id] = [0]
            return
        errors = set(fetch.unloadable_block_ids)
        for page in (*fetch.l2_pages, *fetch.l3_pages):
            errors.update(page.block_ids)
        self._end_fetch(fetch.req_id, 0, errors)

    def take_failed_recving(self) -> set[str]:
        """Requests (several KV-cache groups only) whose asynchronous load failed:
        vLLM recomputes them; each was also reported received."""
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        # The null block stands for tokens out of a sliding window: never an error
        # (vLLM would recompute every request that holds it).
        errors.discard(NULL_BLOCK_ID)
        self.stats.load_errors += len(errors)
        return errors

    # ---- stores ---------------------------------------------------------------

    def save_layer(self, layer_name: str, meta: StepPlan) -> None:
        """This layer's KV is final for the step: copy its planned stores while later
        layers compute."""
        index = self._layer_index.get(layer_name)
        if (not meta.stores or index is None or index in self._saved_layers
                or self._pipeline.inline):  # inline: one copy of every layer at the end
            return
        store = self._store_of(meta)
        group = self._group_of_row[index]
        if len(store.transfer.groups[group]) * self.geometry.block_bytes < self._per_layer_min:
            # A small store (a decode step's page or two): one copy of every layer at
            # the end of the step costs the host less than one per layer.
            return
        self._saved_layers.add(index)
        self.stats.layer_saves_in_forward += 1
        self._submit_save(store, store.transfer.groups[group], [index])

    def finish_step(self, meta: StepPlan) -> None:
        """End of the step: queue the layers not saved yet, wait for the step's loads,
        and publish what is done (slot keys, load errors, bad slots, released
        requests); stores still running are finished by a later call."""
        self._require_pool()
        self.apply_commands(meta)
        if meta.stores:
            store = self._store_of(meta)
            inline = self._inline_store(store)
            for group, rows in enumerate(self._group_rows):
                rest = [i for i in rows if i not in self._saved_layers]
                if rest and inline:
                    self._save_now(store, store.transfer.groups[group], rest)
                elif rest:
                    self._submit_save(store, store.transfer.groups[group], rest)
            store.release.extend(meta.release_after_store)
            self._checksum_after(store, inline)
            store.mark = Checkpoint() if inline else self._pipeline.checkpoint()
            self._queued += 1
            store.order = self._queued
            self._pending.append(store)
        else:
            if meta.release_after_store:
                # Stores of earlier steps may still read these requests' blocks.
                if self._pending:
                    self._pending[-1].release.extend(meta.release_after_store)
                else:
                    self._released.update(meta.release_after_store)
            # L2 pages only, no store of this plan to wait for (a slot a store still
            # fills is skipped by the I/O thread: its key is not set yet).
            self._back_up(meta)
        if self._loading:
            self._finish_loads()
        if not self.async_stores:
            self._settle_all()
        elif len(self._pending) > MAX_STORE_STEPS_IN_FLIGHT:
            self.stats.store_waits += 1
            self._settle_stores(wait_through=self._pending[-MAX_STORE_STEPS_IN_FLIGHT - 1].order)
        else:
            self._settle_stores()
        self._loading, self._saved_layers, self._storing = [], set(), None

    def _finish_loads(self) -> None:
        """Wait for the step's L2 -> L1 copies (and, queued before them, earlier stores)."""
        assert self._load_mark is not None
        ok = self._load_mark.wait()
        failed = not ok or any(kind == "load" for kind, _ in self._pipeline.take_failures())
        load_seconds = self._load_clock.take_seconds()
        if failed:
            self._load_errors.update(self._loading)
        else:
            if load_seconds is not None:
                self.stats.observe(K.L2_LOAD_SECONDS, load_seconds)
            self.stats.loaded_blocks += len(self._loading)
            self.stats.loaded_bytes += self._loading_bytes
        for store, block_ids in self._load_deps:
            if store.mark is not None:
                store.mark.wait()  # done already: queued before the load
            if store.failed:
                self._load_errors.update(block_ids)  # it copied a slot its store did not fill
        self._load_deps, self._load_mark = [], None

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Before the forward pass: a preempted request's blocks may be reused in it,
        so its stores in flight must be done (the scheduler sets ``flush_stores``)."""
        if meta.flush_stores and self._pending:
            self.stats.store_waits += 1
            self._settle_all()

    def _inline_store(self, store: PendingStore) -> bool:
        """Whether this step's store is copied here, not on the copy thread: a small
        store on a CPU in a step that waits for its stores anyway, no layer of it
        queued yet, and nothing else in the queue."""
        if self._pipeline.inline:
            return True
        return (not self.async_stores and not self._pipeline.on_cuda and not self._saved_layers
                and store.transfer.num_bytes(self.geometry.block_bytes)
                < INLINE_STORE_MAX_BYTES and self._pipeline.idle())

    def _save_now(self, store: PendingStore, transfer: BlockTransfer, rows: list[int]) -> None:
        """The copy of ``_submit_save``, in this thread; a failure marks the store failed."""
        pool = self._require_pool()
        try:
            store.clock.wrap(self._copy_fn("save"))(self.layers, pool.canonical, transfer, rows)
        except Exception:  # noqa: BLE001 - a failed store is published as bad slots
            logger.exception("HiCache: save copy failed")
            store.copy_failed = True

    def _submit_save(self, store: PendingStore, transfer: BlockTransfer,
                     rows: list[int]) -> None:
        pool = self._require_pool()
        save = store.clock.wrap(self._copy_fn("save"))

        def run() -> None:
            try:
                save(self.layers, pool.canonical, transfer, rows)
            except BaseException:
                store.copy_failed = True
                raise

        self._pipeline.submit("save", run)

    def _checksum_after(self, store: PendingStore, inline: bool) -> None:
        """Checksum the store's slots right after their copy, on the copy thread (the
        bytes are still in the CPU's caches), for the L3 writes to reuse
        (host_pool.py ``set_checksums``), where the backend takes them
        (``uses_pool_checksums``: Mooncake; the file batch path hashes as it writes).
        CPU copies only: a GPU's copies land by DMA later, and the L3 write checksums
        those pages itself. The job runs in the copy thread's queue: loads queued
        behind it wait for it (about 1 ms per 11 MB here)."""
        pool = self._require_pool()
        if (self.storage is None or not self.l3.writes
                or self._pipeline.on_cuda or not self.storage.uses_pool_checksums
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
            self._pipeline.submit("checksum", run)

    def _settle_all(self) -> None:
        """Wait for every queued store and publish it."""
        self._settle_stores(wait_through=self._queued)

    def _settle_stores(self, wait_through: int = 0) -> None:
        """Finish queued stores in queue order: up to the ``wait_through``-th queued
        (waiting for them), then every later one already done."""
        while self._pending:
            store = self._pending[0]
            assert store.mark is not None
            if store.order <= wait_through:
                store.mark.wait()
            elif not store.mark.done():
                return
            self._pending.popleft()
            self._publish_store(store)

    def _publish_store(self, store: PendingStore) -> None:
        """A finished store: record its slots' keys and back them up, or mark them bad."""
        pool = self._require_pool()
        # A slot stored again by a later plan belongs to that plan now.
        owned = [p for p in store.pages if self._slot_owner.get(p.slot) is store]
        for page in owned:
            del self._slot_owner[page.slot]
        if store.failed:
            self._bad_slots.update(p.slot for p in owned)
            self.stats.save_errors += len(store.pages)
        else:
            for page in owned:
                pool.set_key(page.slot, page.key)
            if store.sums is not None:
                by_slot = dict(zip((p.slot for p in store.pages), store.sums, strict=True))
                pool.set_checksums([p.slot for p in owned], [by_slot[p.slot] for p in owned])
            io = self.storage_io if self.l3.writes else None
            if io is not None and owned:
                backups = [(p, at) for p in owned for at in l3_keys(p)]
                io.submit_backup(
                    [(p.key, p.slot, at) for p, at in backups],
                    [p.span if at == p.key else None for p, at in backups])
            self._back_up(store.plan)
            self.stats.saved_pages += len(store.pages)
            seconds = store.clock.take_seconds()
            if seconds is not None:
                self.stats.observe(K.L2_STORE_SECONDS, seconds)
            self.stats.saved_bytes += len(store.pages) * pool.geometry.page_bytes
        self._released.update(store.release)
        self._done_seq = max(self._done_seq, store.plan.seq)

    def _back_up(self, plan: StepPlan) -> None:
        """Back up the plan's ``backups``, pages already in L2 (plans.py: pages a store
        cut out of a span, pages the L3 admission rule admitted late) under their L3
        keys; the I/O thread skips a slot that no longer holds its page."""
        io = self.storage_io if self.l3.writes else None
        if io is not None and plan.backups:
            backups = [(p, at) for p in plan.backups for at in l3_keys(p)]
            io.submit_backup([(p.key, p.slot, at) for p, at in backups],
                             [p.span if at == p.key else None for p, at in backups])

    def _wait_stores_into(self, slots: set[int]) -> None:
        """Wait for the stores in flight into any of ``slots``."""
        owners = [self._slot_owner[s].order for s in slots if s in self._slot_owner]
        if any(owners):
            self.stats.store_waits += 1
            self._settle_stores(wait_through=max(owners))

    def _copy_fn(self, kind: str) -> Callable[..., None]:
        """The copy function the pipeline runs: enqueue-only on a CUDA side stream."""
        if self._pipeline.on_cuda:
            fn = getattr(self.copy_path, f"{kind}_async")
            if fn is not None:
                return fn
        return getattr(self.copy_path, kind)

    def _store_of(self, meta: StepPlan) -> PendingStore:
        """The step's stores, built once; their slots are invalid until they land."""
        if self._storing is None or self._storing.plan is not meta:
            pool = self._require_pool()
            if self.storage_io is not None:
                self.storage_io.release_slots(p.slot for p in meta.stores)
            store = PendingStore(meta, self._transfer(meta.stores),
                                 CopyClock(cuda=self._pipeline.on_cuda))
            for page in meta.stores:
                pool.set_key(page.slot, None)
                self._slot_owner[page.slot] = store
            self._storing = store
        return self._storing

    def shutdown(self) -> None:
        self._settle_all()
        self._pipeline.shutdown()
        self.l3.shutdown()
        if self.pool is not None:
            self.pool.close()

    def take_released(self) -> set[str]:
        self._settle_stores()
        released, self._released = self._released, set()
        return released

    def take_received(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose L3 fetch finished (for vLLM's finished_recving); their
        unfilled blocks go to take_load_errors, their counts to take_report.
        ``wait_s`` > 0 (a step in which nothing computes): first wait up to that
        long for a pending fetch to finish (tiers/l3/io_thread.py ``wait_results``)."""
        results, waited = self.l3.take_results(wait_s)
        if waited:
            self.stats.idle_fetch_waits += 1
        for result in results:
            self.stats.observe(K.L3_FETCH_SECONDS, result.seconds)
            if result.prefetch:  # L3 -> L2 for a request vLLM has not admitted
                self._fetched[result.req_id] = [result.fetched_pages]
                continue
            self._end_fetch(result.req_id, result.fetched_pages, set(result.error_block_ids))
        received, self._released_recv = self._released_recv, set()
        return received

    def counters(self) -> dict[str, float]:
        """Cumulative counters of this rank (L2 copies, L3 traffic of every backend
        attached since start); keys are the ``worker`` rows of tiers/metrics.py."""
        st = self.stats
        out: dict[str, float] = {
            K.LOADED_BLOCKS: st.loaded_blocks, K.LOADED_BYTES: st.loaded_bytes,
            K.SAVED_PAGES: st.saved_pages, K.SAVED_BYTES: st.saved_bytes,
            K.LOAD_ERRORS: st.load_errors, K.SAVE_ERRORS: st.save_errors,
            K.STORE_WAITS: st.store_waits,
        }
        out.update(self.l3.counters())
        return out

    def gauges(self) -> dict[str, float]:
        return self.l3.gauges()

    def take_report(self) -> WorkerReport | None:
        """This step's report: bad slots, finished fetches, counter increments since
        the last report, latency observations, changed queue depths (None: nothing)."""
        deltas = self._deltas.take(self.counters())
        observations = self.stats.take_observations()
        gauges = {k: v for k, v in self.gauges().items() if self._gauges_reported.get(k) != v}
        done = ({self.rank: self._done_seq}
                if self.async_stores and self._done_seq != self._done_reported else {})
        stored = self.l3.take_backed_up()
        l3_stored = {self.rank: stored} if stored else {}
        if not (self._bad_slots or self._fetched or deltas or gauges or observations or done
                or l3_stored):
            return None
        self._gauges_reported.update(gauges)
        self._done_reported = self._done_seq
        report = WorkerReport(self._bad_slots, self._fetched, deltas,
                              {self.rank: gauges} if gauges else {}, observations,
                              done, l3_stored,
                              {self.rank: self._l3_changes} if l3_stored else {})
        self._bad_slots, self._fetched = set(), {}
        return report

    def apply_commands(self, meta: StepPlan) -> None:
        """Admin storage commands of this step, once, before its loads and fetches."""
        if not meta.storage_commands or self._commands_applied is meta:
            return
        self._commands_applied = meta
        removes = any(not isinstance(c, (RetainPages, CancelFetches))
                      for c in meta.storage_commands)
        if self._pending and removes:
            # An L3 deletion must not be followed by a backup of a page it deletes.
            self.stats.store_waits += 1
            self._settle_all()
        for command in meta.storage_commands:
            self.l3.apply(command)
            self._l3_changes += isinstance(command, L3_CHANGES)

    def _require_pool(self) -> HostPagePool:
        if self.pool is None:
            raise RuntimeError("HiCache worker used before register_kv_caches")
        return self.pool

