"""L3 catch-up on the scheduler, without an engine (tiers/controller/catch_up.py).

Pages L2 holds and L3 lacks -- after an L3 flush or attach, a failed backup --
are backed up with later plans, hottest first, parents first, at most
``catch_up_pages`` in flight, only while the workers' L3 I/O is idle, never
twice while a backup is in flight, retried after ``retry_s`` a bounded number
of times. A backup a rank reports from before an L3 change reached it counts
for nothing. The store is the real file backend; the clock is injected; the
workers are the helpers below: they apply every command of the plans built
(``backups``) and report with the count of L3 changes applied.
"""

from __future__ import annotations

import pytest
from support.clock import ManualClock
from support.fakes import file_store, prefill, request, scheduler_args

from hicache.tiers.config import HiCacheConfig
from hicache.tiers.controller.catch_up import MAX_TRIES
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.commands import L3_CHANGES, AttachStore, L3Removal
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import RequestFetch, WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.metrics import WorkerGauge as G

BS, PAGE = 4, 8
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)


def make(tmp_path, clock: ManualClock, slots: int = 16, **kw) -> HiCacheScheduler:
    geometry = PoolGeometry(num_slots=slots, num_layers=2, blocks_per_page=2, block_bytes=64)
    tables: dict[str, list[int]] = {}
    sched = HiCacheScheduler(**scheduler_args(
        geometry=geometry, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], storage=file_store(tmp_path, NS, geometry),
        clock=clock, **kw, policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0})))
    sched.tables = tables  # type: ignore[attr-defined]
    sched.applied = 0  # type: ignore[attr-defined]  # L3 changes the workers applied
    return sched


def tokens_of(base: int, pages: int) -> list[int]:
    return list(range(base, base + pages * PAGE + 1))  # full pages + one token


def compute(sched: HiCacheScheduler, rid: str, tokens: list[int]) -> list[bytes]:
    """A request with no hit computes its prompt; returns the keys its plan stores."""
    plan = prefill(sched, request(rid, tokens), list(range(1, len(tokens) // BS + 2)))
    return [p.key for p in plan.stores]


def report(sched: HiCacheScheduler, keys, queue: float = 0, changes: int | None = None,
           ) -> None:
    """Rank 0 stored ``keys`` (having applied ``changes`` L3 changes: all it got)."""
    applied = sched.applied if changes is None else changes  # type: ignore[attr-defined]
    sched.on_worker_report(WorkerReport(
        l3_stored={0: list(keys)}, gauges={0: {G.L3_BACKUP_QUEUE_PAGES: queue}},
        l3_changes={0: applied}))


def backups(sched: HiCacheScheduler) -> list[bytes]:
    """The keys the next plan backs up; the workers apply its commands."""
    meta = sched.build_connector_meta({})
    sched.applied += sum(isinstance(c, L3_CHANGES)  # type: ignore[attr-defined]
                         for c in meta.storage_commands)
    return [p.key for p in meta.backups]


def flushed_l3(sched: HiCacheScheduler, queue: bool = True) -> L3Removal:
    """The admin's flush of L3: the tree first, then (after its own store) the command."""
    _, op = sched.flush({"l3"}, None)
    assert op is not None
    if queue:
        sched.queue_command(op)
    return op


def attached(sched: HiCacheScheduler) -> None:
    sched.l3_changed()
    sched.queue_command(AttachStore("file", {}))


def test_after_an_l3_flush_l2_is_backed_up_again_in_bounded_batches(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, catch_up_pages=3)
    keys = compute(sched, "a", tokens_of(100, 5))
    report(sched, keys)
    assert sched.tree.l3_pages() == 5 and backups(sched) == []  # nothing lacking
    flushed_l3(sched)
    assert sched.tree.l3_pages() == 0
    first = backups(sched)
    assert first == keys[:3]  # parents first, at most 3 in flight
    assert sched.catch_up.backlog == 5 and sched.has_worker_work()
    assert backups(sched) == []  # no room until the workers report
    report(sched, first)
    assert backups(sched) == keys[3:]
    report(sched, keys[3:])
    assert backups(sched) == [] and sched.tree.l3_pages() == 5
    assert sched.catch_up.backlog == 0 and not sched.has_worker_work()
    assert sched.stats.l3_catch_up_pages == 5


def test_a_backlog_is_walked_once_and_taken_in_order_by_later_plans(tmp_path, monkeypatch):
    """The tree's L2 part is walked by one scan; the plans that follow take its
    queue, in order, without walking it again."""
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, catch_up_pages=2)
    keys = compute(sched, "a", tokens_of(100, 6))
    report(sched, keys)
    flushed_l3(sched)
    walks = []
    walk = sched.catch_up._lacking_nodes
    monkeypatch.setattr(sched.catch_up, "_lacking_nodes", lambda: walks.append(1) or walk())
    taken = []
    for _ in range(3):
        got = backups(sched)
        assert len(got) == 2
        taken += got
        report(sched, got)
    assert taken == keys and len(walks) == 1
    assert backups(sched) == [] and not sched.has_worker_work()


def test_an_expired_backup_goes_back_to_the_head_of_the_queue(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, catch_up_pages=2)
    keys = compute(sched, "a", tokens_of(100, 4))
    report(sched, keys)
    flushed_l3(sched)
    first = backups(sched)
    assert first == keys[:2]
    report(sched, first[1:])  # the first page's backup is lost
    clock.now += sched.catch_up.retry_s
    assert backups(sched) == [keys[0], keys[2]]  # before the rest of the queue
    assert sched.catch_up.backlog == 3  # keys[3] queued, two in flight


def test_hottest_conversation_first(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, catch_up_pages=2)
    old = compute(sched, "old", tokens_of(100, 2))
    clock.now += 5
    new = compute(sched, "new", tokens_of(500, 2))
    flushed_l3(sched)
    assert backups(sched) == new
    report(sched, new)
    assert backups(sched) == old


def test_waits_for_idle_io_and_never_doubles_a_backup_in_flight(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock)
    keys = compute(sched, "a", tokens_of(100, 3))
    # The stores' own backups are in flight: not queued again.
    assert backups(sched) == []
    flushed_l3(sched)  # ...until L3 is flushed: the workers drop them
    report(sched, [], queue=7)  # a rank's backup queue is busy
    assert backups(sched) == []
    # An idle engine must go on stepping: nothing scanned yet since the flush.
    assert sched.has_worker_work()
    sched.fetches.in_flight["r"] = RequestFetch("r", (), ())  # a fetch runs
    report(sched, [], queue=0)
    assert backups(sched) == []
    del sched.fetches.in_flight["r"]
    assert backups(sched) == keys


def test_a_backup_reported_from_before_an_l3_flush_counts_for_nothing(tmp_path):
    """The rank took these keys before it applied the flush (the report crossed the
    admin's flush): the flush deleted them, so the tree must not mark them in L3."""
    clock = ManualClock(1000)
    sched = make(tmp_path, clock)
    keys = compute(sched, "a", tokens_of(100, 3))
    op = flushed_l3(sched, queue=False)  # the admin still clears its own instance
    report(sched, keys)  # taken before the flush: dropped
    assert backups(sched) == []  # the catch-up waits for the command to go out
    assert sched.tree.l3_pages() == 0
    sched.queue_command(op)
    assert backups(sched) == keys  # the plan carries the flush, then the backups
    report(sched, keys, changes=0)  # a late report from before the flush: dropped
    assert sched.tree.l3_pages() == 0
    report(sched, keys)  # after it
    assert sched.tree.l3_pages() == 3 and not sched.has_worker_work()


def test_a_report_from_before_a_partial_flush_keeps_the_pages_it_did_not_remove(tmp_path):
    """A prefix flush of L3 (or a forget) removes one conversation's pages: a report
    taken before it still counts for the other's, not for the removed ones."""
    clock = ManualClock(1000)
    sched = make(tmp_path, clock)
    a_tokens = tokens_of(100, 3)
    a = compute(sched, "a", a_tokens)
    b = compute(sched, "b", tokens_of(500, 2))
    report(sched, a)  # a's first report: the flush below removes what the tree knows
    _, op = sched.flush({"l3"}, a_tokens[:PAGE])  # a's first page and below
    assert op is not None and set(op.keys) == set(a)
    sched.queue_command(op)
    report(sched, [*a, *b], changes=0)  # a second batch, taken before the flush
    assert sched.tree.l3_pages() == 2  # b's
    assert backups(sched) == a  # the catch-up writes a's again, after the flush
    report(sched, a)
    assert sched.tree.l3_pages() == 5 and not sched.has_worker_work()


def test_a_refused_l3_removal_leaves_reports_counting(tmp_path):
    """A flush whose store refused the removal (the admin's 400) queues no command:
    the workers' L3 did not change, and their reports still count."""
    clock = ManualClock(1000)
    sched = make(tmp_path, clock)
    keys = compute(sched, "a", tokens_of(100, 2))
    flushed_l3(sched, queue=False)
    sched.l3_change_dropped()
    report(sched, keys)
    assert sched.tree.l3_pages() == 2 and backups(sched) == []


def test_a_failed_backup_is_retried_a_bounded_number_of_times(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock)
    keys = compute(sched, "a", tokens_of(100, 2))  # their backups never report
    assert backups(sched) == []
    # Nothing to queue yet, but an idle engine must go on stepping to see them expire.
    assert sched.catch_up.has_work()
    for _ in range(MAX_TRIES):
        clock.now += sched.catch_up.retry_s
        assert backups(sched) == keys
    clock.now += sched.catch_up.retry_s
    assert backups(sched) == [] and not sched.has_worker_work()
    # Another store attached: the catch-up starts over.
    attached(sched)
    assert backups(sched) == keys


def test_attaching_another_store_forgets_what_the_tree_knew_of_l3(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, slots=2)
    first = compute(sched, "a", tokens_of(100, 2))
    report(sched, first)
    compute(sched, "b", tokens_of(500, 2))  # evicts a's pages: L3-only now
    assert sched.tree.l3_only_pages() == 2
    attached(sched)
    assert sched.tree.l3_pages() == 0 and sched.tree.total_pages() == 2
    sched.tree.check_invariants()


def test_reused_admission_catches_up_only_pages_it_admitted(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, l3_admission="reused")
    once = compute(sched, "once", tokens_of(100, 2))
    assert backups(sched) == []
    flushed_l3(sched)
    assert backups(sched) == []  # computed once: L2 only
    clock.now += sched.catch_up.rescan_s
    # A second request reaches them: admitted, backed up with the next plan.
    req = request("again", tokens_of(100, 2))
    assert sched.get_num_new_matched_tokens(req, 0)[0] == 2 * PAGE
    assert backups(sched) == once


def test_off_with_zero_pages_and_bad_values_name_the_key(tmp_path):
    clock = ManualClock(1000)
    sched = make(tmp_path, clock, catch_up_pages=0)
    compute(sched, "a", tokens_of(100, 2))
    flushed_l3(sched)
    assert backups(sched) == [] and not sched.has_worker_work()
    with pytest.raises(ValueError, match="hicache_l3_catch_up_pages"):
        HiCacheConfig.from_extra_config({"hicache_l3_catch_up_pages": -1})
