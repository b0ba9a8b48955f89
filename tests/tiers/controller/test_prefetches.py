"""Prefetch at arrival (tiers/controller/prefetches.py) on the scheduler, without an
engine: a new request's L3 pages go to L2 while it waits, its lookup waits (or not)
as the prefetch policy says, and it is then served from L2 synchronously.

Stores are the real file backend, gated where a lookup must be slow; the timeout
policy runs on a test clock, so nothing depends on how fast the machine is."""

from __future__ import annotations

from concurrent.futures import wait

import pytest
from support.clock import ManualClock
from support.fakes import (
    GatedStore,
    file_store,
    keys_of,
    request,
    scheduler_args,
    write_prompt_pages,
)

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport, prefetch_id
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
TOKENS = list(range(100, 133))  # 4 full pages + 1 token
PID = prefetch_id("r")


def in_l3(tmp_path, tokens: list[int]) -> None:
    """Every full page of ``tokens`` in the file L3, as another engine stored them."""
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)


def make(tmp_path, policy="wait_complete", store=None, clock=None,
         **kw) -> HiCacheScheduler:
    in_l3(tmp_path, TOKENS)
    sched = HiCacheScheduler(**scheduler_args(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [[]],
        storage=store or file_store(tmp_path, NS, GEOM), clock=clock or ManualClock(100), **kw,
        policy=SchedulerPolicy(background_lookups=True, prefetch_at_arrival=True, prefetch_policy=policy, prefetch={"prefetch_threshold": 0, "prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.0, "prefetch_timeout_max": 30.0})))
    return sched


def arrive(sched: HiCacheScheduler, req) -> None:
    """vLLM's on_new_request, then the answer of its probe (waited for, not timed)."""
    sched.on_new_request(req)
    probe = sched.fetches.probes._probes.get(req.request_id)
    if probe is not None:
        assert wait([probe.future], timeout=30).done
    sched.prefetches.advance()


def test_arrival_prefetches_into_l2_then_the_request_loads_from_l2(tmp_path):
    sched = make(tmp_path)
    req = request("r", TOKENS)
    arrive(sched, req)
    assert sched.stats.prefetches == 1 and sched.stats.prefetch_pages == 4
    # Waiting for its prefetch: vLLM is told to ask again.
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    meta = sched.build_connector_meta({})
    (fetch,) = meta.fetches
    assert fetch.prefetch and fetch.req_id == PID and fetch.l2_pages == ()
    assert len(fetch.l3_pages) == 4 and all(p.block_ids == () for p in fetch.l3_pages)
    assert fetch.timeout_s is None  # wait_complete: the worker reads every page
    assert sched.slots.num_used == 4 and sched.tree.total_pages() == 0
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.tree.total_pages() == 4
    # Admitted now: an L2 hit, loaded synchronously, no second L3 fetch.
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, False)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 4 * PAGE)
    meta = sched.build_connector_meta({"r": 1})
    assert not meta.fetches and len(meta.loads) == 1
    assert [p.block_ids for p in meta.loads[0].pages] == [(10, 11), (12, 13), (14, 15),
                                                         (16, 17)]
    # Counted where the pages were when the request arrived: L3.
    assert sched.stats.l2_hit_pages == 0 and sched.stats.l3_hit_pages == 4
    assert sched.l3_tokens_of("r") == 4 * PAGE
    assert sched.stats.l3_fetched_pages == 4 and sched.stats.prefetch_waits == 2
    sched.tree.check_invariants()


def test_prefetch_waits_for_every_tp_rank(tmp_path):
    sched = make(tmp_path, tp_size=2)
    req = request("r", TOKENS)
    arrive(sched, req)
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.on_worker_report(WorkerReport(fetched={PID: [3]}))
    # The pages both ranks got; the rest is asked of L3 at admission again.
    assert sched.tree.total_pages() == 3 and sched.slots.num_used == 3
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, True)


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
def test_a_request_that_stops_waiting_takes_its_l2_match_only(tmp_path, policy):
    clock = ManualClock(100)
    sched = make(tmp_path, policy=policy, clock=clock)
    req = request("r", TOKENS)
    arrive(sched, req)
    (fetch,) = sched.build_connector_meta({}).fetches
    # The worker stops a timeout-policy prefetch at the deadline; best_effort's runs on.
    assert fetch.timeout_s == (1.0 if policy == "timeout" else None)
    if policy == "timeout":
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        clock.now += 0.99
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        clock.now += 0.02  # past the 1 s deadline
    # Nothing is in L2 yet: recompute, and the prefetch's pages serve later turns.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 0)
    assert sched.stats.prefetch_late == 1
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.tree.total_pages() == 4
    later = request("s", TOKENS)
    assert sched.get_num_new_matched_tokens(later, 0) == (4 * PAGE, False)


def test_a_request_aborted_before_its_prefetch_left_frees_the_slots(tmp_path):
    sched = make(tmp_path)
    req = request("r", TOKENS)
    arrive(sched, req)
    assert sched.slots.num_used == 4
    sched.request_finished(req, ([],))
    assert sched.stats.prefetch_cancelled == 1
    assert sched.slots.num_used == 0 and not sched.fetches.in_flight
    assert not sched.build_connector_meta({}).fetches
    sched.tree.check_invariants()


def test_a_prefetch_already_sent_ends_normally_after_its_request_left(tmp_path):
    sched = make(tmp_path)
    req = request("r", TOKENS)
    arrive(sched, req)
    (fetch,) = sched.build_connector_meta({}).fetches
    sched.request_finished(req, ([],))
    assert sched.stats.prefetch_cancelled == 0
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.tree.total_pages() == 4 and not sched.fetches.in_flight


def gated_arrival(tmp_path):
    """A request arrives while its lookup is held inside a gated store."""
    store = GatedStore(file_store(tmp_path, NS, GEOM))
    sched = make(tmp_path, store=store)
    req = request("r", TOKENS)
    sched.on_new_request(req)
    store.entered(1)
    return sched, store, req


def test_slow_lookup_starts_the_prefetch_when_it_answers(tmp_path):
    sched, store, req = gated_arrival(tmp_path)
    sched.prefetches.advance()
    assert sched.stats.prefetches == 0
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    store.gate.set()
    assert wait([sched.fetches.probes._probes["r"].future], timeout=30).done
    (fetch,) = sched.build_connector_meta({}).fetches  # advance() started it
    assert fetch.prefetch and sched.stats.prefetches == 1
    sched.fetches.probes.close()


def test_prefetches_in_flight_are_bounded_by_half_of_l2(tmp_path):
    other = list(range(300, 333))
    sched = make(tmp_path)
    in_l3(tmp_path, other)
    longer = request("r", TOKENS)
    arrive(sched, longer)
    arrive(sched, request("s", other))
    arrive(sched, request("t", list(range(500, 533))))  # not in L3: no prefetch
    assert sched.stats.prefetch_pages == 8 == GEOM.num_slots // 2
    third = list(range(700, 733))
    in_l3(tmp_path, third)
    arrive(sched, request("u", third))
    assert sched.stats.prefetch_pages == 8 and sched.stats.prefetch_skipped == 1


def test_no_prefetch_when_turned_off_or_below_the_threshold(tmp_path):
    sched = make(tmp_path)
    sched.prefetch_at_arrival = False
    arrive(sched, request("r", TOKENS))
    assert sched.stats.prefetches == 0 and not sched.build_connector_meta({}).fetches
    sched = make(tmp_path / "b")
    sched.prefetch["prefetch_threshold"] = 5 * PAGE
    arrive(sched, request("r", TOKENS))
    assert sched.stats.prefetches == 0


def test_an_arrival_lookup_answered_at_admission_starts_the_prefetch_there(tmp_path):
    sched, store, req = gated_arrival(tmp_path)
    store.gate.set()
    assert wait([sched.fetches.probes._probes["r"].future], timeout=30).done
    # vLLM tries to admit it before any plan: the answer starts the prefetch, and
    # the request waits for it instead of an admission-time fetch.
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert sched.stats.prefetches == 1 and not sched.fetches.is_fetching("r")
    sched.fetches.probes.close()


def test_prefetched_pages_stay_in_l2_until_their_request_is_admitted(tmp_path):
    sched = make(tmp_path)
    req = request("r", TOKENS)
    arrive(sched, req)
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.tree.total_pages() == 4
    # A store that needs all of L2 cannot evict them while "r" waits.
    assert sched.l2.room() == GEOM.num_slots - 4
    assert sched.l2.allocate(GEOM.num_slots - 3) is None
    assert sched.tree.total_pages() == 4
    # Admitted: its load locks the pages until the plan leaves, then they are
    # ordinary cached pages again.
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, False)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 4 * PAGE)
    sched.build_connector_meta({"r": 1})
    assert sched.l2.room() == GEOM.num_slots
    sched.tree.check_invariants()


def test_an_aborted_request_releases_its_prefetched_pages(tmp_path):
    sched = make(tmp_path)
    req = request("r", TOKENS)
    arrive(sched, req)
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={PID: [4]}))
    assert sched.l2.room() == GEOM.num_slots - 4
    sched.request_finished(req, ([],))
    assert sched.l2.room() == GEOM.num_slots and sched.tree.total_pages() == 4
    assert sched.prefetches.reserved_pages() == 0


def test_a_run_the_budget_cannot_hold_whole_is_left_to_admission(tmp_path):
    longer = list(range(300, 341))  # 5 pages + 1
    sched = make(tmp_path)
    in_l3(tmp_path, longer)
    arrive(sched, request("r", TOKENS))  # 4 of the 8-page budget
    s = request("s", longer)
    arrive(sched, s)
    # Not 4 of its 5 pages (a 1-page tail could fall under prefetch_threshold):
    # none, and its lookup at admission fetches all 5.
    assert sched.stats.prefetch_pages == 4 and sched.stats.prefetch_skipped == 1
    assert sched.get_num_new_matched_tokens(s, 0) == (5 * PAGE, True)


def test_making_room_for_a_prefetch_never_evicts_the_prefix_it_extends(tmp_path):
    sched = make(tmp_path)  # L3 holds every page of TOKENS
    keys = keys_of(NS.seed(), TOKENS, PAGE)
    # L2: the request's first page, 13 pages a load holds locked, 2 free slots:
    # the room for its 3 L3 pages can only come from evicting that first page.
    assert sched.l2.plan_store(keys[:1], [[1, 2]])
    other = keys_of(NS.seed(), list(range(500, 500 + 13 * PAGE)), PAGE)
    assert sched.l2.plan_store(other, [list(range(4, 30))])
    sched.l2.release_planned_stores()  # as once their plan is built
    sched.tree.lock(sched.tree.match_prefix(other).node)
    assert sched.slots.num_free == 2
    arrive(sched, request("r", TOKENS))
    # The prefix it extends stays; with no other room the prefetch is skipped.
    assert sched.tree.match_prefix(keys[:1]).num_pages == 1
    assert sched.stats.prefetches == 0 and sched.stats.prefetch_skipped == 1
    assert sched.slots.num_free == 2
    sched.tree.check_invariants()


def test_an_admin_prefetch_makes_the_next_turn_an_l2_hit_with_no_l3_read(tmp_path):
    """POST /prefetch of an L3-only history (through SchedulerAdmin): the next plan
    carries a prefetch of its pages; once the workers report them, the session's next
    turn is a synchronous L2 hit and its admission asks L3 nothing."""
    from hicache.tiers.controller.admin import SchedulerAdmin

    class Config:
        hicache_storage_backend = "file"

    sched = make(tmp_path)
    sched.prefetch_at_arrival = False  # what the request would do by itself
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0)
    got = admin.prefetch(TOKENS, None, op_id="turn-2")
    assert {k: got[k] for k in ("prefetch_tokens", "l3_tokens", "l2_tokens", "id", "status",
                                "pages", "fetched_pages")} == {
        "prefetch_tokens": 4 * PAGE, "l3_tokens": 4 * PAGE, "l2_tokens": 0, "id": "turn-2",
        "status": "queued", "pages": 4, "fetched_pages": None}
    # The same id again is the same operation; another id joins the running read.
    assert admin.prefetch(TOKENS, None, op_id="turn-2")["prefetch_tokens"] == 0
    joined = admin.prefetch(TOKENS, None)
    assert joined["prefetch_tokens"] == 0 and joined["pages"] == 4
    assert joined["status"] == "queued" and joined["id"] != "turn-2"
    (fetch,) = sched.build_connector_meta({}).fetches
    assert fetch.prefetch and len(fetch.l3_pages) == 4 and fetch.l2_pages == ()
    assert fetch.timeout_s is None  # no ttl_s: no deadline
    assert admin.prefetch_status("turn-2")["status"] == "running"
    sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [4]}))
    for op_id in ("turn-2", joined["id"]):
        assert admin.prefetch_status(op_id)["status"] == "done"
        assert admin.prefetch_status(op_id)["fetched_pages"] == 4
    assert sched.tree.peek(keys_of(NS.seed(), TOKENS, PAGE)) == 4
    lookups = sched.stats.l3_lookups
    req = request("r", TOKENS)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, False)  # sync: L2
    sched.update_state_after_alloc(req, [list(range(1, 10))], 4 * PAGE)
    assert sched.cached_tokens_of("r").as_dict() == {"l1": 0, "l2": 4 * PAGE, "l3": 0}
    assert sched.stats.l3_lookups == lookups
    plan = sched.build_connector_meta({})
    assert plan.fetches == [] and len(plan.loads[0].pages) == 4
    assert admin.prefetch(TOKENS, None)["prefetch_tokens"] == 0  # L2 holds it all


def test_an_arrival_never_waits_for_its_probe(tmp_path, monkeypatch):
    """vLLM's scheduling thread takes arrivals: the probe an arrival starts is not
    waited for at all (a 1 ms fast path per arriving request would add up on a
    busy server); the lookup at admission still gives a fast store its 1 ms."""
    waits: list[float] = []
    monkeypatch.setattr("hicache.tiers.controller.probes.futures_wait",
                        lambda futures, timeout: waits.append(timeout))
    store = GatedStore(store=file_store(tmp_path, NS, GEOM))
    sched = make(tmp_path, store=store)
    try:
        sched.on_new_request(request("r", TOKENS))
        store.entered(1)  # the probe runs, held at the gate
        assert waits == []
        assert sched.get_num_new_matched_tokens(request("s", list(range(500, 533))), 0) == (
            None, False)
        assert waits == [sched.fetches.probes.fast_wait_s]  # the admission's fast path
    finally:
        store.gate.set()
        sched.fetches.probes.close()


def _admin(sched, **kw):
    from hicache.tiers.controller.admin import SchedulerAdmin

    class Config:
        hicache_storage_backend = "file"

    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0, **kw)
    sched.prefetch_at_arrival = False
    return admin


def test_a_prefetch_id_names_one_prompt_and_running_prefetches_are_bounded(tmp_path):
    from hicache.tiers.controller.admin import Conflict, NotFound

    sched = make(tmp_path)
    other = list(range(300, 333))
    in_l3(tmp_path, other)
    admin = _admin(sched)
    admin.prefetches.max_running = 1
    assert admin.prefetch(TOKENS, None, op_id="a")["status"] == "queued"
    with pytest.raises(Conflict, match="already names another prompt"):
        admin.prefetch(other, None, op_id="a")
    with pytest.raises(Conflict, match="1 prefetches are queued or running"):
        admin.prefetch(other, None, op_id="b")
    assert sched.fetches.take() and sched.stats.prefetches == 1  # only "a" planned
    with pytest.raises(NotFound, match="no prefetch with id 'b'"):
        admin.prefetch_status("b")
    with pytest.raises(NotFound):
        admin.cancel_prefetch("b")


def test_cancel_drops_a_queued_prefetch_and_stops_a_running_one(tmp_path):
    from hicache.tiers.index.commands import CancelFetches

    sched = make(tmp_path)
    woke: list[int] = []
    admin = _admin(sched, wake=lambda: woke.append(1))
    free = sched.slots.num_free
    admin.prefetch(TOKENS, None, op_id="q")
    assert sched.slots.num_free == free - 4 and woke == [1]
    cancelled = admin.cancel_prefetch("q")
    assert (cancelled["status"], cancelled["fetched_pages"]) == ("cancelled", 0)
    assert sched.slots.num_free == free and not sched.has_worker_work()
    assert sched.build_connector_meta({}).fetches == []

    admin.prefetch(TOKENS, None, op_id="r")
    (fetch,) = sched.build_connector_meta({}).fetches
    assert admin.prefetch_status("r")["status"] == "running"
    assert admin.cancel_prefetch("r")["status"] == "cancelled"
    assert sched.build_connector_meta({}).storage_commands == [
        CancelFetches((fetch.req_id,))]
    sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [2]}))
    ended = admin.prefetch_status("r")
    assert (ended["status"], ended["fetched_pages"]) == ("cancelled", 2)
    assert sched.tree.peek(keys_of(NS.seed(), TOKENS, PAGE)) == 2


def test_ttl_bounds_the_read_and_a_short_read_is_failed(tmp_path):
    sched = make(tmp_path)
    admin = _admin(sched)
    admin.prefetch(TOKENS, None, op_id="t", ttl_s=0.5)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert fetch.timeout_s == 0.5
    sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [1]}))
    got = admin.prefetch_status("t")
    assert (got["status"], got["pages"], got["fetched_pages"], got["ttl_s"]) == (
        "failed", 4, 1, 0.5)
    # What L2 holds now needs no read: the next operation is done at once.
    again = admin.prefetch(TOKENS[:PAGE + 1], None, op_id="u")
    assert (again["status"], again["pages"], again["fetched_pages"]) == ("done", 0, 0)


def test_ended_operations_are_kept_up_to_a_bound(tmp_path):
    sched = make(tmp_path)
    admin = _admin(sched)
    admin.prefetches.keep = 2
    for op_id in "abc":  # L2 holds nothing to read for these: each ends at once
        admin.prefetch([5, 6, 7], None, op_id=op_id)
    assert admin.prefetches.status("a") is None
    assert admin.prefetches.status("c")["status"] == "done"


def test_operations_nobody_asked_about_are_recorded_and_trimmed_too(tmp_path):
    """An operation whose read ended is recorded when the next one starts, asked for
    or not, so the kept ones stay bounded; and a later read of the same prompt (the
    same fetch id) does not change what the earlier operation reports."""
    sched = make(tmp_path)
    admin = _admin(sched)
    admin.prefetches.keep = 1
    admin.prefetch(TOKENS, None, op_id="first")
    (fetch,) = sched.build_connector_meta({}).fetches
    sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [3]}))  # never asked
    assert sched.l2.reset() and sched.tree.peek(keys_of(NS.seed(), TOKENS, PAGE)) == 0
    admin.prefetch(TOKENS, None, op_id="second")  # the same prompt: the same fetch id
    assert admin.prefetches.status("first") == {**admin.prefetches.status("first"),
                                                "status": "failed", "fetched_pages": 3}
    (again,) = sched.build_connector_meta({}).fetches
    assert again.req_id == fetch.req_id
    sched.on_worker_report(WorkerReport(fetched={again.req_id: [4]}))
    assert admin.prefetches.status("first")["fetched_pages"] == 3
    admin.prefetch([5, 6, 7], None, op_id="third")  # ends at once: "first" goes
    assert admin.prefetches.status("first") is None
    assert admin.prefetches.status("second") is None  # keep=1: only the newest
    assert admin.prefetches.status("third")["status"] == "done"
