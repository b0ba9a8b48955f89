"""connector/vllm_shape.py on a real engine: a bad key stops the start, named."""

from __future__ import annotations

import pytest

from hicache.tiers.config import HiCacheConfigError


@pytest.mark.engine
def test_bad_config_fails_engine_start_naming_the_key(tiny_model):
    """On a real (in-process) engine, the error reaches the caller as ours."""
    from hicache.integration.vllm.engine import EngineSpec, open_llm

    with pytest.raises(HiCacheConfigError, match=r"hicache_write_policy='write_sideways'.*"
                       r"allowed values: \['write_through', "):
        open_llm(EngineSpec(model=tiny_model, hicache={"hicache_write_policy": "write_sideways"},
                            num_blocks=80, max_model_len=2048, in_process=True))
