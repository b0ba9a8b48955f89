"""Scheduler half of stores across steps (tiers/controller/stores.py): which finished
requests keep their blocks, and when a step must wait for stores in flight.

Real scheduler; vLLM's Request is the simulator's ``SimRequest`` (support.fakes)."""

from support.fakes import request
from test_scheduler import make_scheduler, prefill

from hicache.tiers.index.plans import WorkerReport


def test_a_request_finishing_while_its_store_runs_keeps_its_blocks_until_done():
    sched = make_scheduler(async_stores=True)
    req = request("a", range(100, 116))  # two full pages, stored in the prefill step
    meta = prefill(sched, req, [1, 2, 3, 4])
    assert meta.seq == 1 and len(meta.stores) == 2
    # Nothing left to store, but the prefill's store may still read blocks 1-4.
    assert sched.request_finished(req, [[1, 2, 3, 4]]) is True
    nxt = sched.build_connector_meta({})
    assert nxt.release_after_store == ["a"] and nxt.stores == []


def test_a_request_whose_stores_every_rank_reported_done_is_freed_at_once():
    sched = make_scheduler(async_stores=True, tp_size=2)
    req = request("a", range(100, 116))
    prefill(sched, req, [1, 2, 3, 4])
    sched.on_worker_report(WorkerReport(stores_done={0: 1}))  # rank 1 has not reported
    done_on_one = request("b", range(200, 216))
    prefill(sched, done_on_one, [5, 6, 7, 8])  # plan 2
    sched.on_worker_report(WorkerReport(stores_done={1: 1}))
    assert sched.request_finished(req, [[1, 2, 3, 4]]) is False
    # Plan 2's store is done on rank 0 only: still in flight on rank 1.
    sched.on_worker_report(WorkerReport(stores_done={0: 2}))
    assert sched.request_finished(done_on_one, [[5, 6, 7, 8]]) is True


def test_preempting_a_request_with_a_store_in_flight_flushes_the_stores():
    sched = make_scheduler(async_stores=True)
    req = request("a", range(100, 116))
    prefill(sched, req, [1, 2, 3, 4])
    other = request("b", range(300, 308))
    assert sched.build_connector_meta({}, preempted=["a"]).flush_stores is True
    assert sched.build_connector_meta({}, preempted=["b", other.request_id]).flush_stores \
        is False  # unknown or storeless requests never flush
    sched.on_worker_report(WorkerReport(stores_done={0: 1}))
    assert sched.build_connector_meta({}, preempted=["a"]).flush_stores is False


def test_without_async_stores_nothing_is_held_or_flushed():
    sched = make_scheduler()
    req = request("a", range(100, 116))
    meta = prefill(sched, req, [1, 2, 3, 4])
    assert len(meta.stores) == 2
    assert sched.build_connector_meta({}, preempted=["a"]).flush_stores is False
    assert sched.request_finished(req, [[1, 2, 3, 4]]) is False


def test_vllm_keeps_stepping_until_every_rank_reported_the_stores_done():
    sched = make_scheduler(async_stores=True, tp_size=2)
    prefill(sched, request("a", range(100, 116)), [1, 2, 3, 4])
    assert sched.has_pending_stores()  # vLLM's has_pending_push_work
    sched.on_worker_report(WorkerReport(stores_done={0: 1}))
    assert sched.has_pending_stores()
    sched.on_worker_report(WorkerReport(stores_done={1: 1}))
    assert not sched.has_pending_stores()
