"""Scheduler half with an L3 backend, without an engine: async hits, reserved slots,
publishing what every rank fetched. The backend is the real file backend."""

from support.fakes import file_store, keys_of, request, scheduler_args, write_prompt_pages

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.l3.file.backend import FileBackend

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)




def backend(tmp_path) -> FileBackend:
    return file_store(tmp_path, NS, GEOM)


def store_pages(tmp_path, tokens) -> None:
    """Put every full page of ``tokens`` into L3, as another engine would have."""
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)


def scheduler(tmp_path, **kw) -> HiCacheScheduler:
    return HiCacheScheduler(**scheduler_args(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [[]],
        storage=backend(tmp_path), **kw,
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0, "prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.5, "prefetch_timeout_max": 30.0})))


def test_l3_hit_is_async_and_reserves_slots(tmp_path):
    tokens = list(range(100, 133))  # 4 full pages + 1 token
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path)
    req = request("r", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, True)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 4 * PAGE)
    meta = sched.build_connector_meta({})
    (fetch,) = meta.fetches
    assert not meta.loads and fetch.l2_pages == ()
    assert [p.block_ids for p in fetch.l3_pages] == [(10, 11), (12, 13), (14, 15), (16, 17)]
    assert fetch.timeout_s == 1.0 + 0.5 * 32 / 1024
    assert sched.l3_tokens_of("r") == 4 * PAGE  # vLLM's cached-by-source: all from L3
    assert sched.slots.num_used == 4 and sched.tree.total_pages() == 0
    # Asked again while fetching: no second hit.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # The worker got 3 of the 4 pages: those enter L2, the 4th slot is freed.
    sched.on_worker_report(WorkerReport(fetched={"r": [3]}))
    assert sched.tree.total_pages() == 3 == sched.slots.num_used
    sched.tree.check_invariants()
    assert sched.stats.l3_fetched_pages == 3 and sched.stats.l3_failed_pages == 1


def test_l2_prefix_stays_locked_until_every_rank_reported(tmp_path):
    tokens = list(range(200, 233))
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path, tp_size=2, prefetch_policy="wait_complete")
    first = request("a", tokens[:17])  # its 2 pages come from L3 into L2
    assert sched.get_num_new_matched_tokens(first, 0) == (2 * PAGE, True)
    sched.update_state_after_alloc(first, [[1, 2, 3, 4]], 2 * PAGE)
    assert sched.build_connector_meta({}).fetches[0].timeout_s is None
    sched.on_worker_report(WorkerReport(fetched={"a": [2, 2]}))
    assert sched.tree.total_pages() == 2
    # A longer request: 2 pages from L2 plus 2 from L3.
    second = request("b", tokens)
    assert sched.get_num_new_matched_tokens(second, 0) == (4 * PAGE, True)
    sched.update_state_after_alloc(second, [list(range(20, 28))], 4 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert len(fetch.l2_pages) == 2 and len(fetch.l3_pages) == 2
    assert sched.tree.evictable_pages() == 0  # prefix locked
    sched.on_worker_report(WorkerReport(fetched={"b": [2]}))  # rank 0 only
    assert sched.tree.evictable_pages() == 0 and sched.tree.total_pages() == 2
    sched.on_worker_report(WorkerReport(fetched={"b": [1]}))  # rank 1: one page
    assert sched.tree.total_pages() == 3 == sched.tree.evictable_pages()
    assert sched.slots.num_used == 3
    sched.tree.check_invariants()


def test_below_threshold_or_no_room_is_not_fetched(tmp_path):
    tokens = list(range(300, 333))
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path)
    sched.prefetch["prefetch_threshold"] = 5 * PAGE
    assert sched.get_num_new_matched_tokens(request("x", tokens), 0) == (0, False)
    sched.prefetch["prefetch_threshold"] = 0
    assert sched.slots.alloc(14) is not None  # only 2 slots left, nothing evictable
    assert sched.get_num_new_matched_tokens(request("y", tokens), 0) == (2 * PAGE, True)


def test_worker_reports_merge_per_rank():
    a = WorkerReport({1}, {"r": [3]})
    b = WorkerReport({2}, {"r": [2], "s": [1]})
    merged = a.merge(b)
    assert merged.bad_slots == {1, 2} and merged.fetched == {"r": [3, 2], "s": [1]}


def test_l3_pages_under_vllms_own_hit_are_fetched_into_l2_only(tmp_path):
    """vLLM's prefix cache already holds 2.5 pages: the L3 pages it covers are still
    fetched (into L2, no blocks), so the tree gets a contiguous prefix."""
    tokens = list(range(400, 433))
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path)
    req = request("r", tokens)
    assert sched.get_num_new_matched_tokens(req, 20) == (4 * PAGE - 20, True)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 4 * PAGE - 20)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [(p.first_offset, p.block_ids) for p in fetch.l3_pages] == [
        (0, ()), (0, ()), (1, (15,)), (0, (16, 17))]
    sched.on_worker_report(WorkerReport(fetched={"r": [4]}))
    assert sched.tree.match_prefix(keys_of(NS.seed(), tokens, PAGE)).num_pages == 4


def test_flush_between_lookup_and_allocation_keeps_the_async_contract(tmp_path):
    """vLLM waits for an async request in finished_recving: when its L2 prefix is
    flushed before allocation, the fetch still goes out, without L3 pages, and
    every block it cannot fill is reported for recompute."""
    tokens = list(range(300, 349))  # 6 full pages + 1
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path)
    first = request("a", tokens[:17])  # 2 pages from L3 into L2
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, [[1, 2, 3, 4, 5]], 2 * PAGE)
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={"a": [2]}))
    req = request("r", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * PAGE, True)
    sched.flush({"l2"}, None)
    sched.update_state_after_alloc(req, [list(range(10, 23))], 6 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert fetch.l2_pages == () and fetch.l3_pages == ()
    assert fetch.unloadable_block_ids == tuple(range(10, 22))
    sched.on_worker_report(WorkerReport(fetched={"r": [0]}))
    assert not sched.fetches.in_flight
    sched.tree.check_invariants()


def test_best_effort_fetch_stops_at_the_workers_next_poll(tmp_path):
    tokens = list(range(500, 517))
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path, prefetch_policy="best_effort")
    req = request("r", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * PAGE, True)
    sched.update_state_after_alloc(req, [[1, 2, 3, 4, 5]], 2 * PAGE)
    assert sched.build_connector_meta({}).fetches[0].timeout_s == 0.0


class DownStore:
    """An L3 store that cannot be reached."""

    def exists_prefix(self, keys: list[str]) -> int:
        raise ConnectionError("store down")


def test_failing_l3_lookup_is_a_miss(tmp_path):
    sched = scheduler(tmp_path)
    sched.storage = DownStore()
    assert sched.get_num_new_matched_tokens(request("r", list(range(600, 633))), 0) == (0, False)
    assert sched.stats.l3_lookups == 1 and sched.stats.l3_lookup_errors == 1


def test_cached_tokens_split_by_tier_at_the_first_admission(tmp_path):
    """What a finished request reports per tier (kv_transfer_params["hicache"]): vLLM's
    own hit, the L2 pages and the L3 pages of its first admission, adding up to the
    tokens vLLM counts as cached; a second admission (preemption) changes nothing."""
    tokens = list(range(200, 233))  # 4 full pages + 1 token
    store_pages(tmp_path, tokens)
    sched = scheduler(tmp_path)
    first = request("a", tokens[:17])  # 2 pages: L3 -> L2
    sched.get_num_new_matched_tokens(first, 0)
    sched.update_state_after_alloc(first, [[1, 2, 3, 4]], 2 * PAGE)
    assert sched.cached_tokens_of("a").as_dict() == {"l1": 0, "l2": 0, "l3": 2 * PAGE}
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={"a": [2]}))
    assert sched.cached_tokens_of("nobody") is None
    # vLLM's prefix cache holds page 1; L2 holds page 2; L3 pages 3 and 4.
    second = request("b", tokens)
    assert sched.cached_tokens_of("b") is None  # not admitted yet
    assert sched.get_num_new_matched_tokens(second, PAGE) == (3 * PAGE, True)
    sched.update_state_after_alloc(second, [list(range(20, 28))], 3 * PAGE)
    want = {"l1": PAGE, "l2": PAGE, "l3": 2 * PAGE}
    assert sched.cached_tokens_of("b").as_dict() == want
    # Admitted again without a hit (as after a preemption): the first count stays.
    sched.get_num_new_matched_tokens(second, 0)
    sched.update_state_after_alloc(second, [[]], 0)
    assert sched.cached_tokens_of("b").as_dict() == want
    # A request without any hit reports zeros.
    fresh = request("c", list(range(900, 940)))
    assert sched.get_num_new_matched_tokens(fresh, 0) == (0, False)
    sched.update_state_after_alloc(fresh, [[]], 0)
    assert sched.cached_tokens_of("c").as_dict() == {"l1": 0, "l2": 0, "l3": 0}


def test_a_request_vllm_already_holds_is_admitted_without_asking_l3(tmp_path):
    """Everything a hit could cover is in vLLM's own prefix cache: no L3 answer could
    matter, so none is waited for (a store that never answers is never asked), and the
    request's pages count as L1 hits."""
    from support.fakes import GatedStore

    from hicache.tiers.controller.probes import L3Probes

    store = GatedStore(found=4)  # would hold the request forever if asked
    sched = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [[]],
        storage=store, policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0}))
    sched.fetches.probes = L3Probes(fast_wait_s=0)
    try:
        tokens = list(range(100, 133))  # 4 full pages + 1 token
        req = request("r", tokens)
        assert sched.get_num_new_matched_tokens(req, 4 * PAGE) == (0, False)
        assert not store.inside.acquire(blocking=False)  # the store was never asked
        sched.update_state_after_alloc(req, [[]], 0)
        assert sched.stats.l1_hit_pages == 4 and sched.stats.l3_miss_pages == 0
        # One page short of that: the store is asked, and the answer is awaited.
        other = request("s", list(range(300, 333)))
        assert sched.get_num_new_matched_tokens(other, 3 * PAGE) == (None, False)
        store.entered(1)
    finally:
        store.gate.set()
        sched.fetches.probes.close()
