"""Page keys from vLLM's own block hasher (no engine): what they cover, when they are
stable, and the load-failure policy under MultiConnector.

Requests are vLLM's real ``Request`` objects with vLLM's real block hasher.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from hicache.connector.vllm_keys import VllmPrefixHasher, check_stable_hashes
from hicache.connector.vllm_shape import apply_load_failure_policy
from hicache.tiers.config import HiCacheConfigError
from hicache.tiers.index.page_keys import KeyNamespace, block_page_keys

BS, PAGE = 16, 64
SEED = KeyNamespace("m", "bfloat16", "cpu", PAGE, 1).seed()


@pytest.fixture(scope="module")
def hasher():
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BS, fn)


def keys(hasher, tokens, **kw) -> list[bytes]:
    req = Request("r", list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher,
                  **kw)
    return block_page_keys(SEED, req.block_hashes, PAGE // BS)


def test_prompt_embeddings_of_equal_length_never_share_pages(hasher):
    # vLLM gives embedding prompts placeholder token ids: equal lengths, equal ids.
    placeholder = [0] * (3 * PAGE)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3 * PAGE, 8, generator=gen) for _ in range(2))
    ka = keys(hasher, placeholder, prompt_embeds=a)
    kb = keys(hasher, placeholder, prompt_embeds=b)
    assert len(ka) == len(kb) == 3
    assert not set(ka) & set(kb)
    assert keys(hasher, placeholder, prompt_embeds=a.clone()) == ka
    # The same embeddings up to the last page: the first two pages are shared.
    c = a.clone()
    c[-1] += 1
    assert keys(hasher, placeholder, prompt_embeds=c)[:2] == ka[:2]


def _image(identifier: str, offset: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=PAGE),
                                 mm_hash=identifier)


def test_requests_differing_only_in_their_image_never_share_pages_after_it(hasher):
    tokens = list(range(1000, 1000 + 4 * PAGE))  # image placeholders in page 1
    ka = keys(hasher, tokens, mm_features=[_image("cat", PAGE)])
    kb = keys(hasher, tokens, mm_features=[_image("dog", PAGE)])
    assert ka[0] == kb[0]  # the text before the image
    assert not set(ka[1:]) & set(kb[1:])
    assert keys(hasher, tokens)[1:] != ka[1:]  # and never the text-only prompt's


def test_cache_salt_and_lora_separate_keys(hasher):
    tokens = list(range(2 * PAGE))
    plain = keys(hasher, tokens)
    salted = keys(hasher, tokens, cache_salt="tenant-a")
    lora_a = keys(hasher, tokens, lora_request=LoRARequest("a", 1, "/adapters/a"))
    lora_a2 = keys(hasher, tokens, lora_request=LoRARequest("a", 1, "/adapters/a-v2"))
    assert len({tuple(k) for k in (plain, salted, lora_a, lora_a2)}) == 4


def test_prefix_hasher_gives_a_requests_own_hashes(hasher):
    config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"))
    prefix = VllmPrefixHasher(config, BS)
    tokens = list(range(50, 50 + 2 * PAGE + 3))
    req = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher,
                  cache_salt="s", lora_request=LoRARequest("a", 1, "/adapters/a"))
    prefix.lora_paths["a"] = "/adapters/a"
    assert prefix(tokens, "s", "a") == req.block_hashes
    assert prefix(tokens, None, None) != req.block_hashes


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_l3_refused_when_vllm_seeds_block_hashes_at_random(algo, monkeypatch):
    config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(HiCacheConfigError) as err:
        check_stable_hashes(config, uses_l3=True)
    assert "PYTHONHASHSEED" in str(err.value) and "sha256" in str(err.value)
    check_stable_hashes(config, uses_l3=False)  # L1/L2 live in one process: fine
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_stable_hashes(config, uses_l3=True)


def test_sha256_block_hashes_are_stable_for_l3(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo in ("sha256", "sha256_cbor"):
        check_stable_hashes(SimpleNamespace(
            cache_config=SimpleNamespace(prefix_caching_hash_algo=algo)), uses_l3=True)


class _ParentUnderConstruction(MultiConnector):
    """A MultiConnector at the moment it builds its children (no children built:
    only what ``apply_load_failure_policy`` looks at)."""

    def __init__(self, top: KVTransferConfig, child: KVTransferConfig, policy: str) -> None:
        self._vllm_config = SimpleNamespace(kv_transfer_config=top)
        apply_load_failure_policy(child, policy)


def test_alone_hicache_sets_vllms_policy():
    own = KVTransferConfig(kv_connector="HiCacheConnector", kv_role="kv_both")
    apply_load_failure_policy(own, "recompute")
    assert own.kv_load_failure_policy == "recompute"


def test_inside_multi_connector_the_top_level_policy_must_match():
    child = KVTransferConfig(kv_connector="HiCacheConnector", kv_role="kv_both")
    top = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both")  # default: fail
    with pytest.raises(HiCacheConfigError) as err:
        _ParentUnderConstruction(top, child, "recompute")
    assert '"kv_load_failure_policy": "recompute"' in str(err.value)
    top = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                           kv_load_failure_policy="recompute")
    _ParentUnderConstruction(top, child, "recompute")
    _ParentUnderConstruction(
        KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both"), child, "fail")


def test_fp8_cache_dtypes_get_their_own_keys():
    from hicache.tiers.index.page_keys import kv_dtype_name

    # vLLM stores every fp8 variant as uint8: the tensor dtype alone would let an
    # e5m2 engine read e4m3 pages.
    names = {kv_dtype_name("torch.uint8", d) for d in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    assert len(names) == 3
    # Unquantised caches keep the keys of earlier releases.
    assert kv_dtype_name("torch.bfloat16", "auto") == "torch.bfloat16"
    seeds = {KeyNamespace("m", n, "cpu", PAGE, 1).seed() for n in names}
    assert len(seeds) == 3
