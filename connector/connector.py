"""``HiCacheConnector``: the vLLM KV connector class, translating vLLM's API to our halves.

See DESIGN.md "Processes and threads" and "Flow of one request".

vLLM builds it twice: with role SCHEDULER in the engine-core process (owns
``HiCacheScheduler``: tree, slots, plans) and with role WORKER in each worker
process (owns ``HiCacheWorker``: host pool bytes, copies). This module only
translates; decisions live in tiers/controller/, data movement in worker.py.

Supported: attention KV-cache groups (full attention MHA/GQA, MLA, sliding
window, chunked local), synchronous L2 loads, asynchronous L3 loads
(``load_async``), write-through / selective / write-back stores, L3 backups
of every complete page stored in L2, tensor parallelism (every rank applies
the same plan to its shard; MLA pages are written to L3 by rank 0 only),
composition inside vLLM's ``MultiConnector``. The class is ``SupportsHMA``:
vLLM keeps its hybrid KV-cache manager on, and a sliding-window + full
attention model gets one KV-cache group per layer kind; a page then holds
every group's blocks (tiers/index/kv_groups.py) and every hit is
asynchronous (see tiers/controller/scheduler.py). Mamba / linear-attention
state groups (vLLM's prefix caching off, its "none" Mamba cache mode) get a
state checkpoint in pages that end where a step ended; L3 holds every
page's body and the checkpointed pages whole (tiers/controller/fetches.py).
Pipeline parallelism is not supported.

A request's ``kv_transfer_params["hicache"]`` carry its cache controls
(tiers/controller/hints.py). Every finished request's ``kv_transfer_params`` carry
``{"hicache": {"cached_tokens": {"l1", "l2", "l3"}}}``: the prompt tokens vLLM's prefix
cache, L2 and L3 served at its first admission, which add up to the ``cached_tokens``
vLLM reports in ``usage``, and ``"error"`` when its controls were bad (then ignored).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any, get_args

import torch
from pydantic import SecretStr
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hicache.connector.config import (
    PREFETCH_KEYS,
    HiCacheConfig,
    HiCacheConfigError,
    LoadFailurePolicyName,
)
from hicache.connector.metadata import HiCacheStepMetadata, HiCacheWorkerReport
from hicache.connector.vllm_events import kv_events_enabled, to_vllm
from hicache.connector.vllm_keys import (
    PageHashes,
    VllmPrefixHasher,
    check_stable_hashes,
    hash_block_size,
    key_namespace,
)
from hicache.connector.vllm_metrics import HiCacheKVStats, HiCachePromMetrics, l3_source
from hicache.connector.worker import HiCacheWorker
from hicache.tiers.controller.admin import SchedulerAdmin
from hicache.tiers.controller.hints import HINTS_KEY
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.kv_groups import GroupBlockIds, KVGroup, KVGroups
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageBackend, StorageConfig, StorageConfigError
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.io_thread import IDLE_WAIT_S
from hicache.tiers.l3.rank_shards import RankShards

if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import FrameType

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
            self._kv_transfer_config.kv_connector_extra_config
        )
        groups = kv_groups(kv_cache_config)
        # The attention groups' block (vLLM may enlarge the configured one so that
        # attention pages match a Mamba state's size).
        block_size = next(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
                          if not _is_state(g.kv_cache_spec))
        page_size = self.config.resolved_page_size(block_size)
        if groups.hybrid and not hasattr(KVConnectorBase_V1, "get_transfer_results"):
            # Several groups: a failed load can only go back per request
            # (failed_recving), which older vLLMs do not offer; refuse rather
            # than risk serving a request whose load failed.
            raise HiCacheConfigError(
                "HiCacheConnector with vLLM's hybrid KV cache manager needs a vLLM whose "
                "connectors report failed loads per request (get_transfer_results); with "
                "this vLLM run with --disable-hybrid-kv-cache-manager")
        geometry = pool_geometry(kv_cache_config, self.config, page_size // block_size, groups)
        self._scheduler: HiCacheScheduler | None = None
        self._worker: HiCacheWorker | None = None
        self._admin: SchedulerAdmin | None = None
        # Scheduler side: the workers' reported counters and latencies not yet
        # handed to vLLM (see connector/vllm_metrics.py).
        self._kv_stats = HiCacheKVStats()
        self._admin_server: Any = None
        namespace = key_namespace(vllm_config, kv_cache_config, page_size)
        layout, io_backend, notes = self.config.resolved_data_plane(cuda=_on_cuda())
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        is_mla = _is_mla(kv_cache_config)
        # Stores across steps need blocks that stay put while a request runs:
        # sliding-window blocks are freed and Mamba state blocks rewritten.
        async_stores = self.config.hicache_async_stores and not groups.windowed

        def build_storage(tp_rank: int, name: str, extra: dict[str, Any]) -> StorageBackend:
            """This rank's L3 backend ``name`` with backend settings ``extra``."""
            return create_backend(name, StorageConfig(
                tp_rank=tp_rank, tp_size=tp_size, namespace=namespace.fingerprint(),
                mem_layout=layout, page_bytes=geometry.page_bytes, is_mla=is_mla,
                model_name=str(vllm_config.model_config.model), extra_config=extra,
            ))

        def build_lookup(name: str, extra: dict[str, Any]) -> StorageBackend | RankShards:
            """The scheduler's L3 view: every rank's shard (one shared shard for MLA)."""
            if is_mla or tp_size == 1:
                return build_storage(0, name, extra)
            return RankShards([build_storage(r, name, extra) for r in range(tp_size)])

        if role == KVConnectorRole.SCHEDULER:
            check_stable_hashes(vllm_config, self.config.hicache_storage_backend is not None)
            apply_load_failure_policy(self._kv_transfer_config,
                                      self.config.hicache_load_failure_policy)
            hashed_block = hash_block_size(kv_cache_config, block_size)
            self._page_hashes: PageHashes | None = None
            if page_size % hashed_block:
                # vLLM hashes coarser than a page (Mamba without its prefix
                # caching): hash each request per page ourselves.
                hashed_block = page_size
                self._page_hashes = PageHashes(vllm_config, page_size)
            self._prefix_hasher = VllmPrefixHasher(vllm_config, hashed_block)
            self._scheduler = HiCacheScheduler(
                geometry=geometry,
                namespace=namespace,
                page_size=page_size,
                block_size=block_size,
                block_ids_of=self._block_ids_of,
                write_policy=self.config.hicache_write_policy,
                write_threshold=self.config.hicache_write_through_threshold,
                storage=self._scheduler_storage(build_lookup),
                prefetch_policy=self.config.hicache_storage_prefetch_policy,
                prefetch={k: self.config.prefetch_setting(k) for k in PREFETCH_KEYS},
                tp_size=tp_size,
                hash_block_size=hashed_block,
                prefix_hasher=self._prefix_hasher,
                groups=groups,
                background_lookups=True,
                prefetch_at_arrival=self.config.hicache_prefetch_at_arrival,
                kv_events=kv_events_enabled(vllm_config),
                async_stores=async_stores,
                l3_writers=1 if is_mla else tp_size,
                retain_max_share=self.config.hicache_retain_max_share,
            )
            logger.info(
                "HiCache scheduler: page_size=%d tokens, L2 = %d pages (%.2f GiB per rank), "
                "KV-cache groups %s, config %s", page_size, geometry.num_slots,
                geometry.buffer_bytes / 2**30, describe_groups(groups), self.config.to_dict(),
            )

            if groups.windowed and self.config.hicache_write_policy == "write_back":
                logger.warning(
                    "HiCache: write_back on a sliding-window model stores the window's "
                    "layers only for the pages still inside the window when a request "
                    "finishes (vLLM has replaced the others with its null block): its "
                    "history returns whole, branches from its head do not; use "
                    "write_through to cache every point of a history")

            self._admin = SchedulerAdmin(
                self._scheduler, self.config, build_storage=build_lookup,
                l1_pages=kv_cache_config.num_blocks // (page_size // block_size),
                engine={"model": str(vllm_config.model_config.model), "page_size": page_size,
                        "block_size": block_size, "tp_size": tp_size,
                        "l2_pages": geometry.num_slots, "page_bytes": geometry.page_bytes,
                        "mem_layout": layout, "io_backend": io_backend},
            )
            self._start_admin(vllm_config)
        else:
            for note in notes:
                logger.info("HiCache: %s", note)
            backend_name = self.config.hicache_storage_backend

            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = HiCacheWorker(
                geometry, kv_cache_config.num_blocks, layout=layout, io=io_backend,
                storage_builder=functools.partial(build_storage, rank),
                storage_spec=(backend_name, self.config.backend_extra_config())
                if backend_name else None,
                # MLA's latent pages are the same on every rank: rank 0 writes them.
                l3_writer=not is_mla or rank == 0,
                group_layer_names=[list(g.layer_names) for g in kv_cache_config.kv_cache_groups],
                rank=rank,
                async_stores=async_stores,
            )

    def _start_admin(self, vllm_config: VllmConfig) -> None:
        """The admin endpoint, in this (engine-core) process; a failure only logs."""
        port = self.config.hicache_admin_port
        if not port or self._admin is None:
            return
        from hicache.integration.admin.server import AdminServer

        port += vllm_config.parallel_config.data_parallel_rank or 0
        token = self.config.hicache_admin_token
        if token is None and os.environ.get("HICACHE_ADMIN_TOKEN"):
            token = SecretStr(os.environ["HICACHE_ADMIN_TOKEN"])
        server = AdminServer(self._admin, token)
        try:
            server.start(self.config.hicache_admin_host, port)
        except Exception:  # noqa: BLE001 - the cache serves without its admin endpoint
            logger.exception("HiCache: admin endpoint not started on %s:%d",
                             self.config.hicache_admin_host, port)
            return
        self._admin_server = server
        logger.info("HiCache admin endpoint on http://%s:%d (token %s)",
                    self.config.hicache_admin_host, server.port,
                    "set" if token else "not set: POST endpoints refuse")

    def _scheduler_storage(self, build: Any) -> StorageBackend | None:
        """The scheduler's own backend instance (lookups only); None without L3.

        Bad configuration stops the engine here, at start; an unreachable
        store only turns L3 off (logged): the engine serves from L1/L2.
        """
        name = self.config.hicache_storage_backend
        if name is None:
            return None
        try:
            backend = build(name, self.config.backend_extra_config())
        except StorageConfigError as exc:
            raise HiCacheConfigError(str(exc)) from exc
        except Exception:  # noqa: BLE001
            logger.exception("HiCache: L3 backend %r unavailable; serving without L3", name)
            return None
        logger.info("HiCache L3: %s backend, prefetch policy %s", name,
                    self.config.hicache_storage_prefetch_policy)
        return backend

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
        with self.hicache_scheduler.lock:
            plan = self.hicache_scheduler.build_connector_meta(
                scheduler_output.num_scheduled_tokens,
                getattr(scheduler_output, "preempted_req_ids", None) or (),
            )
        if self._admin is not None:
            plan.storage_commands = [*plan.storage_commands, *self._admin.take_commands()]
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
            cached = self.hicache_scheduler.cached_tokens_of(request.request_id)
            error = self.hicache_scheduler.hint_error_of(request.request_id)
            done = self.hicache_scheduler.request_finished(self._keyed(request), block_ids)
            retained = self.hicache_scheduler.take_retained(request.request_id)
        if self._page_hashes is not None:
            self._page_hashes.forget(request.request_id)
        reply: dict[str, Any] = {}
        if cached is not None:
            reply["cached_tokens"] = tiers = cached.as_dict()
            observations = {f"request_cached_tokens_{tier}": [float(n)]
                            for tier, n in tiers.items()}
            self._kv_stats.record({}, observations)
            if self._admin is not None:
                self._admin.record_observations(observations)
        if isinstance(retained, int):
            reply["retained_pages"] = retained
        elif retained is not None:
            error = retained if error is None else f"{error}; {retained}"
        if error is not None:
            reply["error"] = error
        # Where the request's cached tokens came from, and why its hints were
        # ignored, in its response's kv_transfer_params (MultiConnector merges ours
        # with other connectors').
        return done, ({HINTS_KEY: reply} if reply else None)

    def _keyed(self, request: Request) -> Any:
        """The request as the scheduler keys it: vLLM's own, or with per-page hashes."""
        return request if self._page_hashes is None else self._page_hashes.view(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_stores()

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

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: finish the stores that read a preempted request's
        blocks, which this forward pass may reuse."""
        if isinstance(kv_connector_metadata, HiCacheStepMetadata):
            self.hicache_worker.handle_preemptions(kv_connector_metadata)

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
        if self._admin_server is not None:
            self._admin_server.stop()
            self._admin_server = None
        if self._scheduler is not None and self._scheduler.fetches.probes is not None:
            self._scheduler.fetches.probes.close()
        if self._scheduler is not None and self._scheduler.storage is not None:
            self._scheduler.storage.close()

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
        return self.hicache_worker.take_report()


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.device_type == "cuda"


def kv_groups(kv_cache_config: KVCacheConfig) -> KVGroups:
    """The engine's KV-cache groups as the cache sees them (tiers/index/kv_groups.py).

    Every attention group must have one block size, and every group one block
    byte size (vLLM's hybrid manager makes them so). A Mamba / linear-attention
    state group (``MambaSpec``) needs vLLM's "none" Mamba cache mode (its prefix
    caching off: one state block per request); other kinds are refused,
    naming them."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    names = [type(spec).__name__ for spec in specs]
    if not all(isinstance(spec, (AttentionSpec, MambaSpec)) for spec in specs) or \
            not any(isinstance(spec, AttentionSpec) for spec in specs):
        raise HiCacheConfigError(
            f"HiCacheConnector caches attention KV and Mamba states next to it; this "
            f"model's KV cache groups are {names}")
    modes = {str(getattr(s, "mamba_cache_mode", "none")) for s in specs
             if isinstance(s, MambaSpec)}
    if modes - {"none"}:
        raise HiCacheConfigError(
            f"HiCacheConnector with Mamba / linear-attention layers needs vLLM's prefix "
            f"caching off (mamba_cache_mode 'none'; this engine: {sorted(modes)}): run with "
            f"--no-enable-prefix-caching, HiCache is then the prefix cache")
    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    if len({spec.page_size_bytes for spec in specs}) > 1 or \
            len({spec.block_size for spec in attention}) > 1:
        raise HiCacheConfigError(
            f"HiCacheConnector needs one attention block size and one block byte size "
            f"over all KV cache groups; this engine's groups {names} have block sizes "
            f"{[s.block_size for s in specs]} and {[s.page_size_bytes for s in specs]} bytes")
    out: list[KVGroup] = []
    for group, spec in zip(groups, specs, strict=True):
        layers = len(group.layer_names)
        if isinstance(spec, MambaSpec):
            out.append(KVGroup("state", 0, layers))
        elif isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            out.append(KVGroup("window", window, layers))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(KVGroup("window", spec.attention_chunk_size, layers))
        else:
            out.append(KVGroup("full", 0, layers))
    return KVGroups(tuple(out))


def describe_groups(groups: KVGroups) -> str:
    """``full x1, window(384) x5`` for the log."""
    return ", ".join(
        f"{g.kind}{f'({g.window})' if g.kind == 'window' else ''} x{g.num_layers}"
        for g in groups.groups)


def pool_geometry(
    kv_cache_config: KVCacheConfig, config: HiCacheConfig, blocks_per_page: int,
    groups: KVGroups | None = None,
) -> PoolGeometry:
    """L2 geometry from the engine's KV-cache config; the same on scheduler and workers.

    A page holds every layer of every group; the ratio budget is taken of the
    engine's real KV bytes (groups of the hybrid manager share tensors)."""
    groups = groups or kv_groups(kv_cache_config)
    block_bytes = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    # The hybrid allocator gives a block of every group's layer i the same
    # tensor: the engine holds as many layers' blocks as its largest group.
    l1_bytes = (kv_cache_config.num_blocks * block_bytes
                * max(g.num_layers for g in groups.groups))
    return PoolGeometry.for_budget(
        num_layers=groups.num_layers,
        blocks_per_page=blocks_per_page,
        block_bytes=block_bytes,
        l1_num_blocks=kv_cache_config.num_blocks,
        hicache_size_gb=config.hicache_size,
        hicache_ratio=config.hicache_ratio,
        l1_bytes=l1_bytes,
    )


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _is_mla(kv_cache_config: KVCacheConfig) -> bool:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return isinstance(kv_cache_config.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec)


def apply_load_failure_policy(own: Any, policy: str) -> None:
    """Make vLLM's scheduler apply ``policy`` to HiCache's failed loads.

    vLLM reads ``kv_load_failure_policy`` from the top-level kv-transfer
    config right after building the scheduler-side connector. Alone, HiCache
    sets it there. Inside ``MultiConnector`` HiCache gets a copy of its own
    child entry, which vLLM never reads: then the top-level value must already
    be ``policy``, else the engine stops here naming the key to set (changing
    it silently would change the other connectors' failure semantics too).
    """
    parent = _enclosing_multi_connector_config()
    if parent is None:
        own.kv_load_failure_policy = policy
        return
    if parent.kv_load_failure_policy != policy:
        raise HiCacheConfigError(
            f"HiCacheConnector inside MultiConnector: vLLM applies the top-level "
            f"kv_load_failure_policy ({parent.kv_load_failure_policy!r}) to every child, "
            f"and HiCache's hicache_load_failure_policy is {policy!r}. Set "
            f'"kv_load_failure_policy": "{policy}" at the top level of --kv-transfer-config '
            f"(next to \"kv_connector\": \"MultiConnector\"), or set "
            f"hicache_load_failure_policy to {parent.kv_load_failure_policy!r}; allowed "
            f"values: {', '.join(get_args(LoadFailurePolicyName))}"
        )
    own.kv_load_failure_policy = policy


def _enclosing_multi_connector_config() -> Any:
    """The MultiConnector's kv-transfer config when it is building this connector, else None.

    vLLM 0.32/0.33's MultiConnector builds each child inside its own
    ``__init__`` with a copy of the engine config and no link back; the
    caller's frame is the only place the top-level config is visible.
    """
    import sys

    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    frame: FrameType | None = sys._getframe(1).f_back
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, MultiConnector):
            return owner._vllm_config.kv_transfer_config
        frame = frame.f_back
    return None
