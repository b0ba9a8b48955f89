"""Config parsing: every bad key or value names the key and what is allowed."""

import json
from typing import get_args

import pytest

from hicache.kernels import io_backend
from hicache.tiers.config import PREFETCH_KEYS, HiCacheConfig, HiCacheConfigError
from hicache.tiers.controller.policies import PREFETCH_POLICIES, WRITE_POLICIES
from hicache.tiers.l2.geometry import MemLayoutName
from hicache.tiers.l2.host_pool import LAYOUT_DIMS
from hicache.tiers.l3.factory import BACKENDS, STORAGE_BACKENDS


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
        ("hicache_storage_backend", "s3", "['file', 'mooncake', 'nixl', 'lmcache', 'dynamic']"),
        ("hicache_storage_prefetch_policy", "eager", "['best_effort', 'wait_complete', 'timeout']"),
        ("hicache_admin_port", 65536, "[0, 65535]"),
        ("hicache_admin_port", True, "[0, 65535]"),
        ("hicache_admin_host", "", "non-empty string"),
        ("hicache_storage_backend_extra_config", "{not json", "not valid JSON"),
        ("hicache_storage_backend_extra_config", [1], "JSON object"),
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


def test_every_bad_key_is_reported_at_once():
    with pytest.raises(HiCacheConfigError) as err:
        HiCacheConfig.from_extra_config({"hicache_ratoi": 3, "page_size": 0,
                                         "hicache_mem_layout": "page_last", "bogus": 1})
    msg = str(err.value)
    assert "['bogus', 'hicache_ratoi']" in msg
    assert "page_size must be a positive integer" in msg and "(got 0)" in msg
    assert "hicache_mem_layout='page_last' is not supported" in msg


def test_choices_come_from_where_they_are_implemented():
    """Each Literal lists what its implementation accepts, and nothing else."""
    fields = HiCacheConfig.model_fields
    assert get_args(fields["hicache_mem_layout"].annotation) == get_args(MemLayoutName)
    assert set(get_args(MemLayoutName)) == set(LAYOUT_DIMS)
    assert set(get_args(fields["hicache_write_policy"].annotation)) == set(WRITE_POLICIES)
    assert set(get_args(fields["hicache_storage_prefetch_policy"].annotation)) == \
        set(PREFETCH_POLICIES)
    assert set(STORAGE_BACKENDS) == {*BACKENDS, "dynamic"}
    for name in get_args(io_backend.IoBackendName):
        assert io_backend.select(name, "cpu") is not None
    with pytest.raises(ValueError, match="'kernel', 'direct'"):
        io_backend.select("dma", "cpu")


@pytest.mark.parametrize("as_json", [False, True])
def test_storage_extra_config_object_or_json_string(as_json):
    extra = {"path": "/mnt/kv", "prefetch_threshold": 128, "prefetch_timeout_max": 5}
    cfg = HiCacheConfig.from_extra_config({
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config": json.dumps(extra) if as_json else extra})
    assert cfg.backend_extra_config() == {"path": "/mnt/kv"}
    assert cfg.prefetch_setting("prefetch_threshold") == 128.0
    assert cfg.prefetch_setting("prefetch_timeout_max") == 5.0
    assert cfg.prefetch_setting("prefetch_timeout_base") == PREFETCH_KEYS["prefetch_timeout_base"]
    assert cfg.to_dict()["hicache_storage_backend_extra_config"] == {
        "path": "/mnt/kv", "prefetch_threshold": 128, "prefetch_timeout_max": 5}
    blank = HiCacheConfig.from_extra_config({"hicache_storage_backend_extra_config": " "})
    assert blank.backend_extra_config() == {}
    assert blank.to_dict()["hicache_storage_backend_extra_config"] == {}


@pytest.mark.parametrize("value", [-1, True, "2", None])
@pytest.mark.parametrize("key", sorted(PREFETCH_KEYS))
def test_prefetch_keys_are_numbers_at_least_zero(key, value):
    with pytest.raises(HiCacheConfigError) as err:
        HiCacheConfig.from_extra_config({"hicache_storage_backend_extra_config": {key: value}})
    assert f"hicache_storage_backend_extra_config.{key} must be a number >= 0" in str(err.value)


def test_prefetch_defaults_are_sglangs():
    cfg = HiCacheConfig.from_extra_config({})
    assert {k: cfg.prefetch_setting(k) for k in PREFETCH_KEYS} == {
        "prefetch_threshold": 256, "prefetch_timeout_base": 2.0,
        "prefetch_timeout_per_ki_token": 0.1, "prefetch_timeout_max": 30.0,
        "object_mib": 1.0}  # ours: L3 objects of up to 1 MiB (tiers/index/spans.py)


def test_object_mib_is_checked_and_kept_from_the_backend():
    cfg = HiCacheConfig.from_extra_config(
        {"hicache_storage_backend_extra_config": {"object_mib": 4, "path": "/tmp/x"}})
    assert cfg.prefetch_setting("object_mib") == 4.0
    assert cfg.backend_extra_config() == {"path": "/tmp/x"}
    with pytest.raises(HiCacheConfigError, match="object_mib"):
        HiCacheConfig.from_extra_config(
            {"hicache_storage_backend_extra_config": {"object_mib": -1}})


def test_admin_token_never_shows():
    token = "s3cr3t-token-value"
    cfg = HiCacheConfig.from_extra_config({"hicache_admin_token": token})
    assert cfg.hicache_admin_token is not None
    assert cfg.hicache_admin_token.get_secret_value() == token
    assert token not in repr(cfg) and token not in str(cfg)
    assert cfg.to_dict()["hicache_admin_token"] == "<set>"
    assert token not in json.dumps(cfg.to_dict())
    assert HiCacheConfig.from_extra_config({}).to_dict()["hicache_admin_token"] is None
    for bad in ("", 12345):
        with pytest.raises(HiCacheConfigError) as err:
            HiCacheConfig.from_extra_config({"hicache_admin_token": bad})
        assert "hicache_admin_token must be a non-empty string" in str(err.value)
        assert repr(bad) not in str(err.value)


def test_to_dict_has_every_key_and_round_trips():
    given = {"page_size": 128, "hicache_ratio": 3, "hicache_write_policy": "write_back",
             "hicache_mem_layout": "layer_first", "hicache_storage_backend": "nixl",
             "hicache_storage_backend_extra_config": {"plugin": "POSIX"},
             "hicache_admin_port": 0, "hicache_admin_host": None}
    cfg = HiCacheConfig.from_extra_config(given)
    d = cfg.to_dict()
    assert tuple(d) == HiCacheConfig.allowed_keys()
    assert d["hicache_admin_host"] == "127.0.0.1"  # null = the default
    assert d["hicache_ratio"] == 3.0 and d["hicache_storage_backend"] == "nixl"
    assert HiCacheConfig.from_extra_config(d | {"hicache_admin_token": None}) == cfg


def test_config_is_frozen():
    cfg = HiCacheConfig.from_extra_config({})
    with pytest.raises(ValueError, match="frozen"):
        cfg.hicache_ratio = 3.0  # type: ignore[misc]


def test_prefetch_defaults_are_written_once():
    """The scheduler's policy and the connector's settings read one model's defaults."""
    from hicache.tiers.config import StorageExtraConfig
    from hicache.tiers.controller.policies import PrefetchSettings, Timeout, make_prefetch_policy

    keys = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max")
    t = Timeout()
    assert (t.base_s, t.per_ki_token_s, t.max_s) == tuple(PrefetchSettings.default(k)
                                                         for k in keys)
    assert make_prefetch_policy("timeout", {}) == t
    assert issubclass(StorageExtraConfig, PrefetchSettings)
    assert set(PrefetchSettings.model_fields) <= set(PREFETCH_KEYS)
