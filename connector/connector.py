"""``HiCacheConnector``: the vLLM KV connector class, translating vLLM's API to our halves.

See DESIGN.md "Processes and threads" and "Flow of one request".

vLLM builds it twice: with role SCHEDULER in the engine-core process (owns ``HiCacheScheduler``:
tree, slots, plans) and with role WORKER in each worker process (owns ``HiCacheWorker``: host pool
bytes, copies). This module only translates: vLLM's config is read once (vllm_shape.py),
decisions live in tiers/controller/, data movement in tiers/worker/.

Supported (DESIGN.md "Hybrid models"): attention KV-cache groups (MHA/GQA, MLA, sliding window,
chunked local) and Mamba state groups as ``SupportsHMA`` (tiers/index/kv_groups.py), synchronous
L2 and asynchronous L3 loads, tensor parallelism (each rank applies the same plan to its shard;
MLA pages reach L3 from rank 0), vLLM's ``MultiConnector``. Pipeline parallelism is not supported.

A request's ``kv_transfer_params["hicache"]`` carry its cache controls (tiers/controller/hints.py).
A finished request's carry ``{"hicache": {"cached_tokens": {"l1", "l2", "l3"}}}``: the prompt
tokens vLLM's prefix cache, L2 and L3 served at its first admission (summing to the
``cached_tokens`` in ``usage``), and ``"error"`` when its controls were bad (then ignored).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.connector import gc_heap
from hicache.connector.metadata import HiCacheStepMetadata, HiCacheWorkerReport
from hicache.connector.profile import instrument
from hicache.connector.vllm_events import kv_events_enabled, to_vllm
from hicache.connector.vllm_keys import (
    PageHashes,
    VllmPrefixHasher,
    check_stable_hashes,
    hash_block_size,
)
from hicache.connector.vllm_metrics import HiCacheKVStats, HiCachePromMetrics, l3_source
from hicache.connector.vllm_shape import apply_load_failure_policy, engine_shape
from hicache.connector.vllm_wake import EngineWake
from hicache.tiers.config import HiCacheConfig, HiCacheConfigError
from hicache.tiers.controller.admin import SchedulerAdmin
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.kv_groups import GroupBlockIds
from hicache.tiers.worker.core import HiCacheWorker
from hicache.tiers.worker.l3_io import IDLE_WAIT_S

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """Hierarchical KV cache for vLLM: L1 = vLLM's KV cache, L2 = host DRAM pool."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        if kv_cache_config is None:
            raise HiCacheConfigError("HiCacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = HiCacheConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.shape = engine_shape(vllm_config, kv_cache_config, self.config)
        self._scheduler: HiCacheScheduler | None = None
        self._worker: HiCacheWorker | None = None
        self._admin: SchedulerAdmin | None = None
        # Scheduler side: the workers' reported counters and latencies not yet
        # handed to vLLM (see connector/vllm_metrics.py).
        self._kv_stats = HiCacheKVStats()
        self._admin_server: Any = None
        self._froze_gc = False  # this worker froze its process's GC heap (gc_heap.py)
        if role == KVConnectorRole.SCHEDULER:
            self._start_scheduler(vllm_config, kv_cache_config)
        else:
            self._start_worker([list(g.layer_names) for g in kv_cache_config.kv_cache_groups])
        # HICACHE_PROFILE: one JSON line per step (tiers/profile.py).
        instrument(self, "scheduler" if role == KVConnectorRole.SCHEDULER else "worker")

    def _start_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        config, shape = self.config, self.shape
        check_stable_hashes(vllm_config, config.hicache_storage_backend is not None)
        apply_load_failure_policy(self._kv_transfer_config, config.hicache_load_failure_policy)
        hashed_block = hash_block_size(kv_cache_config, shape.block_size)
        self._page_hashes: PageHashes | None = None
        if shape.page_size % hashed_block:
            # vLLM hashes coarser than a page (Mamba without its prefix caching):
            # hash each request per page ourselves.
            hashed_block = shape.page_size
            self._page_hashes = PageHashes(vllm_config, shape.page_size)
        self._prefix_hasher = VllmPrefixHasher(vllm_config, hashed_block)
        self._scheduler = HiCacheScheduler.for_engine(
            shape, config, storage=shape.scheduler_storage(config),
            block_ids_of=self._block_ids_of, prefix_hasher=self._prefix_hasher,
            hash_block_size=hashed_block, kv_events=kv_events_enabled(vllm_config))
        # Admin work for the workers (a prefetch, an L3 command) wakes an idle engine
        # core, which then steps while has_pending_push_work() says so (vllm_wake.py).
        self._wake = EngineWake.find()
        self._admin = SchedulerAdmin(self._scheduler, config, build_storage=shape.lookup,
                                     l1_pages=shape.l1_pages, engine=shape.info(),
                                     wake=self._wake.wake)
        if config.hicache_admin_port:
            from hicache.integration.admin.server import serve_admin

            self._admin_server = serve_admin(
                self._admin, config, vllm_config.parallel_config.data_parallel_rank or 0)

    def _start_worker(self, group_layer_names: list[list[str]]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        shape, backend = self.shape, self.config.hicache_storage_backend
        for note in shape.notes:
            logger.info("HiCache: %s", note)
        rank = get_tensor_model_parallel_rank()
        self._worker = HiCacheWorker(
            shape.geometry, shape.l1_num_blocks, layout=shape.mem_layout,
            io=shape.io_backend, rank=rank, async_stores=shape.async_stores,
            helper_cpus=self.config.hicache_helper_cpus,
            storage_builder=lambda name, extra: shape.storage(rank, name, extra),
            storage_spec=(backend, self.config.backend_extra_config()) if backend else None,
            # MLA's latent pages are the same on every rank: rank 0 writes them.
            l3_writer=not shape.is_mla or rank == 0, group_layer_names=group_layer_names)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # The worker waits for each layer's load and starts each layer's save from
        # vLLM's per-layer attention hooks. A full CUDA graph replays attention
        # without calling them (loads not waited for, saves never started), so
        # vLLM must keep attention outside its graphs: PIECEWISE mode.
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM >= 0.33 asks; untested with our raw views of vLLM's KV tensors,
        # so vLLM refuses --enable-sleep-mode with HiCache rather than risk it.
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a preempted request simply recomputes.
        return False

    # ---- scheduler side -----------------------------------------------------

    @property
    def hicache_scheduler(self) -> HiCacheScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.lora_request is not None:
            self._prefix_hasher.lora_paths[request.lora_request.lora_name] = (
                request.lora_request.lora_path)
        with self.hicache_scheduler.lock:
            return self.hicache_scheduler.get_num_new_matched_tokens(self._keyed(request),
                                                                     num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        with self.hicache_scheduler.lock:
            self.hicache_scheduler.on_new_request(self._keyed(request))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids: GroupBlockIds = blocks.get_block_ids() if num_external_tokens else ()
        with self.hicache_scheduler.lock:
            self.hicache_scheduler.update_state_after_alloc(self._keyed(request), block_ids,
                                                            num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        with self.hicache_scheduler.lock:
            plan = self.hicache_scheduler.build_connector_meta(
                scheduler_output.num_scheduled_tokens,
                getattr(scheduler_output, "preempted_req_ids", None) or (),
                getattr(block_state, "boundary_state_offloads", None))  # Mamba "align" states
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        return HiCacheStepMetadata.wrap(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' merged report of a step: to the scheduler (bad slots, finished
        fetches), the admin view and vLLM's stats (counters, latencies)."""
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, HiCacheWorkerReport):
            with self.hicache_scheduler.lock:
                self.hicache_scheduler.on_worker_report(report)
            if self._admin is not None:
                self._admin.record_worker_report(report)
            self._kv_stats.record(report.counters, report.observations)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """L2's KV events (medium "CPU"), when vLLM publishes KV events."""
        with self.hicache_scheduler.lock:
            events = self.hicache_scheduler.take_events()
        return to_vllm(events) if events else ()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM without its hybrid manager (one group) may still call this."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self.hicache_scheduler.lock:
            done, params, observations = self.hicache_scheduler.finish_request(
                self._keyed(request), block_ids)
        if self._page_hashes is not None:
            self._page_hashes.forget(request.request_id)
        if observations:
            self._kv_stats.record({}, observations)
            if self._admin is not None:
                self._admin.record_observations(observations)
        # Where the request's cached tokens came from, and why its hints were ignored,
        # in its response's kv_transfer_params (MultiConnector merges ours with others').
        return done, params

    def _keyed(self, request: Request) -> Any:
        """The request as the scheduler keys it: vLLM's own, or with per-page hashes."""
        return request if self._page_hashes is None else self._page_hashes.view(request)

    def has_pending_push_work(self) -> bool:
        """True while the workers have HiCache work to receive or report (stores,
        fetches, prefetches, L3 commands): vLLM keeps stepping, idle or not."""
        if self._scheduler is None:
            return False
        with self._scheduler.lock:
            return self._scheduler.has_worker_work()

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache(reset_external=True): empty L2 (not the shared L3)."""
        with self.hicache_scheduler.lock:
            return self.hicache_scheduler.reset()

    def _block_ids_of(self, req_id: str) -> GroupBlockIds:
        assert self._kv_cache_manager is not None, "vLLM did not bind its KVCacheManager"
        return self._kv_cache_manager.get_block_ids(req_id)

    # ---- worker side --------------------------------------------------------

    @property
    def hicache_worker(self) -> HiCacheWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.hicache_worker.register_kv_caches(kv_caches)
        frozen = gc_heap.freeze_worker_heap(
            kv_caches, self._vllm_config.parallel_config.distributed_executor_backend)
        if frozen:
            self._froze_gc = True
            logger.info("HiCache: froze this CPU worker's GC heap after start (%d objects), "
                        "as vLLM's GPU workers do", frozen)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: finish the stores that read a preempted request's
        blocks, which this forward pass may reuse."""
        if isinstance(kv_connector_metadata, HiCacheStepMetadata):
            self.hicache_worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A new step's plan (once per step, before its loads): its storage commands
        are applied on this rank now."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, HiCacheStepMetadata):
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheStepMetadata)
        if meta.loads or meta.fetches:
            self.hicache_worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.hicache_worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheStepMetadata)
        self.hicache_worker.save_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HiCacheStepMetadata)
        self.hicache_worker.finish_step(meta)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._froze_gc:
            gc_heap.unfreeze()
            self._froze_gc = False
        if self._admin_server is not None:
            self._admin_server.stop()
            self._admin_server = None
        if self._admin is not None:
            self._admin.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        # With speculative decoding vLLM may call this before wait_for_save
        # (defer_finalize); the release then reaches vLLM one step later, and
        # vLLM keeps stepping while it holds a finished request's blocks.
        released = self.hicache_worker.take_released()
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, HiCacheStepMetadata) and meta.idle
        received = self.hicache_worker.take_received(IDLE_WAIT_S if idle else 0.0)
        return (released or None), (received or None)

    def get_kv_connector_stats(self) -> HiCacheKVStats | None:
        """Scheduler side: the reports recorded since vLLM last asked; workers report
        through ``build_connector_worker_meta`` only, so they return None here."""
        if self._scheduler is None or self._kv_stats.is_empty():
            return None
        stats, self._kv_stats = self._kv_stats, HiCacheKVStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiCacheKVStats:
        return HiCacheKVStats.from_payload(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: Any,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> HiCachePromMetrics:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """Cached tokens HiCache supplied, split by the tier that held them."""
        if num_external_tokens == 0:
            return {}
        with self.hicache_scheduler.lock:
            l3 = min(self.hicache_scheduler.l3_tokens_of(request.request_id), num_external_tokens)
        split = {CacheHitSource.HOST: num_external_tokens - l3,
                 l3_source(self._admin.storage_name if self._admin else None): l3}
        return {source: n for source, n in split.items() if n}

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished stores and loads, and (several KV-cache groups) the requests
        whose load failed, which vLLM then recomputes."""
        results = super().get_transfer_results(finished_req_ids)
        results.failed_recving = self.hicache_worker.take_failed_recving()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.hicache_worker.take_load_errors()

    def build_connector_worker_meta(self) -> HiCacheWorkerReport | None:
        report = self.hicache_worker.take_report()
        return None if report is None else HiCacheWorkerReport.wrap(report)


