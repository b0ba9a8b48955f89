"""Stable page keys, derived from the engine's own prefix-cache block hashes.

Contract:

- A page is ``page_size`` consecutive tokens; only full pages get a key, a
  trailing partial page is ignored.
- The engine's keys come from its block hashes (vLLM's ``request.block_hashes``):
  a chained hash per full block that already covers everything the engine's
  prefix cache keys cover (tokens, multimodal features, prompt embeddings,
  LoRA, cache salt) and the whole prefix before it. A page's key is
  ``SHA-256(seed || len || hash of the page's last block)``
  (:func:`block_page_keys`, :class:`PageKeyChain`; :class:`KeyMemo` keeps keys
  already derived, by block hash). A key therefore identifies
  the page *and* everything before it, so comparing key sequences is
  comparing prefixes, and the radix tree can work on keys alone.
- The seed is derived from a :class:`KeyNamespace` (model, KV dtype, byte
  layout, page size, TP size, extras such as the block-hash algorithm), so KV
  bytes of different shapes can never alias.
- Keys are stable across processes, restarts and machines as long as the
  block hashes are (the connector refuses L3 where vLLM's are not): only
  SHA-256 over explicitly encoded bytes, never Python's ``hash()``. Changing
  the encoding must bump ``_VERSION_TAG``; a test pins a known digest.
- :func:`page_keys` / :func:`token_block_hashes` are an engine-free stand-in
  for block hashes over plain token ids (a SHA-256 chain over 4-byte
  little-endian tokens, seeded by cache salt and LoRA name), for the
  simulator, benchmarks and tests. Token ids must satisfy
  ``0 <= id < 2**32`` (``ValueError`` otherwise).

The namespace deliberately holds ``tp_size`` but not the TP rank: the scheduler
plans one page for all ranks under one key; each rank's shard of that page is
told apart where it is stored (L3), not here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

PageKey = NewType("PageKey", bytes)
"""32-byte SHA-256 digest identifying one page and its whole prefix."""

# v2: keys derive from the engine's block hashes (v1 hashed token ids only,
# so prompts that differ only in images or embeddings aliased).
_VERSION_TAG = b"hicache-page-key-v2"
_TOKEN_LIMIT = 2**32


def _put_str(h: hashlib._Hash, value: str | None) -> None:
    # A presence byte keeps None apart from "", and the length prefix keeps
    # ("ab", "c") apart from ("a", "bc").
    if value is None:
        h.update(b"\x00")
        return
    data = value.encode("utf-8")
    h.update(b"\x01" + len(data).to_bytes(8, "little") + data)


def _put_int(h: hashlib._Hash, value: int) -> None:
    h.update(value.to_bytes(8, "little", signed=True))


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that must match for two pages' KV bytes to be interchangeable."""

    model: str  # model identity (name or path plus revision, as the operator configures it)
    kv_dtype: str  # dtype of the stored KV bytes, e.g. "bfloat16", "fp8_e4m3"
    layout: str  # KV byte layout/format id, e.g. "page_first/mha"
    page_size: int  # tokens per page
    tp_size: int  # tensor-parallel size: a page's shard shapes depend on it
    extra: tuple[str, ...] = ()  # anything else that changes the bytes (e.g. rope scaling)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.tp_size <= 0:
            raise ValueError(f"tp_size must be positive, got {self.tp_size}")

    def _hasher(self) -> hashlib._Hash:
        h = hashlib.sha256(_VERSION_TAG)
        _put_str(h, self.model)
        _put_str(h, self.kv_dtype)
        _put_str(h, self.layout)
        _put_int(h, self.page_size)
        _put_int(h, self.tp_size)
        _put_int(h, len(self.extra))
        for item in self.extra:
            _put_str(h, item)
        return h

    def seed(self, cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
        """Chain seed for one request: the namespace plus its cache salt and LoRA."""
        h = self._hasher()
        _put_str(h, cache_salt)
        _put_str(h, lora_name)
        return h.digest()

    def fingerprint(self) -> str:
        """Short hex id of the namespace alone (no salt, no LoRA), for logs and headers."""
        return self._hasher().hexdigest()[:16]


def _tokens_u4(token_ids: Sequence[int]) -> np.ndarray:
    try:
        arr = np.asarray(token_ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _TOKEN_LIMIT):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4")


def page_keys(
    seed: bytes,
    token_ids: Sequence[int],
    page_size: int,
    parent: PageKey | None = None,
) -> list[PageKey]:
    """Keys of the full pages of ``token_ids``; the chain starts from ``parent`` or ``seed``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    data = memoryview(_tokens_u4(token_ids[: num_pages * page_size]).tobytes())
    page_bytes = page_size * 4
    prev = bytes(parent) if parent is not None else seed
    keys: list[PageKey] = []
    for i in range(num_pages):
        h = hashlib.sha256(prev)
        h.update(data[i * page_bytes : (i + 1) * page_bytes])
        prev = h.digest()
        keys.append(PageKey(prev))
    return keys


def token_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """Engine-free stand-in for vLLM's ``request.block_hashes`` over plain token ids."""
    return list(page_keys(stand_in_seed(cache_salt, lora_name), token_ids, block_size))


def stand_in_seed(cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The chain seed of ``token_block_hashes`` (extend its hashes with ``page_keys``
    from their last one)."""
    h = hashlib.sha256(b"hicache-stand-in-block-hash")
    _put_str(h, cache_salt)
    _put_str(h, lora_name)
    return h.digest()


def block_page_keys(
    seed: bytes, block_hashes: Sequence[bytes], hashes_per_page: int, first_page: int = 0
) -> list[PageKey]:
    """Keys of the full pages covered by ``block_hashes``, from page ``first_page`` on.

    ``block_hashes[j]`` is the engine's chained hash of block ``j`` (every
    block before it included); page ``i`` ends at block
    ``(i + 1) * hashes_per_page - 1``.
    """
    if hashes_per_page <= 0:
        raise ValueError(f"hashes_per_page must be positive, got {hashes_per_page}")
    return _keys_of_ends(seed, _page_ends(block_hashes, hashes_per_page, first_page))


def _page_ends(block_hashes: Sequence[bytes], hashes_per_page: int,
               first_page: int) -> list[bytes]:
    """The block hash that ends each full page from ``first_page`` on."""
    return [block_hashes[end] for end in range((first_page + 1) * hashes_per_page - 1,
                                               len(block_hashes), hashes_per_page)]


def _keys_of_ends(seed: bytes, ends: Sequence[bytes]) -> list[PageKey]:
    """``SHA-256(seed || len || digest)`` of each page's last block hash (the seed
    hashed once, its state copied per page)."""
    seeded = hashlib.sha256(seed)
    keys: list[PageKey] = []
    for end in ends:
        digest = bytes(end)
        h = seeded.copy()
        h.update(len(digest).to_bytes(4, "little") + digest)
        keys.append(PageKey(h.digest()))
    return keys


class KeyMemo:
    """Page keys already derived, by the block hash they came from, for one seed and
    one ``hashes_per_page`` (a block hash covers its whole prefix, so the same hash
    always gives the same key): requests that share a prefix hash it once.

    Bounded: past ``max_entries`` it starts over empty (a miss only costs a hash).
    """

    def __init__(self, seed: bytes, hashes_per_page: int, max_entries: int = 1 << 16) -> None:
        if hashes_per_page <= 0:
            raise ValueError(f"hashes_per_page must be positive, got {hashes_per_page}")
        self.seed = seed
        self.hashes_per_page = hashes_per_page
        self.max_entries = max_entries
        self._keys: dict[bytes, PageKey] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def keys_of(self, block_hashes: Sequence[bytes], first_page: int) -> list[PageKey]:
        """``block_page_keys(seed, block_hashes, hashes_per_page, first_page)``."""
        known = self._keys
        ends = _page_ends(block_hashes, self.hashes_per_page, first_page)
        missing = [end for end in ends if end not in known]
        if missing:
            if len(known) + len(missing) > self.max_entries:
                known.clear()
                missing = ends
            known.update(zip(missing, _keys_of_ends(self.seed, missing), strict=True))
        return [known[end] for end in ends]


class PageKeyChain:
    """Page keys of one request whose block hashes only grow (vLLM appends them
    as tokens are generated).

    Each :meth:`extend` call gets the request's block hashes so far and keys
    only the full pages beyond those already keyed: one hash per page over a
    request's life (none for pages a shared ``KeyMemo`` already holds).
    """

    def __init__(self, seed: bytes, hashes_per_page: int, memo: KeyMemo | None = None) -> None:
        if hashes_per_page <= 0:
            raise ValueError(f"hashes_per_page must be positive, got {hashes_per_page}")
        if memo is not None and (memo.seed != seed or memo.hashes_per_page != hashes_per_page):
            raise ValueError("a KeyMemo serves only the seed and hashes_per_page it was made for")
        self._seed = seed
        self._hashes_per_page = hashes_per_page
        self._memo = memo
        self._keys: list[PageKey] = []

    def extend(self, block_hashes: Sequence[bytes]) -> list[PageKey]:
        """Key the newly completed pages of ``block_hashes``; returns only the new keys."""
        if self._memo is not None:
            new = self._memo.keys_of(block_hashes, len(self._keys))
        else:
            new = block_page_keys(self._seed, block_hashes, self._hashes_per_page,
                                  len(self._keys))
        self._keys.extend(new)
        return new

    @property
    def keys(self) -> list[PageKey]:
        """All keys so far (a copy)."""
        return list(self._keys)


def body_key(key: bytes) -> bytes:
    """The L3 key of a page's body: every KV-cache group but the Mamba state ones.

    Models with Mamba state groups store each page's body under this key, and
    pages that carry a state checkpoint under their own key too, so an L3 hit
    can run over bodies and end on a checkpoint (tiers/controller/fetches.py).
    """
    return hashlib.sha256(b"hicache-page-body" + key).digest()[: len(key)]


def kv_dtype_name(torch_dtype: str, cache_dtype: str) -> str:
    """What a page's KV bytes are: the tensor dtype, plus vLLM's cache dtype when it is
    quantised (every fp8 variant is stored as uint8, so the tensor dtype alone would let
    an e5m2 engine read e4m3 pages). ``auto`` keeps the bare tensor dtype, so the keys of
    unquantised caches are those of earlier releases."""
    if cache_dtype in ("auto", "", None):
        return torch_dtype
    return f"{torch_dtype}/{cache_dtype}"
