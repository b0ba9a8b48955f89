"""vLLM's config read once into the cache's ``EngineShape`` (tiers/engine_shape.py), and the checks that refuse an engine the cache cannot serve.

Contract:
- ``engine_shape(vllm_config, kv_cache_config, config)`` is the one place
  that reads vLLM's engine configuration: KV-cache groups, block and page
  sizes, TP size, MLA, the pool geometry, the key namespace and the data
  plane. An engine the cache cannot serve raises ``HiCacheConfigError``
  naming what to change.
- ``apply_load_failure_policy`` makes vLLM's scheduler apply HiCache's load
  failure policy, alone or inside ``MultiConnector``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from hicache.connector.vllm_keys import key_namespace
from hicache.tiers.config import HiCacheConfig, HiCacheConfigError, LoadFailurePolicyName
from hicache.tiers.engine_shape import EngineShape
from hicache.tiers.index.kv_groups import KVGroup, KVGroups
from hicache.tiers.l2.host_pool import PoolGeometry

if TYPE_CHECKING:
    from types import FrameType

    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def engine_shape(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: HiCacheConfig) -> EngineShape:
    """The engine as the cache sees it; the same on the scheduler and every worker."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    groups = kv_groups(kv_cache_config)
    config.check_groups(groups)
    # The attention block (vLLM may enlarge it so attention pages match a Mamba state's).
    block_size = next(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups
                      if not isinstance(g.kv_cache_spec, MambaSpec))
    page_size = config.resolved_page_size(block_size)
    if groups.hybrid and not hasattr(KVConnectorBase_V1, "get_transfer_results"):
        # Several groups: a failed load can only go back per request (failed_recving),
        # which older vLLMs do not offer; refuse rather than risk serving it.
        raise HiCacheConfigError(
            "HiCacheConnector with vLLM's hybrid KV cache manager needs a vLLM whose "
            "connectors report failed loads per request (get_transfer_results); with "
            "this vLLM run with --disable-hybrid-kv-cache-manager")
    layout, io_backend, notes = config.resolved_data_plane(
        cuda=current_platform.device_type == "cuda")
    return EngineShape(
        model=str(vllm_config.model_config.model), page_size=page_size,
        block_size=block_size, tp_size=vllm_config.parallel_config.tensor_parallel_size,
        is_mla=isinstance(kv_cache_config.kv_cache_groups[0].kv_cache_spec, MLAAttentionSpec),
        groups=groups,
        geometry=pool_geometry(kv_cache_config, config, page_size // block_size, groups),
        namespace=key_namespace(vllm_config, kv_cache_config, page_size),
        mem_layout=layout, io_backend=io_backend, notes=tuple(notes),
        async_stores=config.hicache_async_stores and not groups.windowed,
        l1_num_blocks=kv_cache_config.num_blocks)


def kv_groups(kv_cache_config: KVCacheConfig) -> KVGroups:
    """The engine's KV-cache groups as the cache sees them (tiers/index/kv_groups.py).

    Every attention group must have one block size, and every group one block
    byte size (vLLM's hybrid manager makes them so). A Mamba / linear-attention
    state group (``MambaSpec``) needs vLLM's "none" Mamba cache mode (its prefix
    caching off: one state block per request) or "align" (a state per block);
    other kinds are refused, naming them."""
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
    if modes - {"none", "align"} or len(modes) > 1:
        raise HiCacheConfigError(
            f"HiCacheConnector with Mamba / linear-attention layers: mamba_cache_mode "
            f"must be one of 'align' (prefix caching on), 'none' (off); this engine: "
            f"{sorted(modes)}")
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
            out.append(KVGroup("state", 0, layers, spec.mamba_cache_mode == "align"))
        elif isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            out.append(KVGroup("window", window, layers))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            out.append(KVGroup("window", spec.attention_chunk_size, layers))
        else:
            out.append(KVGroup("full", 0, layers))
    return KVGroups(tuple(out))


def pool_geometry(kv_cache_config: KVCacheConfig, config: HiCacheConfig, blocks_per_page: int,
                  groups: KVGroups | None = None) -> PoolGeometry:
    """L2 geometry from the engine's KV-cache config; the same on scheduler and workers.
    A page holds every layer of every group; the ratio budget is taken of the engine's
    real KV bytes: the hybrid allocator gives a block of every group's layer i one
    tensor, so the engine holds as many layers' blocks as its largest group."""
    groups = groups or kv_groups(kv_cache_config)
    block_bytes = kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    blocks = kv_cache_config.num_blocks
    return PoolGeometry.for_budget(
        num_layers=groups.num_layers, blocks_per_page=blocks_per_page,
        block_bytes=block_bytes, l1_num_blocks=blocks, hicache_size_gb=config.hicache_size,
        hicache_ratio=config.hicache_ratio,
        l1_bytes=blocks * block_bytes * max(g.num_layers for g in groups.groups))


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
