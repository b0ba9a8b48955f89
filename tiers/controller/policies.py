"""Policies: the names ``hicache_write_policy`` and ``hicache_storage_prefetch_policy``
accept, and the small object behind each name.

The connector config (``tiers/config.py``) validates against the
``Literal`` types; the controller turns a name into its object with
``make_write_policy`` / ``make_prefetch_policy`` / ``make_eviction_policy``
(an unknown name is a ValueError naming the allowed values). A new policy is
a new class and a registry entry, never an ``if`` on a name. Names and
meanings follow SGLang HiCache:

- Write policy: when a page computed in L1 (vLLM's KV cache) is copied to
  L2. ``write_through`` copies every full page as soon as its KV is
  complete; ``write_through_selective`` copies a page once at least
  ``threshold`` requests computed it (a bounded LRU remembers the counts);
  ``write_back`` copies nothing while a request runs and everything when it
  finishes, the moment vLLM may evict its blocks (vLLM does not tell a
  connector when it actually evicts one).
- Prefetch policy: how long an L3 fetch may hold its request back.
  ``wait_complete`` waits for every page, ``best_effort`` takes what arrived
  by the worker's next poll, ``timeout`` waits
  ``min(max, base + per_ki_token x tokens / 1024)`` seconds.
- Eviction policy: which unlocked L2 pages make room. ``lru`` is the tree's
  leaf-first LRU (a leaf longer than needed loses only its tail pages), lower
  priority classes first (a request's ``priority`` hint, hints.py). ``tlru``
  (``hicache_eviction_policy``) takes first, within a class, the last
  ``hicache_tlru_tail_tokens`` of each conversation (whose loss a returning
  turn recomputes within its TTFT budget), then LRU.
- L3 admission (``hicache_l3_admission``): which pages L2 stores are backed up
  to L3. ``all`` backs up every one; ``reused`` only a page used a second
  time: stored again by a later request (it had left every tier and was
  recomputed) or found in L2 by a later request's lookup (then backed up from
  L2 at once), and every page of a request whose hints say it returns
  (``retain_s``). SGLang's ``write_through_selective`` backs up on hits the
  same way. The default, ``all``, is the replays' choice (docs/benchmarks-trace.md).

Policies decide; they move nothing and never touch a request's state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar, get_args

from pydantic import Field, NonNegativeFloat

from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode
from hicache.tiers.settings import Settings

WritePolicyName = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicyName = Literal["best_effort", "wait_complete", "timeout"]
EvictionPolicyName = Literal["lru", "tlru"]
L3AdmissionName = Literal["all", "reused"]

WRITE_POLICY_NAMES: tuple[str, ...] = get_args(WritePolicyName)
PREFETCH_POLICY_NAMES: tuple[str, ...] = get_args(PrefetchPolicyName)
EVICTION_POLICY_NAMES: tuple[str, ...] = get_args(EvictionPolicyName)
L3_ADMISSION_NAMES: tuple[str, ...] = get_args(L3AdmissionName)


# ---- write -----------------------------------------------------------------------


class WritePolicy(ABC):
    """When pages computed in L1 are copied to L2."""

    name: ClassVar[str]

    @classmethod
    def configured(cls, *, threshold: int, l2_pages: int) -> WritePolicy:
        """This policy with the write settings (``hicache_write_through_threshold``,
        the L2 pool's size in pages); most policies have none."""
        return cls()

    def running_requests(self, num_scheduled_tokens: Mapping[str, int]) -> Mapping[str, int]:
        """Of this step's scheduled tokens per request, those whose complete pages are
        stored at the end of the step (a finished request's pages are always stored)."""
        return num_scheduled_tokens

    def pages_worth_storing(self, keys: Sequence[PageKey], counted: int) -> int:
        """How many leading pages of ``keys`` (one request's pages, in prefix order,
        ready to store) to store; ``keys[counted:]`` are new since the request last
        asked. Always a prefix, so L2 stays prefix-closed."""
        return len(keys)


class WriteThrough(WritePolicy):
    """Store every full page as soon as its KV is complete."""

    name = "write_through"


class WriteBack(WritePolicy):
    """Store a request's pages only when it finishes (when L1 may evict them)."""

    name = "write_back"

    def running_requests(self, num_scheduled_tokens: Mapping[str, int]) -> Mapping[str, int]:
        return {}


@dataclass
class WriteThroughSelective(WritePolicy):
    """Store a page once ``threshold`` requests computed it.

    Counts live in an LRU of at most ``capacity`` pages, so a page that is
    not computed again is eventually forgotten. Every request that computes
    page i also computed the pages before it, so counts never grow along a
    prefix chain and cutting at the first page below the threshold keeps L2
    prefix-closed.
    """

    name: ClassVar[str] = "write_through_selective"
    threshold: int = 2
    capacity: int = 4096
    _hits: OrderedDict[PageKey, int] = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def configured(cls, *, threshold: int, l2_pages: int) -> WritePolicy:
        # Remember several times more pages than L2 holds: a page evicted from
        # L2 keeps its count and comes back at its next computation.
        return cls(threshold, capacity=max(4096, 8 * l2_pages))

    def pages_worth_storing(self, keys: Sequence[PageKey], counted: int) -> int:
        hits = self._hits
        for key in keys[counted:]:
            hits[key] = hits.get(key, 0) + 1
            hits.move_to_end(key)
        while len(hits) > self.capacity:
            hits.popitem(last=False)
        for i, key in enumerate(keys):
            if hits.get(key, 0) < self.threshold:
                return i
        return len(keys)


def make_write_policy(name: str, *, threshold: int = 2, l2_pages: int = 0) -> WritePolicy:
    """The write policy called ``name``; ``threshold`` and ``l2_pages`` (the L2 pool's
    size, which bounds the selective policy's memory) matter to the selective one."""
    return _lookup(WRITE_POLICIES, name, "write policy").configured(
        threshold=threshold, l2_pages=l2_pages)


# ---- prefetch --------------------------------------------------------------------


class PrefetchSettings(Settings):
    """HiCache's own keys of ``hicache_storage_backend_extra_config`` for L3 fetches
    (SGLang's names and defaults, v0.5.12); the one place their defaults are written."""

    prefetch_threshold: NonNegativeFloat = Field(
        256, description="tokens an L3 hit must cover to be fetched")
    prefetch_timeout_base: NonNegativeFloat = Field(
        2.0, description="seconds a timeout-policy fetch may wait, plus per_ki_token")
    prefetch_timeout_per_ki_token: NonNegativeFloat = Field(
        0.1, description="seconds per 1024 fetched tokens a timeout-policy fetch may wait")
    prefetch_timeout_max: NonNegativeFloat = Field(
        30.0, description="the most seconds a timeout-policy fetch may wait")

    @classmethod
    def default(cls, key: str) -> float:
        return float(cls.model_fields[key].default)


class PrefetchPolicy(ABC):
    """How long an L3 fetch may hold its request back before it goes on with what
    arrived (the rest is recomputed)."""

    name: ClassVar[str]

    @classmethod
    def configured(cls, settings: Mapping[str, float]) -> PrefetchPolicy:
        """This policy with the hicache storage settings; most policies have none."""
        return cls()

    @abstractmethod
    def timeout_s(self, tokens: int) -> float | None:
        """Seconds a fetch of ``tokens`` L3 tokens may take; None = until every page
        arrived, 0 = whatever arrived by the worker's next poll."""


class BestEffort(PrefetchPolicy):
    """Never wait: use what arrived by the worker's next poll."""

    name = "best_effort"

    def timeout_s(self, tokens: int) -> float | None:
        return 0.0


class WaitComplete(PrefetchPolicy):
    """Wait until every page arrived (or failed)."""

    name = "wait_complete"

    def timeout_s(self, tokens: int) -> float | None:
        return None


@dataclass(frozen=True)
class Timeout(PrefetchPolicy):
    """Wait in proportion to the fetch's size, up to a cap."""

    name: ClassVar[str] = "timeout"
    # Seconds any fetch may take (hicache prefetch_timeout_base).
    base_s: float = PrefetchSettings.default("prefetch_timeout_base")
    # Further seconds per 1024 tokens fetched (prefetch_timeout_per_ki_token).
    per_ki_token_s: float = PrefetchSettings.default("prefetch_timeout_per_ki_token")
    # Cap on the whole (prefetch_timeout_max).
    max_s: float = PrefetchSettings.default("prefetch_timeout_max")

    @classmethod
    def configured(cls, settings: Mapping[str, float]) -> PrefetchPolicy:
        return cls(settings.get("prefetch_timeout_base", cls.base_s),
                   settings.get("prefetch_timeout_per_ki_token", cls.per_ki_token_s),
                   settings.get("prefetch_timeout_max", cls.max_s))

    def timeout_s(self, tokens: int) -> float | None:
        return min(self.max_s, self.base_s + self.per_ki_token_s * tokens / 1024)


def make_prefetch_policy(name: str, settings: Mapping[str, float] | None = None,
                         ) -> PrefetchPolicy:
    """The prefetch policy called ``name``; ``settings`` holds the hicache storage
    settings (``prefetch_timeout_base`` / ``_per_ki_token`` / ``_max``; absent = default)."""
    return _lookup(PREFETCH_POLICIES, name, "prefetch policy").configured(settings or {})


# ---- eviction --------------------------------------------------------------------


class EvictionPolicy(ABC):
    """Which unlocked L2 pages leave to make room; locked pages never do."""

    name: ClassVar[str]

    @abstractmethod
    def evict(self, tree: HiRadixTree, num_pages: int) -> list[int]:
        """Remove up to ``num_pages`` pages from ``tree``; returns their host slots."""


class LeafFirstLRU(EvictionPolicy):
    """Unlocked leaves, lowest priority class first and least recently used within
    one; a long leaf loses only its tail, so the reusable head of a long history
    survives (the tree's own order)."""

    name = "lru"

    def evict(self, tree: HiRadixTree, num_pages: int) -> list[int]:
        return tree.evict(num_pages)


class TailFirstLRU(EvictionPolicy):
    """``tlru``, after tail-optimized LRU (arXiv 2510.15152): within a priority class,
    pages at the end of a conversation go first while the conversation has lost fewer
    than ``tail_pages`` pages from its end, least recently used first among them; then
    the rest, LRU. A returning turn recomputes what its history lost on top of its new
    tokens, so losing a short tail keeps it inside its TTFT budget, and the long
    histories that would blow that budget keep their pages. (The tree counts each
    node's lost tail: radix_tree.py ``tail_lost``.)"""

    name = "tlru"

    def __init__(self, tail_pages: int = 64) -> None:
        if tail_pages <= 0:
            raise ValueError(f"tail_pages must be positive, got {tail_pages}")
        self.tail_pages = tail_pages

    def _rank(self, node: TreeNode) -> tuple[float, ...]:
        # Never below a child's: the parent's lost tail is at least the child's
        # plus the child's pages, its priority and access time at least the child's.
        return (node.priority, float(node.tail_lost >= self.tail_pages), node.last_access)

    def _take(self, node: TreeNode) -> int:
        # From a conversation still inside its tail, only what is left of the tail.
        left = self.tail_pages - node.tail_lost
        return left if left > 0 else len(node.keys)

    def evict(self, tree: HiRadixTree, num_pages: int) -> list[int]:
        # Its rank reads the node's own fields; tail_lost changes only while the node
        # has an L2 child (not a leaf), so the tree may keep its heap.
        return tree.evict(num_pages, rank=self._rank, take=self._take, rank_rises=True)


def make_eviction_policy(name: str = "lru", *, tail_pages: int = 64) -> EvictionPolicy:
    """The eviction policy called ``name`` (``tail_pages``: tlru's tail, in pages)."""
    cls = _lookup(EVICTION_POLICIES, name, "eviction policy")
    return TailFirstLRU(tail_pages) if cls is TailFirstLRU else cls()


# ---- L3 admission -----------------------------------------------------------------


class L3Admission(ABC):
    """Which pages stored in L2 are backed up to L3, and when."""

    name: ClassVar[str]

    @classmethod
    def configured(cls, *, l2_pages: int) -> L3Admission:
        return cls()

    @abstractmethod
    def admit(self, keys: Sequence[PageKey], returns: bool) -> int:
        """Of ``keys`` (one request's pages about to be stored in L2, in prefix order),
        how many leading ones go to L3 with their store; ``returns``: the request's
        hints say it comes back."""

    def reused(self, keys: Sequence[PageKey]) -> list[int]:
        """Positions in ``keys`` (pages a lookup found in L2: a later request reached
        them) of the pages to back up now."""
        return []

    def wants(self, key: PageKey) -> bool:
        """Whether a page L2 holds belongs in L3 (the catch-up backs up only these)."""
        return True


class AdmitAll(L3Admission):
    """Every page stored in L2 goes to L3 behind its store."""

    name = "all"

    def admit(self, keys: Sequence[PageKey], returns: bool) -> int:
        return len(keys)


@dataclass
class AdmitReused(L3Admission):
    """A page goes to L3 the second time it is used (see the module docstring).

    An LRU of at most ``capacity`` page keys remembers which were seen and which
    were admitted, so a page forgotten there is treated as new."""

    name: ClassVar[str] = "reused"
    capacity: int = 1 << 16
    # page key -> admitted
    _seen: OrderedDict[PageKey, bool] = field(default_factory=OrderedDict, repr=False)

    @classmethod
    def configured(cls, *, l2_pages: int) -> L3Admission:
        return cls(capacity=max(1 << 16, 8 * l2_pages))

    def _remember(self, key: PageKey, admitted: bool) -> None:
        self._seen[key] = admitted
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def admit(self, keys: Sequence[PageKey], returns: bool) -> int:
        n = 0
        for key in keys:
            if not (returns or key in self._seen):  # a first computation
                break
            self._remember(key, True)
            n += 1
        for key in keys[n:]:
            self._remember(key, self._seen.get(key, False))
        return n

    def wants(self, key: PageKey) -> bool:
        return self._seen.get(key, False)

    def reused(self, keys: Sequence[PageKey]) -> list[int]:
        out = [i for i, key in enumerate(keys) if not self._seen.get(key, False)]
        for i in out:
            self._remember(keys[i], True)
        return out


def make_l3_admission(name: str = "all", *, l2_pages: int = 0) -> L3Admission:
    """The L3 admission rule called ``name`` (``l2_pages`` bounds ``reused``'s memory)."""
    return _lookup(L3_ADMISSIONS, name, "L3 admission rule").configured(l2_pages=l2_pages)


# ---- registries ------------------------------------------------------------------

WRITE_POLICIES: dict[str, type[WritePolicy]] = {
    p.name: p for p in (WriteThrough, WriteThroughSelective, WriteBack)}
PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    p.name: p for p in (BestEffort, WaitComplete, Timeout)}
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LeafFirstLRU, TailFirstLRU)}
L3_ADMISSIONS: dict[str, type[L3Admission]] = {p.name: p for p in (AdmitAll, AdmitReused)}

_P = TypeVar("_P")


def _lookup(registry: Mapping[str, _P], name: str, what: str) -> _P:
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; allowed values: "
                         f"{', '.join(registry)}") from None
