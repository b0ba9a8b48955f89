import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.tiers.index.page_keys import (
    KeyMemo,
    KeyNamespace,
    PageKeyChain,
    block_page_keys,
    page_keys,
    token_block_hashes,
)

NS = KeyNamespace(model="m", kv_dtype="bf16", layout="page_first/mha", page_size=4, tp_size=1)


def test_known_digests_are_stable():
    # Pasted once; a change here means every stored L3 page is orphaned, so
    # bump the version tag on purpose rather than update these silently.
    # v2 (block-hash keys) on purpose: v1 keyed token ids only.
    assert NS.seed().hex() == "9adf5b7bf920d028b2a438f9618f52c22d6093e782790f585797b63df8dc556c"
    assert NS.fingerprint() == "c2736961bb298ea5"
    keys = page_keys(NS.seed(), list(range(10)), 4)
    assert [k.hex() for k in keys] == [
        "39fb847680984f0a5145501a1c5fad94c0da86291d7e19195ce08868e0880571",
        "6c85829fb5f4c7a87b46a23be2d845d0e9104afdc372d5bc1017122643898e30",
    ]
    keys = block_page_keys(NS.seed(), [bytes([i]) * 32 for i in range(5)], 2)
    assert [k.hex() for k in keys] == [
        "4f1146892df6f94c4ac12438b87ca497f0f8769007167c86375cfe914c80f08d",
        "c5776ae9be903a992d467686713307b109dd9cb43504e9d316c3186cb0c212fb",
    ]


def test_page_key_is_sha256_of_seed_and_the_pages_last_block_hash():
    seed = b"\x01" * 32
    hashes = [bytes([i]) * 16 for i in range(7)]  # xxhash-sized block hashes
    keys = block_page_keys(seed, hashes, 3)
    assert len(keys) == 2  # 7 blocks = 2 full pages of 3 blocks
    for page, key in enumerate(keys):
        last = hashes[3 * page + 2]
        assert key == hashlib.sha256(seed + len(last).to_bytes(4, "little") + last).digest()
    # Everything before a page is in its last block's hash already: only that one counts.
    other = list(hashes)
    other[0] = b"\xff" * 16
    assert block_page_keys(seed, other, 3) == keys
    assert block_page_keys(seed, hashes, 3, first_page=1) == keys[1:]
    with pytest.raises(ValueError):
        block_page_keys(seed, hashes, 0)


def test_stand_in_block_hashes_separate_salt_and_lora():
    tokens = list(range(8))
    variants = [token_block_hashes(tokens, 4), token_block_hashes(tokens, 4, cache_salt="a"),
                token_block_hashes(tokens, 4, lora_name="a"),
                token_block_hashes(tokens, 4, cache_salt="", lora_name="")]
    assert len({tuple(v) for v in variants}) == len(variants)
    assert token_block_hashes(tokens, 4) == token_block_hashes(tokens + [1], 4)


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
    hashes_per_page=st.integers(1, 4),
)
def test_chain_matches_block_page_keys_in_random_increments(tokens, cuts, hashes_per_page):
    seed = NS.seed()
    hashes = token_block_hashes(tokens, 2, cache_salt="s")
    chain = PageKeyChain(seed, hashes_per_page)
    got = []
    for cut in sorted(c for c in cuts if c <= len(tokens)) + [len(tokens)]:
        new = chain.extend(token_block_hashes(tokens[:cut], 2, cache_salt="s"))
        got.extend(new)
        assert chain.keys == got
    assert got == block_page_keys(seed, hashes, hashes_per_page)
    assert chain.extend(hashes) == []


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), max_size=12)),
                     min_size=1, max_size=6),
    hashes_per_page=st.integers(1, 3),
    max_entries=st.integers(1, 40),
)
def test_a_shared_memo_gives_every_chain_the_keys_it_would_hash_itself(
        prompts, hashes_per_page, max_entries):
    """Requests that share prefixes (one of four heads, then their own tokens) keyed
    through one memo, grown in two steps each: the keys of block_page_keys, and the
    memo never holds more than it may (it starts over when full)."""
    seed = NS.seed()
    heads = [[h] * 7 for h in range(4)]
    memo = KeyMemo(seed, hashes_per_page, max_entries=max_entries)
    for head, tail in prompts:
        tokens = heads[head] + tail
        chain = PageKeyChain(seed, hashes_per_page, memo)
        chain.extend(token_block_hashes(tokens[:5], 1))
        chain.extend(token_block_hashes(tokens, 1))
        assert chain.keys == block_page_keys(seed, token_block_hashes(tokens, 1),
                                             hashes_per_page)
        assert len(memo) <= max(max_entries, len(tokens))


def test_a_memo_serves_only_its_own_seed_and_page_size():
    memo = KeyMemo(NS.seed(), 2)
    with pytest.raises(ValueError, match="KeyMemo serves only"):
        PageKeyChain(NS.seed(), 1, memo)
    with pytest.raises(ValueError, match="KeyMemo serves only"):
        PageKeyChain(b"other seed", 2, memo)
