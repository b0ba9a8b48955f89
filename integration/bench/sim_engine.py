"""One simulated engine: a request trace replayed through the real HiCache scheduler.

No model runs and no bytes move. What decides hits is the production code:
:class:`~hicache.tiers.controller.scheduler.HiCacheScheduler` (HiRadixTree, slot
allocator, write policies, the L3 lookup and its threshold, the per-tier
counters the admin ``/stats`` reports). Around it this module models only
what lives outside the connector:

- **L1** (:class:`L1PrefixCache`): vLLM's block pool with prefix caching.
  One block of the pool is vLLM's null block; a request's hit is its longest
  prefix of cached full blocks (never the last prompt token); blocks of a
  finished request go to the tail of the free queue last-block-first, and
  allocation evicts from the head (LRU). A request waits (FIFO) when the
  free blocks cannot hold its prompt.
- **L3** (:class:`SimulatedL3`): the set of pages backed up so far, LRU
  evicted beyond an optional capacity; every page stored to L2 is backed
  up (as the workers do). A fetch always succeeds.
- **Time**: requests are admitted at their trace arrival and release their
  blocks at their trace finish (or an estimate); the prompt's pages are
  computed, cached and stored at admission, the decoded pages at finish. The
  scheduler's clock is the trace's (pins expire in trace seconds).
- **Client actions** (``hints=True``): a record's ``hicache`` hints reach the
  scheduler as the request's ``kv_transfer_params`` (``retain_s`` pins,
  ``priority``, ``store``, ...), and its ``prefetch_at`` replays the admin's
  ``POST /prefetch`` of its history at that time (with an L3: what L3 holds
  of it beyond L2 is read into L2 at once); a ``return_in_s`` hint books the
  same read of the finished request's pages for ``LEAD_S`` before its return,
  as the admin's returns thread does. ``hints=False`` replays the same
  trace as plain LRU would see it.
- **Eviction**: ``lru`` and ``tlru`` are the scheduler's own (policies.py); ``oracle`` replaces them with
  Belady's rule over the whole trace (oracle.py): the headroom of L2 eviction.

Page-hash traces are turned into token lists: every distinct page hash
becomes one page of a token id of its own, so two requests share a page
exactly when they share its hash (hashes are prefix-chained).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.integration.bench.oracle import FutureUses, OracleEviction
from hicache.integration.bench.trace import TraceRecord
from hicache.tiers.controller.policies import WRITE_POLICY_NAMES, make_eviction_policy
from hicache.tiers.controller.returns import LEAD_S, return_id
from hicache.tiers.controller.scheduler import HiCacheScheduler, NoRoom
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace, PageKey, page_keys, stand_in_seed
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

WRITE_POLICIES = WRITE_POLICY_NAMES
EVICTIONS = ("lru", "tlru", "oracle")
# Event kinds, in the order they run at one instant.
_FINISH, _PREFETCH, _BOOKED, _ARRIVAL = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    """Sizes and policies of one simulated engine."""

    # vLLM's num_gpu_blocks (the null block included, as the flag counts it).
    l1_blocks: int
    # L2 host pool capacity in pages; 0 = no connector (vLLM alone).
    l2_pages: int
    # L3 capacity in pages: None = no L3, -1 = unbounded.
    l3_pages: int | None = None
    block_size: int = 32
    page_size: int = 32
    write_policy: str = "write_through"
    write_threshold: int = 2
    # L3 lookups shorter than this many tokens are not worth a fetch (SGLang's default).
    prefetch_threshold: int = 256
    # L2 eviction: "lru" or "tlru" (the scheduler's policies) or "oracle" (Belady,
    # knows the trace).
    eviction: str = "lru"
    # tlru: pages at the end of each conversation it evicts first.
    tlru_tail_pages: int = 64
    # Act on the trace's client actions: per-request hints and admin prefetches.
    hints: bool = True

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {', '.join(EVICTIONS)}, "
                             f"got {self.eviction!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                             f"got {self.write_policy!r}")
        if self.l1_blocks < 2:
            raise ValueError(f"l1_blocks must be >= 2, got {self.l1_blocks}")
        if self.l2_pages < 0:
            raise ValueError(f"l2_pages must be >= 0, got {self.l2_pages}")
        if self.block_size <= 0 or self.page_size % self.block_size:
            raise ValueError(f"page_size ({self.page_size}) must be a multiple of "
                             f"block_size ({self.block_size})")


@dataclass
class RequestOutcome:
    """Where one request's prompt tokens came from."""

    id: str
    arrival: float
    prompt_tokens: int
    l1_pages: int
    l2_pages: int
    l3_pages: int
    # Seconds it waited for L1 blocks before admission.
    queued_s: float = 0.0

    @property
    def cached_pages(self) -> int:
        return self.l1_pages + self.l2_pages + self.l3_pages


@dataclass
class SimResult:
    """Totals of one replay; hit rates are shares of all prompt tokens."""

    config: SimConfig
    outcomes: list[RequestOutcome] = field(default_factory=list)
    l2_evicted_pages: int = 0
    l3_evicted_pages: int = 0
    # Replayed POST /prefetch calls, and the pages they read into L2.
    prefetches: int = 0
    prefetch_pages: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt_tokens for o in self.outcomes)

    def hit_rate(self, tier: str) -> float:
        total = self.prompt_tokens
        if total == 0:
            return 0.0
        pages = sum(getattr(o, f"{tier}_pages") for o in self.outcomes)
        return pages * self.config.page_size / total

    def hit_rates(self) -> dict[str, float]:
        rates = {t: self.hit_rate(t) for t in ("l1", "l2", "l3")}
        rates["total"] = sum(rates.values())
        return rates


class L1PrefixCache:
    """vLLM's block pool with prefix caching, by block key (block ids are not needed).

    The free queue holds every block no running request holds, cached ones
    (their key) and uncached ones (an int); allocation pops its head, a
    finished request appends its blocks to the tail last-block-first, a hit
    on a cached free block takes it out of the queue. A request's blocks are
    a list of the same entries, so a block shared by two requests is one.
    """

    def __init__(self, num_blocks: int) -> None:
        self._uncached = itertools.count()
        # vLLM takes one block out of the pool as its null block.
        self._free: OrderedDict[PageKey | int, None] = OrderedDict(
            (next(self._uncached), None) for _ in range(num_blocks - 1))
        self._held: dict[PageKey, int] = {}  # cached blocks of running requests: ref count
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def match(self, keys: Sequence[PageKey]) -> int:
        n = 0
        for key in keys:
            if key not in self._free and key not in self._held:
                break
            n += 1
        return n

    def allocate(self, hit: Sequence[PageKey], new_blocks: int) -> list[PageKey | int] | None:
        """Hold the hit blocks and ``new_blocks`` fresh ones (None, nothing done, if no room)."""
        reused = sum(1 for k in hit if k in self._free)
        if new_blocks + reused > len(self._free):
            return None
        for key in hit:
            self._free.pop(key, None)
            self._held[key] = self._held.get(key, 0) + 1
        return list(hit) + self._pop(new_blocks)

    def grow(self, blocks: list[PageKey | int], total: int) -> None:
        """Decoding needs ``total`` blocks; take what the queue still has."""
        blocks += self._pop(min(len(self._free), total - len(blocks)))

    def cache(self, blocks: list[PageKey | int], keys: Sequence[PageKey]) -> None:
        """The request's first ``len(keys)`` blocks are full: cache the uncached ones."""
        for i, key in enumerate(keys[: len(blocks)]):
            if isinstance(blocks[i], int) and key not in self._held and key not in self._free:
                blocks[i] = key
                self._held[key] = 1

    def free(self, blocks: Sequence[PageKey | int]) -> None:
        for block in reversed(blocks):
            if isinstance(block, int):
                self._free[block] = None
                continue
            ref = self._held[block] - 1
            if ref:
                self._held[block] = ref
            else:
                del self._held[block]
                self._free[block] = None

    def _pop(self, n: int) -> list[PageKey | int]:
        out: list[PageKey | int] = []
        for _ in range(n):
            entry, _ = self._free.popitem(last=False)
            if not isinstance(entry, int):
                self.evictions += 1
            out.append(next(self._uncached))
        return out


class SimulatedL3:
    """Pages backed up to L3; ``exists_prefix`` is what the scheduler asks."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages  # -1 = unbounded
        self._pages: OrderedDict[str, None] = OrderedDict()
        self.evictions = 0

    def put(self, key: str) -> None:
        self._pages[key] = None
        self._pages.move_to_end(key)
        while 0 <= self.capacity < len(self._pages):
            self._pages.popitem(last=False)
            self.evictions += 1

    def exists_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if key not in self._pages:
                break
            self._pages.move_to_end(key)
            n += 1
        return n


@dataclass
class SimRequest:
    """The attributes of vLLM's ``Request`` that the scheduler half reads (block hashes
    from the engine-free stand-in); also the scheduler tests' request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_request: Any = None
    block_size: int = 16
    # vLLM's per-request channel (HiCache's hints under "hicache").
    kv_transfer_params: dict[str, Any] | None = None
    # The tokens hashed so far and their hashes: a request's tokens only grow, so each
    # block is hashed once (a long prompt is asked for its hashes at every step).
    _hashed: tuple[list[int], list[bytes]] = field(
        default_factory=lambda: ([], []), repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """Stand-in for vLLM's block hashes (the scheduler keys pages from them):
        ``token_block_hashes`` of the tokens, the blocks hashed before not again."""
        tokens, size = self.all_token_ids, self.block_size
        full = len(tokens) // size * size
        seen, hashes = self._hashed
        if len(seen) > full or tokens[:len(seen)] != seen:  # not an extension: start over
            seen, hashes = [], []
        if len(seen) < full:
            hashes = hashes + list(page_keys(
                stand_in_seed(self.cache_salt), tokens[len(seen):full], size,
                parent=PageKey(hashes[-1]) if hashes else None))
            self._hashed = (list(tokens[:full]), hashes)
        return list(hashes)


@dataclass
class _Running:
    req: SimRequest
    record: TraceRecord
    blocks: list[PageKey | int]
    outcome: RequestOutcome
    # Its prompt's L1 block keys (hashed once, at admission).
    prompt_keys: list[PageKey] = field(default_factory=list)


class TokenSource:
    """Token lists for trace records; page-hash records get synthetic tokens."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._fresh = itertools.count(1 << 24)  # above every page-hash id

    def prompt(self, rec: TraceRecord) -> list[int]:
        if rec.prompt is not None:
            return list(rec.prompt)
        size = rec.page_size or 1
        tokens: list[int] = []
        for h in rec.page_hashes or ():
            tokens += [self._ids.setdefault(h, len(self._ids) + 1)] * size
        return tokens + [next(self._fresh) for _ in range(rec.prompt_tokens - len(tokens))]

    def output(self, rec: TraceRecord) -> list[int]:
        if rec.output is not None:
            return list(rec.output)
        return [next(self._fresh) for _ in range(rec.output_tokens)]


class SimEngine:
    """Replay a trace against one :class:`SimConfig`."""

    def __init__(self, config: SimConfig,
                 duration_of: Callable[[TraceRecord], float] | None = None) -> None:
        self.config = config
        self._duration_of = duration_of or (lambda r: 0.05 + 0.02 * r.output_tokens)
        self.l1 = L1PrefixCache(config.l1_blocks)
        self._l1_seed = b"hicache-sim-l1"
        self.l3 = SimulatedL3(config.l3_pages) if config.l3_pages is not None else None
        self.sched: HiCacheScheduler | None = None
        self._now = 0.0
        self._admitted = 0
        self._oracle = OracleEviction(FutureUses([])) if config.eviction == "oracle" else None
        if config.l2_pages > 0:
            namespace = KeyNamespace(model="sim", kv_dtype="sim", layout="sim",
                                     page_size=config.page_size, tp_size=1)
            self.sched = HiCacheScheduler(
                geometry=PoolGeometry(config.l2_pages, 1, config.page_size // config.block_size,
                                      1),
                namespace=namespace, page_size=config.page_size, block_size=config.block_size,
                # Block ids only matter as "not vLLM's null block (0)" here.
                block_ids_of=lambda req_id: [range(1, 1 << 30)],
                storage=self.l3,  # type: ignore[arg-type]
                policy=SchedulerPolicy(
                    write_policy=config.write_policy, write_threshold=config.write_threshold,
                    prefetch={"prefetch_threshold": config.prefetch_threshold},
                    # The simulated store takes every store at once (``_backup``): L3
                    # never lacks a page L2 holds, so there is nothing to catch up.
                    catch_up_pages=0),
                clock=lambda: self._now,
                eviction=self._oracle or make_eviction_policy(
                    config.eviction, tail_pages=config.tlru_tail_pages),
            )
        self._tokens = TokenSource()
        self._prepared: dict[int, tuple[SimRequest, list[PageKey]]] = {}
        self._running_count = 0
        self._events: list[tuple[float, int, int, Any]] = []  # (time, kind, seq, obj)
        self._order = itertools.count()
        if self.sched is not None and config.hints:
            # A request's return_in_s books its read back into L2, as the admin's
            # returns thread does (tiers/controller/returns.py).
            self.sched.returning = self._book_return

    def run(self, records: Sequence[TraceRecord]) -> SimResult:
        result = SimResult(self.config)
        order = self._order
        events = self._events = []
        for rec in records:
            heapq.heappush(events, (rec.arrival, _ARRIVAL, next(order), rec))
            if self.config.hints and rec.prefetch_at is not None and rec.prefetch_tokens:
                heapq.heappush(events, (rec.prefetch_at, _PREFETCH, next(order), rec))
        if self._oracle is not None and self.sched is not None:
            # Requests are admitted in arrival order (FIFO), ties in trace order.
            admitted = sorted(records, key=lambda r: r.arrival)
            self._oracle.uses = FutureUses(
                self.sched.prefix_keys(self._prepare(r)[0].all_token_ids, r.cache_salt)
                for r in admitted)
        waiting: deque[tuple[TraceRecord, float]] = deque()
        while events:
            now, kind, _, obj = heapq.heappop(events)
            self._now = now
            if waiting and self.sched is not None:
                # Engine steps ran since the last event: the queue's head was looked up.
                req, keys = self._prepare(waiting[0][0])
                local = self.l1.match(keys[: (req.num_tokens - 1) // self.config.block_size])
                self.sched.get_num_new_matched_tokens(req, local * self.config.block_size)
            if kind == _FINISH:
                self._finish(obj)
            elif kind == _PREFETCH:
                self._prefetch(obj, result)
            elif kind == _BOOKED:
                self._prefetch_keys(obj, result)
            else:
                waiting.append((obj, now))
            while waiting:
                rec, since = waiting[0]
                running = self._admit(rec, now - since)
                if running is None:
                    if self._running_count == 0:
                        raise ValueError(f"request {rec.id!r} needs more L1 blocks than "
                                         f"l1_blocks={self.config.l1_blocks} hold")
                    break
                waiting.popleft()
                result.outcomes.append(running.outcome)
                end = rec.finish if rec.finish is not None else now + self._duration_of(rec)
                heapq.heappush(events, (max(end, now), _FINISH, next(order), running))
        if self.sched is not None:
            result.l2_evicted_pages = self.sched.stats.evicted_pages
        result.l3_evicted_pages = self.l3.evictions if self.l3 is not None else 0
        return result

    def _prepare(self, rec: TraceRecord) -> tuple[SimRequest, list[PageKey]]:
        """The request of ``rec`` and its L1 block keys (built once: tokens may be synthetic)."""
        got = self._prepared.get(id(rec))
        if got is None:
            tokens = self._tokens.prompt(rec)
            if not tokens:
                raise ValueError(f"request {rec.id!r} has an empty prompt")
            params = ({"hicache": dict(rec.hints)} if self.config.hints and rec.hints
                      else None)
            req = SimRequest(f"{len(self._prepared)}:{rec.id}", tokens, 0, rec.cache_salt,
                              block_size=self.config.block_size, kv_transfer_params=params)
            keys = page_keys(self._l1_seed + (rec.cache_salt or "").encode(), tokens,
                             self.config.block_size)
            got = self._prepared[id(rec)] = (req, keys)
        return got

    def _admit(self, rec: TraceRecord, queued_s: float) -> _Running | None:
        """vLLM's order: local hit, connector lookup, then block allocation (which may fail).

        A request that cannot get blocks stays at the head of the queue and is
        looked up again at every step, as vLLM does: its L2 path stays recent.
        """
        cfg = self.config
        req, block_keys = self._prepare(rec)
        if self._oracle is not None:
            self._oracle.position = self._admitted  # this request's place in the trace
        tokens = req.all_token_ids
        hit_blocks = self.l1.match(block_keys[: (len(tokens) - 1) // cfg.block_size])
        local = hit_blocks * cfg.block_size
        lookup: tuple[int, bool] | None = None
        if self.sched is not None:
            external, is_async = self.sched.get_num_new_matched_tokens(req, local)
            assert external is not None  # the simulator's scheduler asks L3 inline
            lookup = (external, is_async)
        total_blocks = -(-len(tokens) // cfg.block_size)
        blocks = self.l1.allocate(block_keys[:hit_blocks], total_blocks - hit_blocks)
        if blocks is None:
            return None
        del self._prepared[id(rec)]
        self._running_count += 1
        self._admitted += 1
        outcome = RequestOutcome(rec.id, rec.arrival, len(tokens), 0, 0, 0, queued_s)
        if lookup is None:
            outcome.l1_pages = local // cfg.page_size
            req.num_computed_tokens = local
        else:
            outcome.l1_pages, outcome.l2_pages, outcome.l3_pages = self._connector_admit(
                req, local, *lookup)
        # The prompt's full blocks are cached as soon as they are scheduled.
        self.l1.cache(blocks, block_keys)
        return _Running(req, rec, blocks, outcome, block_keys)

    def _connector_admit(self, req: SimRequest, local: int, external: int,
                         is_async: bool) -> tuple[int, int, int]:
        sched = self.sched
        assert sched is not None
        st = sched.stats
        before = (st.l1_hit_pages, st.l2_hit_pages, st.l3_hit_pages)
        sched.update_state_after_alloc(req, [[]], external)
        if is_async:
            # The worker fetches every L3 page (a simulated store never fails).
            meta = sched.build_connector_meta({})
            report = WorkerReport(
                fetched={f.req_id: [len(f.l3_pages)] for f in meta.fetches})
            sched.on_worker_report(report)
            self._backup(meta)
        req.num_computed_tokens = local + external
        # Prefill: every prompt page's KV is complete at the end of this step.
        self._backup(sched.build_connector_meta(
            {req.request_id: req.num_tokens - req.num_computed_tokens}))
        req.num_computed_tokens = req.num_tokens
        return (st.l1_hit_pages - before[0], st.l2_hit_pages - before[1],
                st.l3_hit_pages - before[2])

    def _finish(self, running: _Running) -> None:
        cfg = self.config
        req = running.req
        prompt_len = req.num_tokens
        req.all_token_ids = req.all_token_ids + self._tokens.output(running.record)
        # The last generated token's KV is never computed.
        computed = max(prompt_len, req.num_tokens - 1)
        if self.sched is not None:
            if computed > prompt_len:
                self._backup(self.sched.build_connector_meta(
                    {req.request_id: computed - req.num_computed_tokens}))
            req.num_computed_tokens = computed
            self.sched.request_finished(req, [list(range(1, computed // cfg.block_size + 1))])
            self.sched.take_booked(req.request_id)
            self._backup(self.sched.build_connector_meta({}))
        seed = self._l1_seed + (req.cache_salt or "").encode()
        self.l1.grow(running.blocks, -(-computed // cfg.block_size))
        prompt_keys = running.prompt_keys
        done = len(prompt_keys) * cfg.block_size
        self.l1.cache(running.blocks, prompt_keys + page_keys(
            seed, req.all_token_ids[done:computed], cfg.block_size,
            parent=prompt_keys[-1] if prompt_keys else None))
        self.l1.free(running.blocks)
        self._running_count -= 1

    def _prefetch(self, rec: TraceRecord, result: SimResult) -> None:
        """The client's ``POST /prefetch`` of ``rec``'s history, as the admin runs it."""
        if self.sched is None or self.l3 is None:
            return  # the admin refuses it (409) without an L3
        req, _ = self._prepare(rec)
        self._prefetch_keys(
            self.sched.prefix_keys(req.all_token_ids[: rec.prefetch_tokens], rec.cache_salt),
            result)

    def _book_return(self, req_id: str, keys: Sequence[PageKey], return_in_s: float) -> str:
        """A finished request's ``return_in_s``: its read, due ``LEAD_S`` before then."""
        heapq.heappush(self._events, (self._now + max(0.0, return_in_s - LEAD_S), _BOOKED,
                                      next(self._order), list(keys)))
        return return_id(req_id)

    def _prefetch_keys(self, keys: Sequence[PageKey], result: SimResult) -> None:
        """What L3 holds of ``keys`` beyond L2, read into L2 at once."""
        if self.sched is None or self.l3 is None:
            return
        if self._oracle is not None:
            self._oracle.position = self._admitted
        result.prefetches += 1
        try:
            pages = self.sched.prefetch_prefix(keys, self.l3.exists_prefix([k.hex() for k in keys]))
        except NoRoom:
            return
        meta = self.sched.build_connector_meta({})
        self.sched.on_worker_report(WorkerReport(
            fetched={f.req_id: [len(f.l3_pages)] for f in meta.fetches}))
        self._backup(meta)
        result.prefetch_pages += pages

    def _backup(self, meta: Any) -> None:
        """The workers back every page stored in L2 up to L3."""
        if self.l3 is None:
            return
        for plan in meta.stores:
            self.l3.put(plan.key.hex())
