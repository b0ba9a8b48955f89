"""L2's and L3's KV events (tiers/controller/events.py) on the scheduler, without an engine:
a stored page names its request's block hashes, parent and tokens; a page that
leaves L2 (eviction, flush, reset) is removed by exactly those hashes; fetched
pages are stored too; nothing is recorded when vLLM publishes no events."""

from __future__ import annotations

from concurrent.futures import wait

from support.fakes import file_store, request, scheduler_args, write_prompt_pages

from hicache.tiers.controller.events import MEDIUM_L2, MEDIUM_L3, PagesRemoved, PageStored
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport, prefetch_id
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=4, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)


def make(enabled: bool = True, **kw) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(**scheduler_args(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], **kw, policy=SchedulerPolicy(kv_events=enabled)))
    s.tables = tables  # type: ignore[attr-defined]
    return s


def prefill(sched: HiCacheScheduler, req, block_ids: list[int]) -> None:
    """Admit ``req`` (loading whatever L2 holds) and compute its whole prompt."""
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [block_ids], hit or 0)
    sched.tables[req.request_id] = block_ids  # type: ignore[attr-defined]
    sched.build_connector_meta({req.request_id: req.num_tokens - (hit or 0)})
    req.num_computed_tokens = req.num_tokens


def test_a_stored_page_names_its_blocks_parent_and_tokens():
    sched = make()
    req = request("a", list(range(100, 120)))  # 2 full pages + 4 tokens
    prefill(sched, req, [7, 3, 9, 4, 5])
    h = req.block_hashes
    assert sched.take_events() == [
        PageStored((h[0], h[1]), None, tuple(range(100, 108)), BS, MEDIUM_L2),
        PageStored((h[2], h[3]), h[1], tuple(range(108, 116)), BS, MEDIUM_L2),
    ]
    assert sched.take_events() == []  # taken once
    # A request loading those pages stores nothing new: no event.
    prefill(sched, request("b", list(range(100, 117))), [1, 2, 3, 4, 5])
    assert sched.take_events() == []


def test_eviction_flush_and_reset_remove_exactly_the_stored_hashes():
    sched = make()  # L2 holds 4 pages
    first = request("a", list(range(100, 124)))  # 3 pages
    prefill(sched, first, [1, 2, 3, 4, 5, 6])
    assert len(sched.take_events()) == 3
    second = request("b", list(range(500, 517)))  # 2 pages: one must go
    prefill(sched, second, [8, 9, 10, 11, 12])
    removed, *stored = sched.take_events()
    h = first.block_hashes
    # Leaf-first LRU took the first request's tail page.
    assert removed == PagesRemoved((h[4], h[5]), MEDIUM_L2)
    assert [e.block_hashes for e in stored] == [tuple(second.block_hashes[0:2]),
                                                tuple(second.block_hashes[2:4])]
    assert sched.flush({"l2"}, None)[0]["l2_pages"] == 4
    (flushed,) = sched.take_events()
    assert isinstance(flushed, PagesRemoved)
    assert set(flushed.block_hashes) == {*h[:4], *second.block_hashes[:4]}
    third = request("d", list(range(300, 309)))  # 1 page
    prefill(sched, third, [1, 2, 3])
    sched.take_events()
    assert sched.reset()
    assert sched.take_events() == [PagesRemoved(tuple(third.block_hashes[:2]), MEDIUM_L2)]


def test_pages_fetched_from_l3_are_stored_events(tmp_path):
    tokens = list(range(100, 117))  # 2 pages + 1
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)
    sched = make(storage=file_store(tmp_path, NS, GEOM), background_lookups=True,
                 prefetch_at_arrival=True, prefetch_policy="wait_complete",
                 prefetch={"prefetch_threshold": 0})
    req = request("r", tokens)
    sched.on_new_request(req)
    assert wait([sched.fetches.probes._probes["r"].future], timeout=30).done
    sched.build_connector_meta({})
    h = req.block_hashes
    # The lookup found both pages in L3 (the tree learns it: medium STORAGE);
    # they are reserved in L2, not there yet.
    assert sched.take_events() == [
        PageStored((h[0], h[1]), None, tuple(tokens[:8]), BS, MEDIUM_L3),
        PageStored((h[2], h[3]), h[1], tuple(tokens[8:16]), BS, MEDIUM_L3),
    ]
    sched.on_worker_report(WorkerReport(fetched={prefetch_id("r"): [2]}))
    events = sched.take_events()
    assert [(e.block_hashes, e.medium) for e in events] == [((h[0], h[1]), MEDIUM_L2),
                                                            ((h[2], h[3]), MEDIUM_L2)]
    sched.fetches.probes.close()


def test_nothing_is_recorded_when_vllm_publishes_no_events():
    sched = make(enabled=False)
    prefill(sched, request("a", list(range(100, 120))), [7, 3, 9, 4, 5])
    assert sched.flush({"l2"}, None)[0]["l2_pages"] == 2
    assert sched.take_events() == [] and not sched.events._resident
