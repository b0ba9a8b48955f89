"""Scheduler half with vLLM's hybrid KV cache manager on (several KV-cache groups), no engine.

Two sliding-window groups (window 12 tokens) and one full-attention group,
as vLLM gives a Gemma-3-style model: block ids per group, its null block (0)
where a window no longer reaches. Checked here: every group's blocks are
planned per page, pages that lost a window are stored without it and only
end a hit where the window has it, every hit is asynchronous (vLLM takes a
failed load back only per request there), and a fetch that came short is not
asked of L3 again for the same request.
"""

from __future__ import annotations

from support.fakes import (
    file_store,
    keys_of,
    request,
    scheduler_args,
    write_pages,
    write_prompt_pages,
)

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.kv_groups import KVGroup, KVGroups
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

BS = 4  # tokens per vLLM block
PAGE = 8  # tokens per page: 2 blocks
GROUPS = KVGroups((KVGroup("window", 12), KVGroup("window", 12), KVGroup("full")))
GEOM = PoolGeometry(num_slots=32, num_layers=3, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
# Mamba hybrid: one state group (a block per request), one full-attention group.
MAMBA = KVGroups((KVGroup("state"), KVGroup("full")))
MAMBA_GEOM = PoolGeometry(num_slots=32, num_layers=2, blocks_per_page=2, block_bytes=64)


def make_scheduler(storage=None, groups=GROUPS, geometry=GEOM, **kw) -> HiCacheScheduler:
    tables: dict[str, list[list[int]]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=geometry, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: tables[rid], groups=groups, storage=storage, **kw,
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 1})))
    s.tables = tables  # type: ignore[attr-defined]
    return s


def blocks(n: int, nulls: int = 0) -> list[list[int]]:
    """A request's block tables: ``n`` blocks per group, the windowed groups'
    first ``nulls`` replaced by vLLM's null block."""
    return [[0] * nulls + list(range(100 + nulls, 100 + n)),
            [0] * nulls + list(range(200 + nulls, 200 + n)),
            list(range(300, 300 + n))]


def run_prompt(sched, req, tables):
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, tables, 0)
    sched.tables[req.request_id] = tables
    plan = sched.build_connector_meta({req.request_id: req.num_tokens})
    req.num_computed_tokens = req.num_tokens
    return plan


def test_a_page_carries_every_groups_blocks():
    sched = make_scheduler()
    plan = run_prompt(sched, request("a", range(100, 120)), blocks(5))  # 2 pages + 4
    assert [p.block_ids for p in plan.stores] == [(100, 101, 200, 201, 300, 301),
                                                  (102, 103, 202, 203, 302, 303)]
    assert [sched.l2.missing_of(p.slot) for p in plan.stores] == [0, 0]


def test_every_hit_is_asynchronous_and_names_every_group():
    sched = make_scheduler()
    run_prompt(sched, request("a", range(100, 117)), blocks(5))
    again = request("b", range(100, 117))
    assert sched.get_num_new_matched_tokens(again, 0) == (2 * PAGE, True)
    sched.update_state_after_alloc(again, blocks(5, nulls=1), 2 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert fetch.l3_pages == ()
    # The window's first block is the null block (never loaded); the rest is real.
    assert [p.block_ids for p in fetch.l2_pages] == [(0, 101, 0, 201, 300, 301),
                                                     (102, 103, 202, 203, 302, 303)]
    # The worker reports it (L2 only: no L3 pages fetched); its prefix is unlocked.
    sched.on_worker_report(WorkerReport(fetched={"b": [0]}))
    assert not sched.fetches.in_flight
    assert sched.tree.evictable_pages() == 2


def test_write_back_keeps_a_history_whose_early_pages_lost_the_window():
    sched = make_scheduler(write_policy="write_back")
    req = request("a", range(100, 133))  # 4 pages + 1 token
    run_prompt(sched, req, blocks(9))
    # When it finishes, the window keeps its last blocks only: pages 0-2 lack it.
    assert sched.request_finished(req, blocks(9, nulls=5)) is True
    stores = sched.build_connector_meta({}).stores
    assert len(stores) == 4
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b011, 0b011, 0b011, 0]
    # Ending after page 3 needs tokens 21..31 (blocks 5-7); residency is per page,
    # and page 2 (blocks 4-5) lost block 4: no hit (conservative, never wrong).
    back = request("b", list(range(100, 133)) + [7, 8, 9])
    assert sched.get_num_new_matched_tokens(back, 0) == (0, False)


def test_a_history_returns_whole_when_its_window_pages_are_complete():
    sched = make_scheduler(write_policy="write_back")
    req = request("a", range(100, 133))
    run_prompt(sched, req, blocks(9))
    # Window 12: at the end (32 tokens) vLLM keeps tokens 21.. real: blocks 5-8.
    assert sched.request_finished(req, blocks(9, nulls=4)) is True
    stores = sched.build_connector_meta({}).stores
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b011, 0b011, 0, 0]
    back = request("b", list(range(100, 133)) + [7, 8, 9])
    assert sched.get_num_new_matched_tokens(back, 0) == (4 * PAGE, True)
    # A branch that shares only the first 2 pages cannot end in them: no hit.
    branch = request("c", list(range(100, 116)) + [1, 2, 3, 4, 5])
    assert sched.get_num_new_matched_tokens(branch, 0) == (0, False)
    # vLLM's own cache holding the head does not change where the window must be.
    assert sched.get_num_new_matched_tokens(back, 2 * PAGE) == (2 * PAGE, True)


def test_a_full_attention_null_block_ends_the_store():
    sched = make_scheduler()
    tables = blocks(5)
    tables[2][2] = 0
    plan = run_prompt(sched, request("a", range(100, 120)), tables)
    assert len(plan.stores) == 1
    assert sched.stats.store_skipped_pages == 1


def test_l3_pages_extend_the_hit_and_a_short_fetch_is_not_asked_again(tmp_path):
    tokens = list(range(100, 133))
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)
    sched = make_scheduler(storage=file_store(tmp_path, NS, GEOM))
    req = request("a", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, True)
    sched.update_state_after_alloc(req, blocks(9), 4 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [p.block_ids for p in fetch.l3_pages][0] == (100, 101, 200, 201, 300, 301)
    assert sched.l3_tokens_of("a") == 4 * PAGE
    # The worker got 1 of 4 pages: vLLM recomputes the request and looks it up again.
    sched.on_worker_report(WorkerReport(fetched={"a": [1]}))
    assert "a" in sched.fetches.came_short
    assert sched.get_num_new_matched_tokens(req, 0) == (PAGE, True)  # L2 only
    sched.request_finished(req, blocks(9))
    assert "a" not in sched.fetches.came_short


def test_mamba_states_are_checkpointed_where_a_step_ends_on_a_page_end():
    sched = make_scheduler(groups=MAMBA, geometry=MAMBA_GEOM)
    tables = sched.tables  # type: ignore[attr-defined]
    req = request("a", range(100, 120))  # 20 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    tables["a"] = [[50], list(range(300, 306))]
    sched.update_state_after_alloc(req, tables["a"], 0)
    # Step 1 computes 16 tokens: ends on page 1's end, whose state it checkpoints.
    stores = sched.build_connector_meta({"a": 16}).stores
    assert [p.block_ids for p in stores] == [(0, 0, 300, 301), (0, 50, 302, 303)]
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b01, 0]
    # A prompt sharing 20 tokens may only end after page 1 (the checkpoint)...
    back = request("b", list(range(100, 120)) + [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert sched.get_num_new_matched_tokens(back, 0) == (2 * PAGE, True)
    sched.update_state_after_alloc(back, [[60], list(range(400, 408))], 2 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    # ...and its state block gets that checkpoint, the attention blocks every page.
    assert [p.block_ids for p in fetch.l2_pages] == [(0, 0, 400, 401), (0, 60, 402, 403)]
    # A prompt that shares only page 0 has no checkpoint to end on.
    short = request("c", list(range(100, 108)) + [5, 6, 7])
    assert sched.get_num_new_matched_tokens(short, 0) == (0, False)


def test_mamba_l3_runs_over_bodies_and_ends_on_a_whole_page(tmp_path):
    from hicache.tiers.index.page_keys import body_key

    tokens = list(range(100, 137))  # 4 full pages + 5
    keys = keys_of(NS.seed(), tokens, PAGE)
    # Another engine stored every page's body, and page 2 whole (its checkpoint).
    write_pages(tmp_path, NS, MAMBA_GEOM, [body_key(k).hex() for k in keys] + [keys[2].hex()])
    sched = make_scheduler(file_store(tmp_path, NS, MAMBA_GEOM), groups=MAMBA,
                           geometry=MAMBA_GEOM)
    sched.tables["a"] = [[], []]  # type: ignore[attr-defined]
    req = request("a", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * PAGE, True)
    sched.update_state_after_alloc(req, [[70], list(range(10, 20))], 3 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [p.l3_key for p in fetch.l3_pages] == [body_key(keys[0]), body_key(keys[1]), None]
    assert [p.block_ids for p in fetch.l3_pages] == [(0, 0, 10, 11), (0, 0, 12, 13),
                                                     (0, 70, 14, 15)]
    sched.on_worker_report(WorkerReport(fetched={"a": [3]}))
    match = sched.tree.match_prefix(keys)
    assert [sched.l2.missing_of(s) for s in match.host_slots] == [0b01, 0b01, 0]
    # Stores of such a model: a body for every page, the checkpointed page whole too.
    assert MAMBA.l3_keys(keys[0], 0b01) == (body_key(keys[0]),)
    assert MAMBA.l3_keys(keys[0], 0) == (keys[0], body_key(keys[0]))


def test_write_back_stores_a_mamba_request_whole_with_its_last_checkpoint():
    sched = make_scheduler(groups=MAMBA, geometry=MAMBA_GEOM, write_policy="write_back")
    tables = sched.tables  # type: ignore[attr-defined]
    req = request("a", range(100, 132))  # 4 full pages
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    tables["a"] = [[50], list(range(300, 308))]
    sched.update_state_after_alloc(req, tables["a"], 0)
    sched.build_connector_meta({"a": 32})
    req.num_computed_tokens = 32
    # One state block for the request, eight attention blocks: all four pages go.
    assert sched.request_finished(req, tables["a"]) is True
    stores = sched.build_connector_meta({}).stores
    assert len(stores) == 4
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b01, 0b01, 0b01, 0]
    assert stores[-1].block_ids == (0, 50, 306, 307)


# vLLM's "align" Mamba cache mode (its prefix caching on): a state block per block.
ALIGNED = KVGroups((KVGroup("state", aligned=True), KVGroup("full")))


def test_aligned_mamba_stores_the_states_vllm_hands_off_and_loads_at_the_hits_end():
    sched = make_scheduler(groups=ALIGNED, geometry=MAMBA_GEOM)
    tables = sched.tables  # type: ignore[attr-defined]
    req = request("a", range(100, 130))  # 30 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # vLLM's table is not read for states: a column it shows is not the handed-off block.
    tables["a"] = [[0, 66, 0, 0, 0, 0, 0, 0], list(range(300, 308))]
    sched.update_state_after_alloc(req, tables["a"], 0)
    # Step 1 computes 12 tokens; vLLM hands off the state after block 1 (8 tokens,
    # page 0's end) in block 6 and after block 2 (12, no page end) in block 5.
    stores = sched.build_connector_meta({"a": 12}, (), {"a": [(0, 6, 8), (0, 5, 12)]}).stores
    assert [p.block_ids for p in stores] == [(0, 6, 300, 301)]
    req.num_computed_tokens = 12
    # Step 2 ends on page 2's end (24) but hands nothing off for it: page 1 and 2
    # go without their checkpoints, a hand-off for another request is not theirs.
    stores = sched.build_connector_meta({"a": 12}, (), {"b": [(0, 9, 24)]}).stores
    assert [p.block_ids for p in stores] == [(0, 0, 302, 303), (0, 0, 304, 305)]
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b01, 0b01]
    # A returning prompt may end after page 0 only, and vLLM's table for that hit has
    # its real state block in the hit's last column.
    back = request("b", list(range(100, 130)) + [1, 2, 3])
    assert sched.get_num_new_matched_tokens(back, 0) == (PAGE, True)
    sched.update_state_after_alloc(back, [[0, 61], [400, 401]], PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [p.block_ids for p in fetch.l2_pages] == [(0, 61, 400, 401)]


def test_aligned_mamba_write_back_keeps_bodies_only():
    # A finished request's store comes after vLLM's hand-offs: no checkpoint.
    sched = make_scheduler(groups=ALIGNED, geometry=MAMBA_GEOM, write_policy="write_back")
    tables = sched.tables  # type: ignore[attr-defined]
    req = request("a", range(100, 116))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    tables["a"] = [[0, 0, 0, 50], list(range(300, 304))]
    sched.update_state_after_alloc(req, tables["a"], 0)
    assert sched.build_connector_meta({"a": 16}, (), {"a": [(0, 50, 16)]}).stores == []
    req.num_computed_tokens = 16
    assert sched.request_finished(req, tables["a"]) is True
    stores = sched.build_connector_meta({}).stores
    assert [sched.l2.missing_of(p.slot) for p in stores] == [0b01, 0b01]
