"""Sessions (tiers/controller/sessions.py) on the scheduler half, without an engine.

A request's ``session_id`` groups a conversation: ``retain_s`` and ``priority``
carry to turns that do not set them; closing ends its pins and ranks its own
pages below every open session's (so they are evicted first even when newer), or
with ``forget`` removes them from L2 and plans their removal from L3, never the
system prompt another session shares. The clock is injected.
"""

from __future__ import annotations

import pytest
from support.clock import ManualClock
from support.fakes import keys_of, request, scheduler_args
from support.fakes import serve as serve_request

from hicache.tiers.controller.hints import parse_hints
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.sessions import CLOSED_PRIORITY, Sessions
from hicache.tiers.index.commands import DeletePages
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE, SLOTS = 4, 8, 16
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
GEOM = PoolGeometry(num_slots=SLOTS, num_layers=2, blocks_per_page=2, block_bytes=64)
SYSTEM = list(range(100, 116))  # 2 pages every conversation shares


def scheduler(clock: ManualClock, **kw) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], clock=clock, **kw))
    s.tables = tables  # type: ignore[attr-defined]
    return s


def serve(sched, rid, tokens, **hints):
    """One request through admission, its prefill and its end; its state's hints."""
    req = request(rid, tokens + [1])
    if hints:
        req.kv_transfer_params = {"hicache": hints}
    state = sched.requests.state_of(req)
    serve_request(sched, req)
    return state.hints


def conversation(n: int, pages: int = 2) -> list[int]:
    return SYSTEM + list(range(1000 * n, 1000 * n + pages * PAGE))


def in_l2(sched, tokens) -> int:
    return sched.tree.peek(keys_of(NS.seed(), tokens, PAGE))


def test_retention_and_priority_carry_from_turn_to_turn():
    clock = ManualClock(1000)
    sched = scheduler(clock)
    first = serve(sched, "t1", conversation(1), session_id="s", retain_s=30, priority="high")
    assert (first.retain_s, first.priority) == (30, "high")
    second = serve(sched, "t2", conversation(1, 3), session_id="s")
    assert (second.retain_s, second.priority) == (30, "high")
    third = serve(sched, "t3", conversation(1, 4), session_id="s", priority="low")
    assert (third.retain_s, third.priority) == (30, "low")
    assert serve(sched, "t4", conversation(1, 4), session_id="s").priority == "low"
    # Another session, and a request without one, carry nothing.
    assert serve(sched, "o", conversation(2), session_id="other").retain_s is None
    assert serve(sched, "n", conversation(3)).retain_s is None
    assert sched.sessions.stats() == {"open": 2, "closed": 0}
    assert sched.sessions.get("s").turns == 4


def test_a_closed_session_is_evicted_first_and_its_pins_end():
    clock = ManualClock(1000)
    sched = scheduler(clock)
    serve(sched, "b", conversation(2), session_id="open")
    clock.now += 1
    serve(sched, "a", conversation(1), session_id="closing", retain_s=600)  # newer
    assert sched.pins.stats()["pins"] == 1
    counts, l3_op = sched.close_session("closing")
    assert counts == {"released_pins": 1, "demoted_pages": 2} and l3_op is None
    assert sched.pins.stats()["pins"] == 0
    own = keys_of(NS.seed(), conversation(1), PAGE)
    assert sched.tree.node_of(own[-1]).priority == CLOSED_PRIORITY
    assert sched.tree.node_of(own[0]).priority > CLOSED_PRIORITY  # the shared prompt
    sched.tree.check_invariants()
    # A prompt that needs two pages more than L2 has free: LRU alone would take the
    # open session's (older), the closed session's go instead.
    clock.now += 1
    serve(sched, "c", SYSTEM + list(range(9000, 9000 + 12 * PAGE)))
    assert in_l2(sched, conversation(2)) == 4
    assert in_l2(sched, conversation(1)) == 2  # the system prompt only
    assert sched.sessions.stats() == {"open": 1, "closed": 1}


def test_close_with_forget_removes_its_own_pages_from_every_tier():
    clock = ManualClock(1000)
    sched = scheduler(clock)
    serve(sched, "a1", conversation(1), session_id="s")
    serve(sched, "a2", conversation(1, 3), session_id="s")  # extends its first turn
    serve(sched, "b", conversation(2), session_id="keep")
    assert sched.sessions.get("s").paths == [keys_of(NS.seed(), conversation(1, 3), PAGE)]
    counts, l3_op = sched.close_session("s", forget=True)
    assert counts["l2_pages"] == 3 and counts["kept_shared_pages"] == 2
    own = keys_of(NS.seed(), conversation(1, 3), PAGE)[2:]
    assert isinstance(l3_op, DeletePages) and set(own) <= set(l3_op.keys)
    assert in_l2(sched, conversation(1, 3)) == 2 and in_l2(sched, conversation(2)) == 4
    sched.tree.check_invariants()


def test_unknown_sessions_reopening_and_the_bound():
    clock = ManualClock(1000)
    sched = scheduler(clock)
    with pytest.raises(KeyError):
        sched.close_session("nobody")
    serve(sched, "a", conversation(1), session_id="s")
    sched.close_session("s")
    serve(sched, "b", conversation(1, 3), session_id="s")  # the agent came back
    assert sched.sessions.get("s").open

    sessions = Sessions(max_sessions=2, clock=clock)
    for sid in ("x", "y"):
        sessions.hints_for(parse_hints({"hicache": {"session_id": sid}})[0])
    sessions.close("x")
    sessions.hints_for(parse_hints({"hicache": {"session_id": "z"}})[0])
    assert sessions.get("x") is None and sessions.get("y") is not None  # closed goes first
    sessions.hints_for(parse_hints({"hicache": {"session_id": "w"}})[0])
    assert sessions.get("y") is None and sessions.stats() == {"open": 2, "closed": 0}


def test_a_bad_session_id_names_the_key():
    hints, error = parse_hints({"hicache": {"session_id": ""}})
    assert hints.session_id is None and "kv_transfer_params.hicache.session_id" in error
