"""Scheduler half without an engine: plans for stores, loads, mid-page starts and odd counts.

vLLM's Request is replaced by the simulator's ``SimRequest``, which has what
the scheduler half reads (``SchedulerRequest``); everything else is real.
"""

import pytest
from support.fakes import keys_of, prefill, request, scheduler_args

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

BS = 4  # tokens per vLLM block
PAGE = 8  # tokens per page: 2 blocks




def make_scheduler(**policy):
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64),
        namespace=KeyNamespace("m", "f32", "cpu", PAGE, 1), page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], **policy,
    ))
    s.tables = tables
    return s


@pytest.fixture
def sched():
    return make_scheduler()


def test_prefill_stores_every_full_page(sched):
    req = request("a", range(100, 120))  # 20 tokens = 2 full pages + 4
    meta = prefill(sched, req, [7, 3, 9, 4, 5])
    assert [(p.slot, p.first_offset, p.block_ids) for p in meta.stores] == [
        (meta.stores[0].slot, 0, (7, 3)), (meta.stores[1].slot, 0, (9, 4))]
    assert sched.tree.total_pages() == 2 == sched.slots.num_used


def test_returning_prompt_loads_pages_and_leaves_one_token(sched):
    prefill(sched, request("a", range(100, 116)), [1, 2, 3, 4])  # exactly 2 pages
    again = request("b", range(100, 116))  # same 16 tokens: only 1 page may be claimed
    assert sched.get_num_new_matched_tokens(again, 0) == (PAGE, False)
    longer = request("c", list(range(100, 116)) + [5])
    assert sched.get_num_new_matched_tokens(longer, 0) == (2 * PAGE, False)
    sched.update_state_after_alloc(longer, [[10, 11, 12, 13, 14]], 2 * PAGE)
    meta = sched.build_connector_meta({})
    (load,) = meta.loads
    assert [(p.first_offset, p.block_ids) for p in load.pages] == [(0, (10, 11)), (0, (12, 13))]
    assert load.unloadable_block_ids == ()


def test_local_hit_ending_mid_page_loads_from_that_block(sched):
    prefill(sched, request("a", range(100, 116)), [1, 2, 3, 4])
    req = request("b", list(range(100, 116)) + [5, 6])
    # vLLM's own cache already holds the first 3 blocks (12 tokens).
    assert sched.get_num_new_matched_tokens(req, 12) == (4, False)
    sched.update_state_after_alloc(req, [[20, 21, 22, 23, 24]], 4)
    (load,) = sched.build_connector_meta({}).loads
    assert [(p.first_offset, p.block_ids) for p in load.pages] == [(1, (23,))]


def test_fewer_external_tokens_than_offered_loads_only_those(sched):
    prefill(sched, request("a", range(100, 124)), [1, 2, 3, 4, 5, 6])  # 3 pages
    req = request("b", list(range(100, 124)) + [9])
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * PAGE, False)
    sched.update_state_after_alloc(req, [[30, 31, 32, 33, 34, 35, 36]], PAGE + BS)  # capped
    (load,) = sched.build_connector_meta({}).loads
    assert [p.block_ids for p in load.pages] == [(30, 31), (32,)]
    assert load.unloadable_block_ids == ()


def test_more_external_tokens_than_matched_are_reported_unloadable(sched):
    prefill(sched, request("a", range(100, 108)), [1, 2])  # 1 page
    req = request("b", list(range(100, 120)))
    assert sched.get_num_new_matched_tokens(req, 0) == (PAGE, False)
    sched.update_state_after_alloc(req, [[40, 41, 42, 43, 44]], 2 * PAGE)  # never offered
    (load,) = sched.build_connector_meta({}).loads
    assert [p.block_ids for p in load.pages] == [(40, 41)]
    assert load.unloadable_block_ids == (42, 43)


def test_finished_request_stores_its_tail_and_holds_blocks(sched):
    req = request("a", range(100, 110))  # 10 tokens: 1 full page so far
    prefill(sched, req, [1, 2, 3])
    req.all_token_ids += [7, 8, 9, 10, 11, 12, 13]  # decoded; KV computed for all but the last
    req.num_computed_tokens = req.num_tokens - 1
    assert sched.request_finished(req, [[1, 2, 3, 4]]) is True
    assert sched.has_pending_stores()
    meta = sched.build_connector_meta({})
    assert [p.block_ids for p in meta.stores] == [(3, 4)]
    assert meta.release_after_store == ["a"]
    assert not sched.has_pending_stores()


def test_full_l2_evicts_least_recent_pages_first(sched):
    for i in range(8):  # 8 requests x 2 pages = all 16 slots
        prefill(sched, request(f"r{i}", range(1000 * i, 1000 * i + 16)), [1, 2, 3, 4])
    assert sched.slots.num_free == 0
    prefill(sched, request("new", range(50000, 50008)), [9, 9])
    assert sched.stats.evicted_pages == 1
    # The oldest request lost its tail page, keeping its head.
    assert sched.get_num_new_matched_tokens(request("x", list(range(0, 16)) + [1]), 0) == (PAGE, False)


def test_selective_stores_a_page_once_enough_requests_computed_it():
    sched = make_scheduler(write_policy="write_through_selective", write_threshold=2)
    first = prefill(sched, request("a", range(100, 124)), [1, 2, 3, 4, 5, 6])  # 3 pages
    assert first.stores == [] and sched.tree.total_pages() == 0
    # A second request shares the first 2 pages only: those reach 2 hits.
    second = prefill(sched, request("b", list(range(100, 116)) + list(range(7, 15))),
                     [7, 8, 9, 10, 11, 12])
    assert [p.block_ids for p in second.stores] == [(7, 8), (9, 10)]
    assert sched.tree.total_pages() == 2


def test_write_back_copies_only_when_the_request_finishes():
    sched = make_scheduler(write_policy="write_back")
    req = request("a", range(100, 124))
    assert prefill(sched, req, [1, 2, 3, 4, 5, 6]).stores == []
    assert sched.request_finished(req, [[1, 2, 3, 4, 5, 6]]) is True
    meta = sched.build_connector_meta({})
    assert [p.block_ids for p in meta.stores] == [(1, 2), (3, 4), (5, 6)]
    assert meta.release_after_store == ["a"]


def test_pages_holding_the_null_block_are_never_stored(sched):
    # A sliding window dropped the first two blocks (vLLM's null block 0).
    req = request("a", range(100, 124))  # 3 full pages
    meta = prefill(sched, req, [0, 0, 5, 6, 7, 8])
    assert meta.stores == []  # page 0 lost a block, so nothing after it can enter L2
    assert sched.tree.total_pages() == 0 == sched.slots.num_used
    assert sched.stats.store_skipped_pages == 3


def test_write_back_of_a_windowed_request_stores_only_its_real_prefix():
    sched = make_scheduler(write_policy="write_back")
    req = request("a", range(100, 124))
    prefill(sched, req, [1, 2, 3, 4, 5, 6])
    req.num_computed_tokens = req.num_tokens
    # By the time it finishes, the window has dropped page 1's first block.
    assert sched.request_finished(req, [[1, 2, 0, 4, 5, 6]]) is True
    meta = sched.build_connector_meta({})
    assert [p.block_ids for p in meta.stores] == [(1, 2)]
    assert sched.tree.total_pages() == 1


def test_loads_may_name_the_null_block_but_never_need_it(sched):
    prefill(sched, request("a", range(100, 124)), [1, 2, 3, 4, 5, 6])
    again = request("b", list(range(100, 124)) + [1])
    assert sched.get_num_new_matched_tokens(again, 0) == (3 * PAGE, False)
    # vLLM gives a windowed request the null block where the window no longer reaches.
    sched.update_state_after_alloc(again, [[0, 0, 0, 9, 10, 11, 12]], 3 * PAGE)
    (load,) = sched.build_connector_meta({}).loads
    assert [p.block_ids for p in load.pages] == [(0, 0), (0, 9), (10, 11)]


def test_pages_flushed_between_lookup_and_allocation_are_recomputed(sched):
    """The admin endpoint flushes L2 on its own thread: a lookup's match may be
    gone when vLLM allocates. The load shrinks; the rest is reported unloadable."""
    prefill(sched, request("a", range(100, 124)), [1, 2, 3, 4, 5, 6])  # 3 pages
    again = request("b", list(range(100, 124)) + [1])
    assert sched.get_num_new_matched_tokens(again, 0) == (3 * PAGE, False)
    match = sched.tree.match_prefix(sched.prefix_keys(range(100, 124)))
    sched.flush({"l2"}, list(range(100, 108)) + [0])  # pages after the first
    assert sched.tree.total_pages() == 1 and match.node.parent is None
    sched.update_state_after_alloc(again, [[9, 10, 11, 12, 13, 14, 15]], 3 * PAGE)
    (load,) = sched.build_connector_meta({}).loads
    assert [p.block_ids for p in load.pages] == [(9, 10)]
    assert load.unloadable_block_ids == (11, 12, 13, 14)
    sched.tree.check_invariants()


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match="unknown write policy 'lru'"):
        make_scheduler(write_policy="lru")
    with pytest.raises(ValueError, match="unknown prefetch policy 'never'"):
        make_scheduler(prefetch_policy="never")


def test_bad_slots_leave_l2_at_the_next_step_once_unlocked(sched):
    prefill(sched, request("a", range(100, 124)), [1, 2, 3, 4, 5, 6])  # 3 pages
    again = request("b", list(range(100, 124)) + [1])
    assert sched.get_num_new_matched_tokens(again, 0) == (3 * PAGE, False)
    sched.update_state_after_alloc(again, [[9, 10, 11, 12, 13, 14, 15]], 3 * PAGE)
    slots = sched.tree.match_prefix(sched.prefix_keys(range(100, 124))).host_slots
    sched.on_worker_report(WorkerReport(bad_slots={slots[1]}))
    sched.build_connector_meta({})  # the load still holds the page: kept for now
    assert sched.tree.total_pages() == 3 and sched.stats.bad_slots_reported == 0
    sched.build_connector_meta({})  # the bad page and the page below it go
    assert sched.tree.total_pages() == 1 == sched.slots.num_used
    assert sched.stats.bad_slots_reported == 1
    sched.tree.check_invariants()


def test_reset_waits_until_pending_loads_are_planned(sched):
    prefill(sched, request("a", range(100, 116)), [1, 2, 3, 4])
    again = request("b", list(range(100, 116)) + [1])
    assert sched.get_num_new_matched_tokens(again, 0) == (2 * PAGE, False)
    sched.update_state_after_alloc(again, [[5, 6, 7, 8, 9]], 2 * PAGE)
    assert sched.reset() is False and sched.tree.total_pages() == 2
    sched.build_connector_meta({})
    assert sched.reset() is True
    assert sched.tree.total_pages() == 0 == sched.slots.num_used


def test_one_step_never_gives_a_slot_to_two_pages():
    """Two requests prefilled in the same step store 10 pages each into a 16-slot L2:
    the second store must not evict the first one's pages (their bytes are not copied
    yet) and reuse their slots in the same plan; it stores what fits, or nothing."""
    sched = make_scheduler()
    a, b = request("a", range(100, 181)), request("b", range(300, 381))  # 10 pages + 1
    for req, blocks in ((a, list(range(1, 22))), (b, list(range(30, 51)))):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, [blocks], 0)
        sched.tables[req.request_id] = blocks
    meta = sched.build_connector_meta({"a": a.num_tokens, "b": b.num_tokens})
    slots = [p.slot for p in meta.stores]
    assert len(slots) == len(set(slots)) and len(slots) <= 16
    ns = KeyNamespace("m", "f32", "cpu", PAGE, 1)
    assert sched.tree.match_prefix(keys_of(ns.seed(), list(range(100, 180)), PAGE)
                                   ).num_pages == 10
    # The next step may evict them (their copies are in the plan above).
    c = request("c", range(500, 581))
    assert sched.get_num_new_matched_tokens(c, 0) == (0, False)
    sched.update_state_after_alloc(c, [list(range(60, 81))], 0)
    sched.tables["c"] = list(range(60, 81))
    assert len(sched.build_connector_meta({"c": c.num_tokens}).stores) == 10
    sched.tree.check_invariants()
