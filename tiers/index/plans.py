"""The plan of one engine step and the workers' report: plain data, no vLLM.

The scheduler (``tiers/controller``) builds a ``StepPlan``; ``connector/metadata.py``
wraps it into vLLM's ``KVConnectorMetadata`` and the workers' ``WorkerReport``
into ``KVConnectorWorkerMetadata``. See DESIGN.md "Flow of one request".

Scheduler -> workers: ``StepPlan`` (loads to perform before the
forward pass, stores to perform after it). Every TP rank applies the same
plan to its own KV shard, so plans name slots and block ids, never bytes.

Workers -> scheduler: ``WorkerReport`` (slots found unusable, L3
pages fetched per request, counter increments and latency observations for
the metrics of ``tiers/metrics.py``), merged over ranks with ``merge``.

L3 fetches (``RequestFetch``) are asynchronous: the worker reads the L3
pages into their reserved L2 slots, copies every page of the plan into the
request's blocks on its I/O thread, and reports the request in
``finished_recving`` (with the blocks it could not fill as load errors) in
some later step. vLLM does not schedule the request, so nothing else
touches its blocks, until then.

Null block: vLLM reserves block id 0 (``NULL_BLOCK_ID``) as its shared null
block and hands it out where a sliding window no longer reaches. Plans may
name it in a load (those tokens are not needed); workers never read or
write it and never report it as a load error, and the scheduler never
plans a store of a page that contains it.

Ordering contract: a worker executes steps in order, loads of a step before
its stores, and every load is complete before the step's ``wait_for_save``
returns. Stores may complete in a later step (tiers/worker/core.py,
"stores across steps"), but every copy runs in plan order on one copy
queue, so a later plan's load or store of a slot runs after an earlier
store into it. The scheduler relies on this to publish a page in the tree
as soon as its store is planned. What the copy queue does not order, the
worker waits for: an L3 read into, or a fetch out of, a slot with a store
in flight. A request whose stores may still be in flight keeps its blocks
after it finishes (``release_after_store``) and makes a step that preempts
it wait for them (``flush_stores``); ``WorkerReport.stores_done`` tells the
scheduler which plans are done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.tiers.index.commands import StorageCommand
from hicache.tiers.index.spans import SpanRef

# vLLM's BlockPool takes the first block (id 0) as its null block.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class PagePlan:
    """One page's worth of blocks moving between L1 and an L2 slot."""

    # L2 host pool slot holding the page.
    slot: int
    # Page key; the worker checks (load) or records (store) it per slot.
    key: bytes
    # Index within the page of the first block in block_ids (loads may start
    # mid-page when vLLM's own prefix cache already holds the page's head).
    first_offset: int
    # vLLM KV block ids for consecutive blocks of the page; with several KV
    # cache groups, every group's blocks for those tokens, concatenated in
    # group order (tiers/index/kv_groups.py).
    block_ids: tuple[int, ...]
    # Stores: the L3 keys the page is backed up under (None: its key, unless a
    # block is vLLM's null block: then none). Fetches: the L3 key it is read
    # from (None: its key). See page_keys.body_key.
    l3_keys: tuple[bytes, ...] | None = None
    l3_key: bytes | None = None
    # The L3 span object the page is stored in (stores: written whole with the
    # other pages of the span in this plan) or first read from (fetches: a miss
    # there is then read from its page object); None = its page object only.
    # See tiers/index/spans.py.
    span: SpanRef | None = None


@dataclass(frozen=True)
class RequestLoad:
    """L2 -> L1 copies that make up one request's external prefix hit."""

    req_id: str
    pages: tuple[PagePlan, ...]
    # Blocks vLLM expects loaded that no page covers: reported as load errors.
    unloadable_block_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestFetch:
    """An asynchronous hit that needs L3: L3 -> L2 slots, then L2 -> L1, off the step."""

    req_id: str
    # Pages already in L2 (the request's L2 hit), in prefix order.
    l2_pages: tuple[PagePlan, ...]
    # Pages to read from L3 into their (reserved) slots first; they follow l2_pages.
    l3_pages: tuple[PagePlan, ...]
    unloadable_block_ids: tuple[int, ...] = ()
    # Seconds the fetch may take (timeout policy); None = wait for all
    # (wait_complete); 0 = stop at the worker's next poll (best_effort).
    timeout_s: float | None = None
    # A prefetch at arrival (``req_id`` is ``prefetch_id`` of a request vLLM has
    # not admitted): L3 -> L2 only, no blocks, never reported to vLLM.
    prefetch: bool = False


def prefetch_id(req_id: str) -> str:
    """The fetch id of a request's prefetch at arrival (tiers/controller/prefetches.py),
    distinct from any request id's own fetch in plans and reports."""
    return f"hicache-prefetch:{req_id}"


@dataclass
class StepPlan:
    """The plan of one engine step."""

    loads: list[RequestLoad] = field(default_factory=list)
    stores: list[PagePlan] = field(default_factory=list)
    # Pages already in L2 to back up to L3 once this plan's stores are done, under
    # their L3 keys: the pages of a span completed by this plan, as that span's one
    # object (``span`` set; the span's pages are all here), the leading pages of a
    # span a store cut (page objects: they may sit in another request's span object,
    # which a lookup cannot name), pages the L3 admission rule admitted late.
    backups: list[PagePlan] = field(default_factory=list)
    # Finished requests whose blocks vLLM keeps until these stores are done;
    # the worker reports them in finished_sending after this step's saves.
    release_after_store: list[str] = field(default_factory=list)
    fetches: list[RequestFetch] = field(default_factory=list)
    # Admin commands for every worker, applied before anything else of the
    # step (tiers/index/commands.py).
    storage_commands: list[StorageCommand] = field(default_factory=list)
    # No request computes in this step (vLLM only waits for loads): the worker
    # may block a little for its L3 fetches instead of letting the engine spin.
    idle: bool = False
    # The plan's number (the scheduler counts from 1): a worker reports the
    # highest plan whose stores, and every earlier plan's, are in L2.
    seq: int = 0
    # A request preempted in this step had stores in flight: the worker waits
    # for them before the forward pass (vLLM may reuse its blocks there).
    flush_stores: bool = False


@dataclass
class WorkerReport:
    """What workers tell the scheduler after a step."""

    # Slots found unusable this step (failed store or key mismatch).
    bad_slots: set[int] = field(default_factory=set)
    # req_id -> L3 pages fetched into L2 (a prefix of its l3_pages), one
    # entry per rank that finished that fetch this step; the scheduler waits
    # for every rank and keeps the minimum.
    fetched: dict[str, list[int]] = field(default_factory=dict)
    # Counter increments since the last report (bytes, pages), summed over ranks.
    counters: dict[str, float] = field(default_factory=dict)
    # rank -> its current values that changed (tiers/metrics.py WorkerGauge: queue
    # depths, an open L3 breaker); a value absent is unchanged on that rank.
    gauges: dict[int, dict[str, float]] = field(default_factory=dict)
    # Latency observations since the last report (seconds), every rank's.
    observations: dict[str, list[float]] = field(default_factory=dict)
    # rank -> the highest plan ``seq`` whose stores (and all before) are done on
    # that rank; present when it changed.
    stores_done: dict[int, int] = field(default_factory=dict)
    # rank -> page keys (L3 keys) its L3 backups stored since its last report;
    # the scheduler marks a page in L3 once every writing rank reported it.
    l3_stored: dict[int, list[bytes]] = field(default_factory=dict)
    # rank -> how many L3-changing storage commands (flush, forget, attach, detach:
    # tiers/index/commands.py ``L3_CHANGES``) it had applied when it took those
    # keys; the scheduler drops the keys a change the rank had not applied removed.
    l3_changes: dict[int, int] = field(default_factory=dict)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both ranks' reports in one (vLLM merges a step's reports over ranks)."""
        fetched = {k: list(v) for k, v in self.fetched.items()}
        for req_id, counts in other.fetched.items():
            fetched.setdefault(req_id, []).extend(counts)
        counters = dict(self.counters)
        for name, value in other.counters.items():
            counters[name] = counters.get(name, 0) + value
        gauges = {rank: dict(values) for rank, values in self.gauges.items()}
        for rank, latest in other.gauges.items():
            gauges.setdefault(rank, {}).update(latest)
        observations = {k: list(v) for k, v in self.observations.items()}
        for name, values in other.observations.items():
            observations.setdefault(name, []).extend(values)
        l3_stored = {rank: list(keys) for rank, keys in self.l3_stored.items()}
        for rank, keys in other.l3_stored.items():
            l3_stored.setdefault(rank, []).extend(keys)
        return type(self)(self.bad_slots | other.bad_slots, fetched, counters, gauges,
                          observations, {**self.stores_done, **other.stores_done}, l3_stored,
                          {**self.l3_changes, **other.l3_changes})
