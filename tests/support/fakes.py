"""vLLM's Request as the scheduler half reads it, for engine-free scheduler tests.

The request is the simulator's (``SimRequest``): block hashes from the
engine-free stand-in (``token_block_hashes``), which is also the scheduler's
default prefix hasher, so flushes by prefix find the same keys as requests.
"""

from __future__ import annotations

from hicache.integration.bench.sim_engine import SimRequest
from hicache.tiers.index.page_keys import PageKey, block_page_keys, token_block_hashes


def request(rid: str, tokens: list[int], computed: int = 0, block_size: int = 4) -> SimRequest:
    return SimRequest(rid, list(tokens), computed, block_size=block_size)


def keys_of(seed: bytes, tokens: list[int], page: int, block_size: int = 4) -> list[PageKey]:
    """The page keys a request of ``tokens`` gets."""
    return block_page_keys(seed, token_block_hashes(tokens, block_size), page // block_size)
