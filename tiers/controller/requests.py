"""Per-request bookkeeping of the scheduler half: page keys, lookups, tier accounting.

Contract:
- ``SchedulerRequest`` is what the scheduler reads of a request: vLLM's
  ``Request`` satisfies it, so does the simulator's ``SimRequest``; nothing
  here imports an engine.
- Pages are keyed from ``request.block_hashes`` (vLLM's prefix-cache hashes,
  which cover multimodal features, prompt embeddings, LoRA and cache salt),
  chained from the namespace seed; a request's keys only grow, and each page
  is hashed once over the request's life (``PageKeyChain``).
- ``RequestTable`` holds one ``RequestState`` per live request, from its
  first lookup to ``request_finished``.
- Tier hits are counted at a request's first admission only, like vLLM's
  ``cached_tokens``: a preempted request admitted again is not a new request
  (its loads still happen and show in the byte counters). A page counts as a
  hit in the first tier that holds it (L1 = vLLM's own prefix cache) and as
  a miss in every tier asked before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hicache.tiers.controller.hints import DEFAULT_HINTS, RequestHints, parse_hints
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.page_keys import KeyMemo, PageKey, PageKeyChain
from hicache.tiers.index.tree_node import MatchResult


class SchedulerRequest(Protocol):
    """The attributes of vLLM's ``Request`` that the scheduler half reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


@dataclass(frozen=True)
class CachedTokens:
    """Prompt tokens of one request served from each tier at its first admission
    (a preempted request admitted again keeps the first count, as vLLM's
    ``cached_tokens`` does); they add up to what vLLM reports."""

    l1: int
    l2: int
    l3: int

    def as_dict(self) -> dict[str, int]:
        return {"l1": self.l1, "l2": self.l2, "l3": self.l3}


@dataclass
class RequestState:
    """What the scheduler half remembers about one live request."""

    request: SchedulerRequest
    chain: PageKeyChain
    # Leading pages of this request known to be in L2 (planned or matched).
    stored_pages: int = 0
    # Leading pages this request has shown the write policy (write_through_selective).
    counted_pages: int = 0
    # Match found by the last lookup, for the allocation that follows it, with
    # the local (vLLM prefix cache) hit it was measured against.
    pending_match: MatchResult | None = None
    local_tokens: int = 0
    # L3 pages found after pending_match by the last lookup (async hit when > 0).
    pending_l3_pages: int = 0
    # Last lookup, counted per tier when vLLM admits the request:
    # (prompt pages, pages vLLM had, pages in L2, pages found in L3 after them).
    lookup: tuple[int, int, int, int] | None = None
    # The request's tier hits have been counted (its first admission).
    counted: bool = False
    # External tokens of the last admission that come from L3 pages (for
    # vLLM's per-source cached-token metric).
    l3_tokens: int = 0
    # Tokens at the end of the last lookup's L2 match that the request's
    # prefetch at arrival brought from L3 (tiers/controller/prefetches.py).
    prefetched_tokens: int = 0
    # The plan (StepPlan.seq) of its last store while running (stores.py).
    store_seq: int = 0
    # vLLM's own prefix-cache hit (tokens) the last lookup was asked about.
    local_tokens_seen: int = 0
    # Prompt tokens served at its first admission by L1 (vLLM's prefix cache), L2
    # and L3: what vLLM reports as the request's cached tokens, split by tier.
    cached_tokens: CachedTokens | None = None
    # What the client asked of the cache (hints.py); when that was bad, why (the
    # request is then served with every hint at its default).
    hints: RequestHints = DEFAULT_HINTS
    hint_error: str | None = None

    def page_keys(self) -> list[PageKey]:
        """Keys of the request's full pages so far (keys the newly completed ones)."""
        self.chain.extend(self.request.block_hashes)
        return self.chain.keys


def _params(request: SchedulerRequest) -> Any:
    """vLLM's per-request ``kv_transfer_params`` (None for other request types)."""
    return getattr(request, "kv_transfer_params", None)


def request_hints(request: SchedulerRequest) -> RequestHints:
    """The request's cache hints (defaults where it has none or bad ones)."""
    state_hints, _ = parse_hints(_params(request))
    return state_hints


class RequestTable:
    """The live requests' states, keyed by request id."""

    def __init__(self, seed: bytes, hashes_per_page: int, stats: SchedulerStats,
                 hints_for: Callable[[RequestHints], RequestHints] | None = None) -> None:
        # Namespace seed of every key chain; engine block hashes per page.
        self._seed = seed
        # A new request's hints with what its session carries (sessions.py).
        self._hints_for = hints_for
        self._hashes_per_page = hashes_per_page
        # Keys of pages some request already keyed (shared prefixes hash once).
        self._memo = KeyMemo(seed, hashes_per_page)
        self._stats = stats
        self._states: dict[str, RequestState] = {}

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def state_of(self, request: SchedulerRequest) -> RequestState:
        """The request's state, created at its first lookup."""
        state = self._states.get(request.request_id)
        if state is None:
            chain = PageKeyChain(self._seed, self._hashes_per_page, self._memo)
            hints, error = parse_hints(_params(request))
            if self._hints_for is not None:
                hints = self._hints_for(hints)
            state = self._states[request.request_id] = RequestState(
                request, chain, hints=hints, hint_error=error)
        return state

    def pop(self, req_id: str) -> RequestState | None:
        """Forget a finished request."""
        self._stats.per_request_hits.pop(req_id, None)
        return self._states.pop(req_id, None)

    def forget_stored(self) -> None:
        """Pages left L2 (flush, reset, bad slots): every request matches again
        before it stores, instead of trusting what it stored before."""
        for state in self._states.values():
            state.stored_pages = 0

    def count_admission(self, state: RequestState, granted: bool, with_l3: bool) -> None:
        """Count the request's last lookup per tier, at its first admission only;
        ``granted``: vLLM took the external tokens offered."""
        if state.lookup is None or state.counted:
            return
        prompt, local, in_l2, in_l3 = state.lookup
        state.lookup, state.counted = None, True
        local = min(local, prompt)
        l2 = max(0, min(in_l2, prompt) - local) if granted else 0
        l3 = max(0, min(in_l2 + in_l3, prompt) - max(local, in_l2)) if granted else 0
        stats = self._stats
        stats.l1_hit_pages += local
        stats.l2_hit_pages += l2
        stats.l2_miss_pages += prompt - local - l2
        if with_l3:
            stats.l3_hit_pages += l3
            stats.l3_miss_pages += max(0, prompt - local - l2 - l3)
