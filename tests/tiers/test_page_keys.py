import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.tiers.page_keys import KeyNamespace, PageKeyChain, page_keys

NS = KeyNamespace(model="m", kv_dtype="bf16", layout="page_first/mha", page_size=4, tp_size=1)


def test_known_digests_are_stable():
    # Pasted once; a change here means every stored L3 page is orphaned, so
    # bump the version tag on purpose rather than update these silently.
    assert NS.seed().hex() == "8aa8b9cb110f76f31bef658558ae91916904d382dca36eeda1523acc995ab8be"
    assert NS.fingerprint() == "875bb30456b25c78"
    keys = page_keys(NS.seed(), list(range(10)), 4)
    assert [k.hex() for k in keys] == [
        "9a9e140543af2b15f0a05ecb995511aaab703fa0300cd6463d8cbf37fb3b7d5c",
        "27329d75a0062245bcb132d38d84e31cef3579fbe11d09ea96afb09ea76cb0fe",
    ]


def test_key_is_sha256_of_previous_and_little_endian_u32_tokens():
    seed = b"\x00" * 32
    (k0,) = page_keys(seed, [1, 2, 3, 4], 4)
    assert k0 == hashlib.sha256(seed + struct.pack("<4I", 1, 2, 3, 4)).digest()
    assert len(k0) == 32
    (k1,) = page_keys(seed, [5, 6, 7, 8], 4, parent=k0)
    assert k1 == hashlib.sha256(k0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert page_keys(seed, [1, 2, 3, 4, 5, 6, 7, 8], 4) == [k0, k1]


def test_chain_depends_on_all_earlier_pages():
    seed = NS.seed()
    a = page_keys(seed, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    b = page_keys(seed, [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    assert all(x != y for x, y in zip(a, b, strict=True))
    c = page_keys(seed, [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12], 4)
    assert a[0] == c[0] and a[1] != c[1] and a[2] != c[2]


def test_partial_page_ignored():
    seed = NS.seed()
    assert page_keys(seed, [1, 2, 3], 4) == []
    assert page_keys(seed, [1, 2, 3, 4, 5, 6], 4) == page_keys(seed, [1, 2, 3, 4], 4)
    assert page_keys(seed, [], 4) == []


def test_accepts_numpy_and_tuples():
    seed = NS.seed()
    ref = page_keys(seed, [1, 2, 3, 4], 4)
    assert page_keys(seed, (1, 2, 3, 4), 4) == ref
    assert page_keys(seed, np.array([1, 2, 3, 4], dtype=np.int32), 4) == ref


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0], [2**70, 0, 0, 0]])
def test_out_of_range_tokens_rejected(bad):
    with pytest.raises(ValueError):
        page_keys(NS.seed(), bad, 4)


def test_max_token_accepted():
    assert len(page_keys(NS.seed(), [2**32 - 1] * 4, 4)) == 1


def test_bad_page_size():
    with pytest.raises(ValueError):
        page_keys(NS.seed(), [1], 0)
    with pytest.raises(ValueError):
        KeyNamespace("m", "bf16", "l", 0, 1)


def test_namespace_separation():
    variants = [
        NS,
        KeyNamespace("m2", "bf16", "page_first/mha", 4, 1),
        KeyNamespace("m", "fp8", "page_first/mha", 4, 1),
        KeyNamespace("m", "bf16", "layer_first/mha", 4, 1),
        KeyNamespace("m", "bf16", "page_first/mha", 8, 1),
        KeyNamespace("m", "bf16", "page_first/mha", 4, 2),
        KeyNamespace("m", "bf16", "page_first/mha", 4, 1, ("rope=2",)),
        # Length prefixes: moving a character across a field boundary must matter.
        KeyNamespace("mb", "f16", "page_first/mha", 4, 1),
        KeyNamespace("m", "bf16", "page_first/mha", 4, 1, ("a", "bc")),
        KeyNamespace("m", "bf16", "page_first/mha", 4, 1, ("ab", "c")),
        KeyNamespace("m", "bf16", "page_first/mha", 4, 1, ("",)),
    ]
    seeds = {v.seed() for v in variants}
    fingerprints = {v.fingerprint() for v in variants}
    assert len(seeds) == len(variants)
    assert len(fingerprints) == len(variants)


def test_salt_and_lora_separation():
    seeds = [
        NS.seed(),
        NS.seed(cache_salt=""),
        NS.seed(cache_salt="a"),
        NS.seed(lora_name=""),
        NS.seed(lora_name="a"),
        NS.seed(cache_salt="a", lora_name="b"),
        NS.seed(cache_salt="ab"),
        NS.seed(cache_salt="a", lora_name=""),
    ]
    assert len(set(seeds)) == len(seeds)
    assert NS.seed(cache_salt="x") == NS.seed(cache_salt="x")
    tokens = [1, 2, 3, 4]
    assert page_keys(NS.seed(), tokens, 4) != page_keys(NS.seed(cache_salt="x"), tokens, 4)
    # The fingerprint ignores salts by design.
    assert NS.fingerprint() == KeyNamespace("m", "bf16", "page_first/mha", 4, 1).fingerprint()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    page_size=st.integers(1, 7),
)
def test_chain_matches_page_keys_in_random_increments(tokens, cuts, page_size):
    seed = NS.seed(cache_salt="s")
    chain = PageKeyChain(seed, page_size)
    got = []
    for cut in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        new = chain.extend(tokens[:cut])
        got.extend(new)
        assert chain.keys == got
    assert got == page_keys(seed, tokens, page_size)
    assert chain.extend(tokens) == []
