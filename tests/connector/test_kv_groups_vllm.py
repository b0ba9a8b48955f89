"""vLLM's KV-cache groups as the connector reads them (vLLM's own spec classes, no engine).

A Gemma-3-style hybrid config gives window groups and a full group; the pool
counts every group's layers and sizes a ratio budget from the engine's real
tensors (which the groups share); a Mamba group is a state group, "aligned"
with vLLM's own prefix caching on.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from hicache.connector.vllm_shape import kv_groups, pool_geometry
from hicache.tiers.config import HiCacheConfig, HiCacheConfigError
from hicache.tiers.index.kv_groups import KVGroup

BLOCK = 32
NUM_BLOCKS = 100


def _attn(cls, **kw):
    return cls(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32, **kw)


def _config(specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


def test_gemma3_style_groups():
    config = _config([_attn(SlidingWindowSpec, sliding_window=384)] * 5 + [_attn(FullAttentionSpec)])
    groups = kv_groups(config)
    assert groups.groups == (KVGroup("window", 384, 1),) * 5 + (KVGroup("full", 0, 1),)
    geometry = pool_geometry(config, HiCacheConfig.from_extra_config({"hicache_ratio": 2.0}), 1)
    page = config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    assert geometry.num_layers == 6 and geometry.page_bytes == 6 * page
    # Ratio of the engine's real bytes (the hybrid allocator gives one layer of
    # each group one shared tensor), not 6 layers' worth.
    assert geometry.num_slots == 2 * NUM_BLOCKS * page // (6 * page)


def _mamba(mode: str) -> MambaSpec:
    return MambaSpec(block_size=2048, shapes=((4, 16), (2, 8, 8)),
                     dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode,
                     page_size_padded=_attn(FullAttentionSpec).page_size_bytes)


def test_a_mamba_group_is_a_state_group():
    groups = kv_groups(_config([_mamba("none"), _attn(FullAttentionSpec), _mamba("none")]))
    assert [g.kind for g in groups.groups] == ["state", "full", "state"]


def test_mamba_with_vllms_prefix_caching_is_an_aligned_state_group():
    groups = kv_groups(_config([_attn(FullAttentionSpec), _mamba("align")]))
    assert groups.groups == (KVGroup("full"), KVGroup("state", aligned=True))
    assert groups.aligned
    # Policies that store pages after vLLM's hand-off of their states are refused.
    for policy in ("write_back", "write_through_selective"):
        with pytest.raises(HiCacheConfigError, match=rf"hicache_write_policy '{policy}'.*"
                                                     r"allowed here: 'write_through'"):
            HiCacheConfig.from_extra_config({"hicache_write_policy": policy}).check_groups(
                groups)
    HiCacheConfig.from_extra_config({}).check_groups(groups)
    # Without vLLM's prefix caching every policy stays.
    none = kv_groups(_config([_attn(FullAttentionSpec), _mamba("none")]))
    HiCacheConfig.from_extra_config({"hicache_write_policy": "write_back"}).check_groups(none)


def test_an_unknown_mamba_cache_mode_is_refused_naming_the_allowed_ones():
    spec = _mamba("none")
    object.__setattr__(spec, "mamba_cache_mode", "all")  # a mode this vLLM does not have
    with pytest.raises(HiCacheConfigError, match=r"'align'.*'none'.*\['all'\]"):
        kv_groups(_config([_attn(FullAttentionSpec), spec]))
