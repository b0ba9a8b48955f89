"""vLLM's Request as the scheduler half reads it, for engine-free scheduler tests.

Block hashes come from the engine-free stand-in (``token_block_hashes``),
which is also the scheduler's default prefix hasher, so flushes by prefix
find the same keys as the requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.tiers.page_keys import PageKey, block_page_keys, token_block_hashes


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_size: int = 4
    cache_salt: str | None = None
    lora_request: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        return token_block_hashes(self.all_token_ids, self.block_size, self.cache_salt)


def request(rid: str, tokens: list[int], computed: int = 0, block_size: int = 4) -> FakeRequest:
    return FakeRequest(rid, list(tokens), computed, block_size)


def keys_of(seed: bytes, tokens: list[int], page: int, block_size: int = 4) -> list[PageKey]:
    """The page keys a request of ``tokens`` gets."""
    return block_page_keys(seed, token_block_hashes(tokens, block_size), page // block_size)
