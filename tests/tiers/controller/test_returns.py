"""A request's ``return_in_s`` (tiers/controller/returns.py): the prefetch of its prompt
and answer is booked for shortly before the conversation returns, started when due
through the admin view (real scheduler, real file L3, a test clock), followed and
cancelled by its id; a start that fails is a hint lost, never an error."""

from __future__ import annotations

import threading

from support.clock import ManualClock
from support.fakes import file_store, keys_of, request, scheduler_args, write_prompt_pages

from hicache.tiers.controller.admin import SchedulerAdmin
from hicache.tiers.controller.returns import LEAD_S, ReturnPrefetches, return_id
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.page_keys import KeyNamespace, PageKey
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
TOKENS = list(range(100, 133))  # 4 full pages + 1 token
KEYS = [PageKey(bytes([i]) * 32) for i in range(3)]


def test_bookings_start_when_due_oldest_first_and_can_be_replaced_or_cancelled():
    clock, started = ManualClock(100), []
    returns = ReturnPrefetches(lambda op, keys: started.append((op, list(keys))), clock=clock)
    assert returns.book("a", KEYS, 5.0) == "return-a"
    assert returns.book("b", KEYS[:1], 0.5) == "return-b"  # due at once (0.5 < lead)
    assert returns.book("c/1 x", KEYS[:2], 3.0) == "return-c_1_x"  # the admin's id pattern
    assert returns.view("return-a") == {
        "id": "return-a", "status": "booked", "pages": 0, "fetched_pages": None,
        "ttl_s": None, "age_s": 0.0, "due_in_s": 5.0 - LEAD_S}
    assert returns.run_due() == 1 and started == [("return-b", KEYS[:1])]
    clock.now += 2.0
    assert returns.run_due() == 1 and started[-1] == ("return-c_1_x", KEYS[:2])
    returns.book("a", KEYS[:2], 10.0)  # booked again: the later booking replaces it
    clock.now += 3.0
    assert returns.run_due() == 0 and returns.pending() == 1
    assert returns.cancel("return-a") and not returns.cancel("return-a")
    clock.now += 100.0
    assert returns.run_due() == 0 and returns.view("return-a") is None
    assert returns.started == 2 and returns.pending() == 0


def test_a_start_that_raises_is_counted_and_the_others_still_start():
    clock, started = ManualClock(100), []

    def start(op_id, keys):
        if op_id == "return-bad":
            raise RuntimeError("the store is gone")
        started.append(op_id)

    returns = ReturnPrefetches(start, clock=clock)
    returns.book("bad", KEYS, 0.0)
    returns.book("good", KEYS, 0.0)
    assert returns.run_due() == 2 and started == ["return-good"]
    assert (returns.started, returns.failed) == (1, 1)
    # The id the response named still answers: failed, and why.
    failed = returns.view("return-bad")
    assert failed is not None and failed["status"] == "failed"
    assert failed["error"] == "not started: the store is gone"
    assert returns.view("return-good") is None  # started: the prefetch operations' now


def test_a_booking_being_started_is_queued_and_a_cancel_waits_for_its_start():
    """Between leaving the bookings and reaching the prefetch operations (its start asks
    L3 what it holds first) an id is ``queued``, never unknown (an engine test's poll
    once found it unknown there); a cancel meanwhile waits, then leaves it to the
    operations."""
    clock, entered, release = ManualClock(100), threading.Event(), threading.Event()

    def start(op_id, keys):
        entered.set()
        assert release.wait(60)

    returns = ReturnPrefetches(start, clock=clock)
    returns.book("a", KEYS, 0.0)
    runner = threading.Thread(target=returns.run_due)
    runner.start()
    assert entered.wait(60)
    view = returns.view("return-a")
    assert view is not None and view["status"] == "queued"
    cancelled: list[object] = []
    canceller = threading.Thread(target=lambda: cancelled.append(returns.cancel("return-a")))
    canceller.start()
    assert not cancelled  # waiting for the start (it cannot end: release is not set)
    release.set()
    runner.join(60)
    canceller.join(60)
    assert cancelled == [None] and returns.view("return-a") is None


def test_the_thread_starts_a_due_booking_and_stops_on_close():
    done = threading.Event()
    returns = ReturnPrefetches(lambda op, keys: done.set())
    returns.start_thread()
    returns.book("now", KEYS, 0.0)
    assert done.wait(30)  # an event, not a time: started by the thread, not by us
    returns.close()
    assert returns._thread is not None and not returns._thread.is_alive()


def scheduler(tmp_path, storage=True) -> HiCacheScheduler:
    write_prompt_pages(tmp_path, NS, GEOM, TOKENS, PAGE)  # L3 holds the conversation
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables.get(rid, [])],
        storage=file_store(tmp_path, NS, GEOM) if storage else None))
    s.tables = tables
    return s


def finish_turn(sched, rid: str, hints: dict):
    """One request of TOKENS, computed (no load, no store: L2 stays empty) and finished;
    the prefetch its response names (None: none)."""
    req = request(rid, TOKENS)
    req.kv_transfer_params = {"hicache": {"store": False, "load_tiers": [], **hints}}
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = list(range(1, 10))
    sched.tables[rid] = blocks
    sched.update_state_after_alloc(req, [blocks], 0)
    sched.build_connector_meta({rid: req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    _, params, _ = sched.finish_request(req, [blocks])
    return params["hicache"].get("prefetch_id")


class Config:
    hicache_storage_backend = "file"


def test_return_in_s_reads_the_conversation_back_into_l2_before_it_returns(tmp_path):
    sched, clock = scheduler(tmp_path), ManualClock(100)
    woken = []
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0,
                           wake=lambda: woken.append(1))
    admin.returns.clock = clock
    try:
        assert finish_turn(sched, "r1", {"return_in_s": 5}) == "return-r1"
        keys = keys_of(NS.seed(), TOKENS, PAGE)
        assert sched.tree.peek(keys) == 0  # not in L2: the turn stored nothing
        view = admin.prefetch_status("return-r1")
        assert (view["status"], view["due_in_s"]) == ("booked", 5 - LEAD_S)
        clock.now += 5 - LEAD_S - 0.01
        assert admin.returns.run_due() == 0
        clock.now += 0.01
        assert admin.returns.run_due() == 1 and woken == [1]
        op = admin.prefetch_status("return-r1")
        assert (op["status"], op["pages"]) == ("queued", 4)
        (fetch,) = sched.build_connector_meta({}).fetches
        assert fetch.prefetch and len(fetch.l3_pages) == 4
        sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [4]}))
        assert admin.prefetch_status("return-r1")["status"] == "done"
        assert sched.tree.peek(keys) == 4  # the next turn is an L2 hit
        # Booked, then cancelled before it was due: nothing is read.
        assert finish_turn(sched, "r2", {"return_in_s": 60}) == "return-r2"
        assert admin.cancel_prefetch("return-r2")["status"] == "cancelled"
        clock.now += 120
        assert admin.returns.run_due() == 0 and sched.build_connector_meta({}).fetches == []
    finally:
        admin.close()


def test_without_l3_nothing_is_booked(tmp_path):
    sched = scheduler(tmp_path, storage=False)
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0)
    try:
        assert finish_turn(sched, "r", {"return_in_s": 5}) is None
        assert admin.returns.pending() == 0
    finally:
        admin.close()
    assert return_id("x") == "return-x"
