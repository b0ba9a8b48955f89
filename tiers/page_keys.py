"""Stable page keys: a SHA-256 hash chain over full pages of token ids.

Contract:

- A page is ``page_size`` consecutive tokens; only full pages get a key, a
  trailing partial page is ignored.
- ``key[i] = SHA-256(key[i-1] || tokens of page i as 4-byte little-endian
  unsigned ints)``, with ``key[-1]`` being the namespace seed (or an explicit
  ``parent`` key when continuing a chain). A key therefore identifies the page
  *and* everything before it, so comparing key sequences is comparing token
  prefixes, and the radix tree can work on keys alone.
- The seed is derived from a :class:`KeyNamespace` (model, KV dtype, byte
  layout, page size, TP size, extras) plus the request's cache salt and LoRA
  name, so KV bytes of different shapes or tenants can never alias.
- Keys are stable across processes, restarts and machines: only SHA-256 over
  explicitly encoded bytes, never Python's ``hash()``. Changing the encoding
  must bump ``_VERSION_TAG``; a test pins a known digest.
- Token ids must satisfy ``0 <= id < 2**32`` (``ValueError`` otherwise).

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

_VERSION_TAG = b"hicache-page-key-v1"
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


class PageKeyChain:
    """Incremental page keys for one request whose token list only grows.

    Each :meth:`extend` call gets the request's full token list so far and
    hashes only the full pages beyond those already keyed, so the cost over a
    request's life is one hash per page.
    """

    def __init__(self, seed: bytes, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self._seed = seed
        self._page_size = page_size
        self._keys: list[PageKey] = []

    def extend(self, token_ids: Sequence[int]) -> list[PageKey]:
        """Key the newly completed pages of ``token_ids``; returns only the new keys."""
        start = len(self._keys) * self._page_size
        end = (len(token_ids) // self._page_size) * self._page_size
        if end <= start:
            return []
        parent = self._keys[-1] if self._keys else None
        new = page_keys(self._seed, token_ids[start:end], self._page_size, parent)
        self._keys.extend(new)
        return new

    @property
    def keys(self) -> list[PageKey]:
        """All keys so far (a copy)."""
        return list(self._keys)

    @property
    def page_size(self) -> int:
        return self._page_size
