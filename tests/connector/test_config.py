"""Config parsing: every bad key or value names the key and what is allowed."""

import pytest

from hicache.connector.config import HiCacheConfig, HiCacheConfigError


def test_defaults_need_no_keys():
    cfg = HiCacheConfig.from_extra_config({})
    assert cfg == HiCacheConfig.from_extra_config(None)
    assert cfg.hicache_ratio == 2.0 and cfg.hicache_size == 0.0
    assert cfg.hicache_write_policy == "write_through"
    assert cfg.resolved_page_size(128) == 128


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(HiCacheConfigError) as err:
        HiCacheConfig.from_extra_config({"hicache_ratoi": 3})
    msg = str(err.value)
    assert "hicache_ratoi" in msg and "hicache_ratio" in msg and "page_size" in msg


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("hicache_write_policy", "write_sideways",
         "['write_through', 'write_through_selective', 'write_back']"),
        ("hicache_write_through_threshold", 0, "positive integer"),
        ("hicache_mem_layout", "page_last", "['layer_first', 'page_first', 'page_first_direct']"),
        ("hicache_io_backend", "dma", "['kernel', 'direct']"),
        ("hicache_load_failure_policy", "ignore", "['recompute', 'fail']"),
        ("page_size", 0, "positive integer"),
        ("page_size", True, "positive integer"),
        ("page_size", "64", "positive integer"),
        ("hicache_ratio", -1, "> 0"),
        ("hicache_ratio", "2", "number"),
        ("hicache_size", -0.5, ">= 0"),
    ],
)
def test_bad_values_name_key_and_allowed(key, value, expect):
    with pytest.raises(HiCacheConfigError) as err:
        HiCacheConfig.from_extra_config({key: value})
    assert key in str(err.value) and expect in str(err.value)


@pytest.mark.parametrize(
    ("layout", "io", "cuda", "expect"),
    [
        ("page_first", "kernel", False, ("page_first", "direct")),
        ("page_first", "kernel", True, ("page_first", "kernel")),
        ("page_first", "direct", True, ("page_first_direct", "direct")),
        ("page_first", "direct", False, ("page_first", "direct")),
        ("page_first_direct", "kernel", True, ("page_first_direct", "direct")),
        ("layer_first", "kernel", True, ("layer_first", "kernel")),
        ("layer_first", "direct", False, ("layer_first", "direct")),
    ],
)
def test_sglang_compatibility_rules(layout, io, cuda, expect):
    cfg = HiCacheConfig.from_extra_config({"hicache_mem_layout": layout, "hicache_io_backend": io})
    got_layout, got_io, notes = cfg.resolved_data_plane(cuda=cuda)
    assert (got_layout, got_io) == expect
    assert bool(notes) == ((got_layout, got_io) != (layout, io))


def test_page_size_must_be_block_multiple():
    cfg = HiCacheConfig.from_extra_config({"page_size": 96})
    assert cfg.resolved_page_size(32) == 96
    with pytest.raises(HiCacheConfigError, match="multiple of vLLM's block size 64"):
        cfg.resolved_page_size(64)


@pytest.mark.engine
def test_bad_config_fails_engine_start_naming_the_key(tiny_model):
    """On a real (in-process) engine, the error reaches the caller as ours."""
    from hicache.integration.vllm.engine import EngineSpec, open_llm

    with pytest.raises(HiCacheConfigError, match=r"hicache_write_policy='write_sideways'.*"
                       r"allowed values: \['write_through', "):
        open_llm(EngineSpec(model=tiny_model, hicache={"hicache_write_policy": "write_sideways"},
                            num_blocks=80, max_model_len=2048, in_process=True))
