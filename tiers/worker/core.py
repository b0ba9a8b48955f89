"""The worker half: this rank's L2 bytes and the planned copies, as a facade over its jobs.

See DESIGN.md "Flow of one request" (steps 4 and 5).

Contract:
- Engine-free: it takes a plain ``StepPlan`` and returns a plain
  ``WorkerReport`` (tiers/index/plans.py); connector/connector.py calls it
  from vLLM's hooks and wraps the report in vLLM's envelope.
- Each job owns its state and gets what it shares through its constructor:
  ``KVCopies`` (copies.py: vLLM's layers bound to the pool, the copy path
  and pipeline, built by ``register_kv_caches``), ``L2Loads`` (loads.py),
  ``StoreQueue`` (store_queue.py), ``FetchEndings`` (fetch_endings.py),
  ``L3Link`` (l3_link.py: the backend and its I/O thread), ``StepReporter``
  (report.py); what they owe vLLM and the scheduler collects in one
  ``StepOutcome`` (outcome.py) until the facade hands it over.
- ``begin_step(plan)`` (vLLM's bind_connector_metadata: once per step,
  before its loads) applies the plan's storage commands (attach, detach,
  flush, retention, cancelled fetches) on this rank; before a deletion or
  a store change, every store in flight is finished, so no backup of a page
  it deletes is queued after it. Attaching and detaching L3 happen only
  here, never in the load and store hooks.
- ``register_kv_caches`` places the L3 threads and the copy thread of
  ``async_stores`` (``helper_cpus``: the ``hicache_helper_cpus`` setting,
  tiers/worker/helper_cpus.py) from the thread vLLM calls it on, its forward
  thread. Where they share the cores of
  a CPU engine's forward pass, L3 backups yield to it: ``begin_step`` closes
  their gate and ``finish_step`` (vLLM's wait_for_save, after the pass) opens
  it (tiers/worker/forward_gate.py).
- ``start_load``: fetches first (an L2-only fetch is served at once; an L3
  fetch goes to the I/O thread, after the stores into its slots), then the
  step's L2 -> L1 loads. ``wait_for_layer``, ``save_layer`` and
  ``finish_step`` follow vLLM's per-layer hooks and wait_for_save.
- Nothing here raises into the engine for a cache problem: failures degrade
  to recompute.
- With L3 (``storage_spec``), the backend is built once the pool exists;
  every page stored into L2 is then backed up to L3 (whatever the write
  policy chose for L2 is what reaches L3).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from hicache.tiers.host_cpus import format_cpus
from hicache.tiers.index.commands import L3_CHANGES
from hicache.tiers.index.plans import StepPlan, WorkerReport
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import StorageBackend
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.copies import KVCopies
from hicache.tiers.worker.fetch_endings import FetchEndings
from hicache.tiers.worker.helper_cpus import HelperPlacement, host_placement
from hicache.tiers.worker.l3_io import StorageIO
from hicache.tiers.worker.l3_link import L3Link, StorageBuilder
from hicache.tiers.worker.loads import L2Loads
from hicache.tiers.worker.outcome import StepOutcome
from hicache.tiers.worker.report import StepReporter
from hicache.tiers.worker.stats import WorkerStats
from hicache.tiers.worker.store_queue import StoreQueue

logger = logging.getLogger(__name__)


def _device_type(kv: Any) -> str:
    """The device of one of vLLM's KV-cache entries (a tensor, or a list of them)."""
    if isinstance(kv, (list, tuple)) and kv:
        return _device_type(kv[0])
    return kv.device.type if isinstance(kv, torch.Tensor) else "cpu"


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
        helper_cpus: str = "auto",
    ) -> None:
        self.geometry = geometry
        self.helper_cpus = helper_cpus
        self.placement: HelperPlacement | None = None  # where the L3 threads run
        self.rank = rank
        self.async_stores = async_stores
        self.l1_num_blocks = l1_num_blocks
        self.layout = layout
        self.io = io
        # Layer names per KV-cache group (None: one group, every layer vLLM registers).
        self._group_layer_names = group_layer_names
        # Several groups: failed loads are reported per request, not per block.
        self.per_request_failures = bool(group_layer_names and len(group_layer_names) > 1)
        self.stats = WorkerStats()
        self.outcome = StepOutcome()
        # Whether this rank backs pages up to L3 and deletes them there (MLA:
        # rank 0 only, the pages being the same on every rank).
        self.l3 = L3Link(storage_builder, storage_spec, writer=l3_writer)
        self._reporter = StepReporter(rank, report_done=async_stores)
        # Built by register_kv_caches.
        self.copies: KVCopies | None = None
        self.loads: L2Loads | None = None
        self.stores: StoreQueue | None = None
        self.fetches: FetchEndings | None = None

    @property
    def pool(self) -> HostPagePool | None:
        return None if self.copies is None else self.copies.pool

    @property
    def layers(self) -> list[torch.Tensor]:
        """vLLM's KV as pool rows (empty before register_kv_caches)."""
        return [] if self.copies is None else self.copies.layers

    @property
    def storage(self) -> StorageBackend | None:
        return self.l3.backend

    @property
    def storage_io(self) -> StorageIO | None:
        return self.l3.io

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # vLLM's CPU forward pass keeps its cores busy (OpenMP) and its forward thread
        # does the serial work between passes: HiCache's threads run off that thread's
        # core and, on the pass's other cores, back up only between passes. On a GPU
        # the host is free while it computes.
        on_cpu = all(_device_type(t) == "cpu" for t in kv_caches.values())
        placement = host_placement(self.helper_cpus, on_cpu)
        self.placement = placement
        if placement.cpus or on_cpu:
            logger.info("HiCache: L3 and copy threads on CPUs %s (%s); the forward pass "
                        "on %s", format_cpus(placement.cpus) or "of the forward pass",
                        placement.why, format_cpus(placement.team))
        copies = KVCopies.bind(
            kv_caches, self.geometry, self.l1_num_blocks,
            group_layer_names=self._group_layer_names, layout=self.layout, io=self.io,
            async_stores=self.async_stores, helper_cpus=placement.cpus)
        self.copies = copies
        self.stores = StoreQueue(copies, self.l3, self.outcome, self.stats,
                                 async_stores=self.async_stores)
        self.loads = L2Loads(copies, self.outcome, self.stats, self.stores.owner_of)
        self.fetches = FetchEndings(copies, self.outcome, self.stats,
                                    per_request_failures=self.per_request_failures)
        self.l3.start(copies.pool, copies.load_pages,
                      yield_to_forward=on_cpu and placement.shares_forward,
                      helper_cpus=placement.cpus)

    def _jobs(self) -> tuple[L2Loads, StoreQueue, FetchEndings]:
        if self.loads is None or self.stores is None or self.fetches is None:
            raise RuntimeError("HiCache worker used before register_kv_caches")
        return self.loads, self.stores, self.fetches

    # ---- one step -------------------------------------------------------------

    def begin_step(self, meta: StepPlan) -> None:
        """A new step's plan: apply its storage commands on this rank, once."""
        self.l3.forward_started()
        if not meta.storage_commands:
            return
        changes = any(isinstance(c, L3_CHANGES) for c in meta.storage_commands)
        if changes and self.stores is not None:
            # An L3 deletion must not be followed by a backup of a page it deletes.
            self.stores.flush()
        for command in meta.storage_commands:
            self.l3.apply(command)

    def start_load(self, meta: StepPlan) -> None:
        """Hand this step's fetches on (an L2-only one is served now), then check every
        planned page's key and copy the loads layer by layer in the background."""
        loads, stores, fetches = self._jobs()
        io = self.l3.io
        for fetch in meta.fetches:
            # Read or written off the copy queue: a store into its slots must end first.
            stores.wait_into({p.slot for p in (*fetch.l2_pages, *fetch.l3_pages)})
            if not fetch.l3_pages:
                fetches.serve_from_l2(fetch)
            elif io is None:
                fetches.fail(fetch)
            else:
                io.submit_fetch(fetch)
        loads.start(meta.loads)

    def wait_for_layer(self, layer_name: str) -> None:
        """Return once this layer's planned loads are in vLLM's KV cache."""
        if self.loads is not None:
            self.loads.wait_layer(layer_name)

    def save_layer(self, layer_name: str, meta: StepPlan) -> None:
        """This layer's KV is final for the step: copy its planned stores while later
        layers compute."""
        self._jobs()[1].save_layer(layer_name, meta)

    def finish_step(self, meta: StepPlan) -> None:
        """End of the step: queue the layers not saved yet, wait for the step's loads,
        and publish what is done (slot keys, load errors, bad slots, released
        requests); stores still running are finished by a later call."""
        loads, stores, _ = self._jobs()
        try:
            stores.finish(meta)
            loads.finish()
            stores.end_step()
        finally:
            self.l3.forward_ended()

    def handle_preemptions(self, meta: StepPlan) -> None:
        """Before the forward pass: a preempted request's blocks may be reused in it,
        so its stores in flight must be done (the scheduler sets ``flush_stores``)."""
        if meta.flush_stores and self.stores is not None:
            self.stores.flush()

    # ---- what vLLM and the scheduler get ----------------------------------------

    def take_released(self) -> set[str]:
        if self.stores is not None:
            self.stores.settle()
        return self.outcome.take_released()

    def take_received(self, wait_s: float = 0.0) -> set[str]:
        """Requests whose fetch ended (for vLLM's finished_recving); their unfilled
        blocks go to take_load_errors, their counts to take_report. ``wait_s`` > 0
        (a step in which nothing computes): first wait up to that long for a pending
        fetch to finish (tiers/worker/l3_io.py ``wait_results``)."""
        results, waited = self.l3.take_results(wait_s)
        if waited:
            self.stats.idle_fetch_waits += 1
        if self.fetches is not None:
            self.fetches.on_results(results)
        return self.outcome.take_received()

    def take_failed_recving(self) -> set[str]:
        """Requests (several KV-cache groups only) whose asynchronous load failed:
        vLLM recomputes them; each was also reported received."""
        return self.outcome.take_failed_recv()

    def take_load_errors(self) -> set[int]:
        errors = self.outcome.take_load_errors()
        self.stats.load_errors += len(errors)
        return errors

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
        """This step's report (report.py; None: nothing changed)."""
        return self._reporter.take(self.outcome, self.stats, self.counters(), self.gauges(),
                                   self.l3.take_backed_up(), self.l3.changes)

    def shutdown(self) -> None:
        if self.stores is not None:
            self.stores.settle_all()
        if self.copies is not None:
            self.copies.pipeline.shutdown()
        self.l3.shutdown()
        if self.copies is not None:
            self.copies.pool.close()
