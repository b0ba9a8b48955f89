"""The connector's vLLM-facing surface, checked against the installed vLLM (0.32) and
vLLM 0.33.0's wheel (its surface, read from the wheel's source, is committed as
integration/vllm/surface-vllm-0.33.0.json): every name we import exists, every method we
override takes what vLLM passes, every abstract method is defined, every enum member we
use exists. The reader never imports the vLLM it reads; here it is held against
``inspect`` on the installed one, and the check is shown to fail on broken surfaces."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from hicache.integration.vllm import surface

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@pytest.fixture(scope="module")
def installed():
    return surface.extract(surface.installed_root())


@pytest.fixture(scope="module")
def vllm_033():
    return json.loads(surface.SNAPSHOT_033.read_text())


def test_the_reader_agrees_with_inspect_on_the_installed_vllm(installed):
    methods = installed["modules"][BASE]["classes"]["KVConnectorBase_V1"]["methods"]
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword",
             inspect.Parameter.VAR_POSITIONAL: "var_positional",
             inspect.Parameter.VAR_KEYWORD: "var_keyword"}
    compared = 0
    for name, sig in methods.items():
        fn = inspect.getattr_static(base.KVConnectorBase_V1, name)
        fn = getattr(fn, "__func__", fn)
        if isinstance(fn, property):
            fn = fn.fget
        params = list(inspect.signature(fn).parameters.values())
        if params and params[0].name in ("self", "cls"):
            params = params[1:]
        want = [[p.name, kinds[p.kind], p.default is not inspect.Parameter.empty]
                for p in params]
        assert sig["params"] == want, name
        compared += 1
    assert compared >= 30
    assert installed["vllm_version"] == __import__("vllm").__version__


def test_the_connector_fits_the_installed_vllm(installed):
    assert surface.check(installed) == []


def test_the_connector_fits_vllm_0_33(vllm_033):
    assert vllm_033["vllm_version"] == "0.33.0"
    # The snapshot covers what the connector imports today (re-take it when this fails:
    # python -m hicache.integration.vllm.surface snapshot --wheel vllm-0.33.0-...whl --out ...)
    assert set(surface.our_imports()) <= set(vllm_033["modules"])
    assert surface.check(vllm_033) == []


def test_the_check_finds_each_kind_of_break(vllm_033):
    broken = copy.deepcopy(vllm_033)
    mod = broken["modules"][BASE]
    methods = mod["classes"]["KVConnectorBase_V1"]["methods"]
    # A renamed parameter, a new required keyword, a method that stopped being a
    # classmethod, a new abstract method, a name and an enum member that are gone.
    methods["get_num_new_matched_tokens"]["params"][0][0] = "req"
    for name in ("save_kv_layer", "wait_for_layer_load"):
        methods[name]["params"].append(["stream", "keyword", False])
    methods["build_kv_connector_stats"]["decorators"] = []
    methods["new_hook"] = {"params": [], "decorators": ["abstractmethod"]}
    mod["names"].remove("KVConnectorRole")
    chs = broken["modules"]["vllm.v1.metrics.cache_hit_source"]["classes"]["CacheHitSource"]
    chs["attrs"].remove("HOST")
    text = "\n".join(surface.check(broken))
    assert "get_num_new_matched_tokens" in text and "'req'" in text
    assert "wait_for_layer_load" in text and "keyword 'stream'" in text
    assert "save_kv_layer" not in text  # ours takes **kwargs
    assert "build_kv_connector_stats" in text and "classmethod" in text
    assert "new_hook()" in text and "HiCacheConnector" in text and "NullConnector" in text
    assert f"{BASE}.KVConnectorRole: gone" in text
    assert "CacheHitSource.HOST: gone" in text
    # A name the connector imports now but did not when the snapshot was taken.
    stale = copy.deepcopy(vllm_033)
    stale["imports"][BASE].remove("SupportsHMA")
    assert f"{BASE}.SupportsHMA: not in the snapshot (re-take it)" in surface.check(stale)


def test_a_parameter_vllm_passes_that_the_override_lacks_is_a_problem():
    ours = {"params": [["request", "positional", False]], "decorators": []}
    theirs = {"params": [["request", "positional", False], ["num_tokens", "positional", False]],
              "decorators": []}
    assert surface.signature_problems(ours, theirs) == [
        "vLLM passes 'num_tokens', which this override does not take"]
    extra = {"params": [["request", "positional", False], ["mine", "positional", False]],
             "decorators": []}
    assert any("'mine' here has no default" in p
               for p in surface.signature_problems(extra, {"params": theirs["params"][:1],
                                                           "decorators": []}))
