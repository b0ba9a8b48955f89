"""Pins (tiers/controller/pins.py): a request's ``retain_s`` and the admin's pins keep
pages in L2 through a flood of other prompts, end exactly at their deadline (injected
clock), stay within their share of L2, and end when their pages are flushed or
forgotten. The scheduler half without an engine."""

import time

import pytest
from support.clock import ManualClock
from support.fakes import file_store, keys_of, request, scheduler_args, write_prompt_pages
from support.fakes import serve as serve_request

from hicache.tiers.controller.pins import PinRefused, Pins
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.commands import RetainPages
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE, SLOTS = 4, 8, 16
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
GEOM = PoolGeometry(num_slots=SLOTS, num_layers=2, blocks_per_page=2, block_bytes=64)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000)


def scheduler(clock: ManualClock, **kw) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=GEOM,
        namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [tables[rid]],
        clock=clock, **kw))
    s.tables = tables
    return s


def serve(sched, rid, tokens, **hints):
    """One request through admission, one prefill step and its end; the step's plan."""
    req = request(rid, tokens + [1])
    if hints:
        req.kv_transfer_params = {"hicache": hints}
    serve_request(sched, req)
    return sched.take_retained(rid)


def in_l2(sched, tokens) -> int:
    return sched.tree.peek(keys_of(NS.seed(), tokens, PAGE))


SESSION = list(range(100, 124))  # 3 pages


def flood(sched, rounds: int = 4) -> None:
    """Other prompts worth ``rounds`` times L2."""
    for i in range(rounds * SLOTS // 4):
        serve(sched, f"f{i}", list(range(10_000 + 40 * i, 10_000 + 40 * i + 32)))


def test_retained_session_survives_a_flood_and_leaves_at_its_deadline(clock):
    sched = scheduler(clock)
    assert serve(sched, "s", SESSION, retain_s=60) == 3
    flood(sched)
    assert in_l2(sched, SESSION) == 3  # a full L2 hit when it returns
    assert sched.pins.stats()["next_expiry_s"] == 60
    clock.now += 59.9
    flood(sched)
    assert in_l2(sched, SESSION) == 3
    clock.now += 0.1  # the deadline: the next plan ends the pin
    flood(sched)
    assert in_l2(sched, SESSION) == 0
    assert sched.pins.stats() == {"pins": 0, "pinned_pages": 0, "max_pages": SLOTS // 2,
                                  "yielded": 0, "next_expiry_s": None}


def test_without_retain_s_the_flood_evicts_the_session(clock):
    sched = scheduler(clock)
    assert serve(sched, "s", SESSION) is None
    flood(sched)
    assert in_l2(sched, SESSION) == 0


def test_pins_stay_within_their_share_of_l2(clock):
    sched = scheduler(clock, retain_max_share=0.25)  # 4 of 16 pages
    assert serve(sched, "a", SESSION, retain_s=60) == 3
    refused = serve(sched, "b", list(range(300, 324)), retain_s=60)
    assert isinstance(refused, str) and "hicache_retain_max_share=0.25" in refused
    with pytest.raises(PinRefused):
        sched.pins.pin(keys_of(NS.seed(), list(range(300, 324)), PAGE), 5)
    # The same prefix again extends its deadline, no new pages.
    assert serve(sched, "a2", SESSION, retain_s=120) == 3
    assert sched.pins.stats()["pins"] == 1 and sched.pins.stats()["next_expiry_s"] == 120
    assert sched.pins.unpin(keys_of(NS.seed(), SESSION, PAGE)) == 3
    flood(sched)
    assert in_l2(sched, SESSION) == 0


def test_flush_forget_and_reset_end_the_pins_of_what_they_drop(clock):
    sched = scheduler(clock)
    serve(sched, "s", SESSION, retain_s=600)
    counts, _ = sched.forget(SESSION)
    assert counts["l2_pages"] == 3 and counts["skipped_locked"] == 0
    assert sched.pins.stats()["pins"] == 0
    serve(sched, "s2", SESSION, retain_s=600)
    assert sched.flush({"l2"}, None)[0]["l2_pages"] >= 3 and sched.pins.stats()["pins"] == 0
    serve(sched, "s3", SESSION, retain_s=600)
    assert sched.reset() and sched.pins.stats()["pins"] == 0
    sched.tree.check_invariants()


def test_a_sessions_next_turn_takes_over_the_pin_of_its_last(clock):
    sched = scheduler(clock, retain_max_share=0.375)  # 6 of 16 pages
    turns = [SESSION + list(range(500, 500 + 8 * n)) for n in range(3)]  # 3, 4, 5 pages
    assert serve(sched, "t0", turns[0], retain_s=60) == 3
    clock.now += 5
    # Its pages count once: 4, not 3 + 4 (which would pass the share).
    assert serve(sched, "t1", turns[1], retain_s=60) == 4
    assert sched.pins.stats()["pins"] == 1 and sched.pins.pinned_pages == 4
    # A pin ending earlier than the one it extends does not replace it.
    refused = serve(sched, "t2", turns[2], retain_s=1)
    assert isinstance(refused, str) and "4 pinned now" in refused
    assert serve(sched, "t2b", turns[2], retain_s=60) == 5
    assert sched.pins.stats() == {"pins": 1, "pinned_pages": 5, "max_pages": 6,
                                  "yielded": 0, "next_expiry_s": 60}
    flood(sched)
    assert in_l2(sched, turns[2]) == 5
    sched.tree.check_invariants()


def test_pins_give_way_to_an_l3_fetch_that_finds_no_room(clock, tmp_path):
    """L2 is all pins; a request whose history only L3 holds still gets its L3 hit:
    pins end, soonest deadline first, until the fetch has room (stores never do that:
    the flood tests above)."""
    sched = scheduler(clock, retain_max_share=1.0, storage=file_store(tmp_path, NS, GEOM),
                      prefetch={"prefetch_threshold": 0})
    sessions = [list(range(100 * i, 100 * i + 32)) for i in range(1, 5)]  # 4 pages each
    for i, tokens in enumerate(sessions):
        assert serve(sched, f"s{i}", tokens, retain_s=60 + i) == 4
    assert sched.pins.pinned_pages == SLOTS and sched.l2.room() == 0
    history = list(range(5000, 5024))  # 3 pages, in L3 only
    write_prompt_pages(tmp_path, NS, GEOM, history, PAGE)
    back = request("back", history + [1])
    assert sched.get_num_new_matched_tokens(back, 0) == (3 * PAGE, True)
    sched.update_state_after_alloc(back, [[1, 2, 3, 4, 5, 6, 7]], 3 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert len(fetch.l3_pages) == 3
    assert sched.pins.stats()["yielded"] == 1  # s0's pin, the soonest to end
    assert in_l2(sched, sessions[0]) < 4
    assert all(in_l2(sched, tokens) == 4 for tokens in sessions[1:])
    sched.tree.check_invariants()


def test_retain_s_asks_every_workers_l3_to_keep_the_pages_as_long(clock, tmp_path):
    sched = scheduler(clock, storage=file_store(tmp_path, NS, GEOM))
    req = request("s", SESSION + [1])
    req.kv_transfer_params = {"hicache": {"retain_s": 90}}
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [[]], 0)
    sched.tables["s"] = list(range(1, 8))
    sched.build_connector_meta({"s": req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    asked = time.time()
    sched.request_finished(req, [list(range(1, 8))])
    (command,) = sched.build_connector_meta({}).storage_commands
    assert isinstance(command, RetainPages)
    assert command.keys == tuple(keys_of(NS.seed(), SESSION + [1], PAGE))
    assert asked + 90 <= command.until <= time.time() + 90
    assert sched.build_connector_meta({}).storage_commands == []  # once
    # Without an L3 there is nothing to ask.
    plain = scheduler(clock)
    assert serve(plain, "s", SESSION, retain_s=90) == 3
    assert plain.build_connector_meta({}).storage_commands == []


def test_admin_pin_and_unpin_reach_l3_too(clock, tmp_path):
    from hicache.tiers.controller.admin import SchedulerAdmin

    class Config:
        hicache_storage_backend = "file"
        hicache_storage_backend_extra_config = {"path": str(tmp_path)}

    sched = scheduler(clock, storage=file_store(tmp_path, NS, GEOM))
    serve(sched, "s", SESSION)
    sched.build_connector_meta({})
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0)
    assert admin.pin(SESSION, None, 30.0) == {"pinned_pages": 3, "ttl_s": 30.0}
    (kept,) = sched.build_connector_meta({}).storage_commands
    assert kept.keys == tuple(keys_of(NS.seed(), SESSION, PAGE)) and kept.until > time.time()
    assert admin.unpin(SESSION, None) == {"unpinned_pages": 3}
    (ended,) = sched.build_connector_meta({}).storage_commands
    assert ended == RetainPages(kept.keys, 0.0)


def _slots_accounted(sched) -> None:
    """Every slot is free, or held by exactly one page of the tree, or reserved by a
    fetch in flight: nothing lost, nothing given out twice."""
    held = [s for n in sched.tree.iter_nodes() if n is not sched.tree.root
            for s in (n.host_slots or ())]
    reserved = [s for f in sched.fetches.in_flight.values() for s in f.slots]
    assert len(set(held)) == len(held)
    assert sched.slots.num_free + len(set(held) | set(reserved)) == SLOTS
    sched.tree.check_invariants()


@pytest.mark.parametrize("order", ["prefetch-pin-flush", "pin-flush-prefetch",
                                   "flush-prefetch-pin"])
def test_flush_pin_and_prefetch_of_one_prefix_at_once_lose_nothing(clock, tmp_path, order):
    """The admin's three actions on one session, in any order while its fetch is in
    flight (the worker reports at the end): every slot stays accounted for, the tree
    stays whole, a flush ends the pins of what it drops, and the session served
    afterwards is whatever survived, never a page twice."""
    history = list(range(7000, 7032))  # 4 pages
    sched = scheduler(clock, storage=file_store(tmp_path, NS, GEOM),
                      prefetch={"prefetch_threshold": 0})
    assert serve(sched, "head", history[:16]) is None  # 2 pages in L2
    write_prompt_pages(tmp_path, NS, GEOM, history, PAGE)  # all 4 in L3
    keys = keys_of(NS.seed(), history, PAGE)
    actions = {
        "prefetch": lambda: sched.prefetch_prefix(keys, 4),
        "pin": lambda: sched.pins.pin(keys, 60),
        "flush": lambda: sched.flush({"l2", "l3"}, history),
    }
    for name in order.split("-"):
        actions[name]()
        _slots_accounted(sched)
    plan = sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={f.req_id: [len(f.l3_pages)]
                                                 for f in plan.fetches}))
    sched.build_connector_meta({})
    _slots_accounted(sched)
    assert not sched.fetches.in_flight
    assert in_l2(sched, history) <= 4 and sched.pins.pinned_pages <= in_l2(sched, history)


def test_a_prompt_longer_than_the_room_pins_leave_stores_its_head(clock, tmp_path):
    """Pins hold 12 of 16 pages; a 6-page prompt cannot be stored whole. Its first 4
    pages are (and go to L3 with them), not nothing until the pins end; the pins stay.
    Once they have ended, the prompt's next visit stores the rest."""
    sched = scheduler(clock, retain_max_share=1.0, storage=file_store(tmp_path, NS, GEOM))
    for i in range(3):
        assert serve(sched, f"s{i}", list(range(100 * (i + 1), 100 * (i + 1) + 32)),
                     retain_s=60) == 4
    assert sched.pins.pinned_pages == 12 and sched.l2.room() == 4
    long = list(range(7000, 7048))  # 6 pages
    req = request("long", long + [1])
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [list(range(1, 14))], 0)
    sched.tables["long"] = list(range(1, 14))
    plan = sched.build_connector_meta({"long": req.num_tokens})
    keys = keys_of(NS.seed(), long, PAGE)
    assert [p.key for p in plan.stores] == keys[:4]
    assert all(p.l3_keys for p in plan.stores)  # write-through: backed up with them
    assert in_l2(sched, long) == 4 and sched.pins.pinned_pages == 12
    req.num_computed_tokens = req.num_tokens
    sched.request_finished(req, [list(range(1, 14))])  # its end: still no room for more
    sched.build_connector_meta({})
    assert in_l2(sched, long) == 4
    clock.now += 61  # the pins end
    assert serve_request(sched, request("again", long + [1])) == 4 * PAGE
    assert in_l2(sched, long) == 6
    sched.tree.check_invariants()


def test_deadlines_end_pins_in_order_and_an_extended_pin_keeps_its_new_one(clock):
    """Pins on a bare tree: ``expire`` ends what is due (an extension moves the
    deadline, the old one ends nothing), the pinned pages follow every end, and
    renewing one pin again and again keeps the deadline heap small."""
    tree = HiRadixTree(clock)
    a, b = keys_of(NS.seed(), list(range(16)), PAGE), keys_of(NS.seed(), list(range(50, 66)), PAGE)
    tree.insert(a, [0, 1])
    tree.insert(b, [2, 3])
    pins = Pins(tree, capacity_pages=8, clock=clock)
    assert pins.pin(a, 10) == 2 and pins.pin(b, 5) == 2 and pins.pinned_pages == 4
    clock.now += 1
    assert pins.pin(b, 20) == 2  # now due 20 s from here
    clock.now += 5
    assert pins.expire() == 0 and pins.pinned_pages == 4  # b's old deadline ends nothing
    clock.now += 5
    assert pins.expire() == 1 and pins.pinned_pages == 2 and tree.evictable_pages() == 2
    for _ in range(1000):
        clock.now += 0.001
        pins.pin(b, 20)
    assert len(pins._deadlines) <= 2 * 1 + 64 + 1
    clock.now += 21
    assert pins.expire() == 1 and pins.pinned_pages == 0 and tree.evictable_pages() == 4
