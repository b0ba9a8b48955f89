"""Per-request cache controls (tiers/controller/hints.py): parsed with one clear message
for every bad value (the request then runs with the defaults), and acted on by the
scheduler half: no stores, no loads, L2 only, a cap on loaded tokens. No engine; the L3
store is the real file backend."""

import pytest
from support.fakes import file_store, prefill, request, serve, write_prompt_pages

from hicache.tiers.controller.hints import DEFAULT_HINTS, RequestHints, parse_hints
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)


@pytest.mark.parametrize(("params", "hints"), [
    (None, DEFAULT_HINTS), ({}, DEFAULT_HINTS), ({"other": 1}, DEFAULT_HINTS),
    ({"hicache": {"store": False}}, RequestHints(store=False)),
    ({"hicache": {"load_tiers": [], "max_load_tokens": 64}},
     RequestHints(load_tiers=[], max_load_tokens=64)),
    ({"hicache": {"retain_s": 30}}, RequestHints(retain_s=30.0)),
    ({"hicache": {"priority": "low"}}, RequestHints(priority="low")),
    # What HiCache wrote into an earlier response, passed on (PD proxies do): no error.
    ({"hicache": {"cached_tokens": {"l1": 3}, "error": "x", "load_tiers": ["l2"]}},
     RequestHints(load_tiers=["l2"])),
])
def test_good_hints_parse(params, hints):
    assert parse_hints(params) == (hints, None)


@pytest.mark.parametrize(("raw", "message"), [
    ({"store": "no"}, "kv_transfer_params.hicache.store must be true or false (got 'no')"),
    ({"load_tiers": ["l3"]}, "kv_transfer_params.hicache.load_tiers=['l3']: L3 pages are "
                             "loaded through L2; allowed: [], ['l2'], ['l2', 'l3']"),
    ({"load_tiers": ["l2", "disk"]}, "load_tiers=['l2', 'disk']: unknown tier(s) ['disk']; "
                                     "allowed: [], ['l2'], ['l2', 'l3']"),
    ({"load_tiers": "l2"}, "kv_transfer_params.hicache.load_tiers must be a list (got 'l2')"),
    ({"max_load_tokens": -1}, "kv_transfer_params.hicache.max_load_tokens must be an integer "
                              ">= 0 or null (got -1)"),
    ({"retain_for": 30}, "unknown kv_transfer_params.hicache key(s): ['retain_for']; allowed "
                         "keys: ['load_tiers', 'max_load_tokens', 'priority', 'retain_s', "
                         "'return_in_s', 'session_id', 'store']"),
    (7, "kv_transfer_params.hicache must be an object with keys ['load_tiers', "
        "'max_load_tokens', 'priority', 'retain_s', 'return_in_s', 'session_id', 'store']"),
    ({"retain_s": -5}, "kv_transfer_params.hicache.retain_s must be a number >= 0 or null "
                       "(got -5)"),
    ({"retain_s": "60"}, "kv_transfer_params.hicache.retain_s must be a number >= 0 or null"),
    ({"return_in_s": -1}, "kv_transfer_params.hicache.return_in_s must be a number in "
                          "[0, 86400] or null (got -1)"),
    ({"return_in_s": 90000}, "return_in_s must be a number in [0, 86400] or null (got 90000)"),
    ({"priority": "urgent"}, "kv_transfer_params.hicache.priority='urgent' is not supported; "
                             "allowed values: ['low', 'normal', 'high']"),
])
def test_bad_hints_are_named_and_ignored(raw, message):
    hints, error = parse_hints({"hicache": raw})
    assert hints == DEFAULT_HINTS
    assert error is not None and message in error


def scheduler(tmp_path) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], storage=file_store(tmp_path, NS, GEOM),
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0, "prefetch_timeout_base": 1.0, "prefetch_timeout_per_ki_token": 0.5, "prefetch_timeout_max": 30.0}))
    s.tables = tables
    return s


def hinted(rid: str, tokens: list[int], **hints):
    req = request(rid, tokens)
    req.kv_transfer_params = {"hicache": hints}
    return req


def test_store_false_writes_nothing_and_keeps_its_hits(tmp_path):
    sched = scheduler(tmp_path)
    tokens = list(range(100, 120))  # 2 full pages
    quiet = hinted("q", tokens, store=False)
    assert prefill(sched, quiet, [1, 2, 3, 4, 5]).stores == []
    assert not sched.request_finished(quiet, ([1, 2, 3, 4, 5],))
    assert sched.build_connector_meta({}).stores == [] and sched.tree.total_pages() == 0
    # The same prompt without the hint is stored; a store=false request still loads it.
    meta = prefill(sched, request("a", tokens), [6, 7, 8, 9, 10])
    assert len(meta.stores) == 2
    again = hinted("b", tokens + [1], store=False)
    assert sched.get_num_new_matched_tokens(again, 0) == (2 * PAGE, False)


def test_load_tiers_and_max_load_tokens_bound_the_hit(tmp_path):
    sched = scheduler(tmp_path)
    tokens = list(range(200, 233))  # 4 full pages + 1 token
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)  # all 4 in L3
    first = request("a", tokens[:17])  # pages 1-2: L3 -> L2
    assert sched.get_num_new_matched_tokens(first, 0) == (2 * PAGE, True)
    sched.update_state_after_alloc(first, [[1, 2, 3, 4]], 2 * PAGE)
    sched.build_connector_meta({})
    sched.on_worker_report(WorkerReport(fetched={"a": [2]}))
    # L2 holds pages 1-2, L3 all four.
    assert sched.get_num_new_matched_tokens(request("all", tokens), 0) == (4 * PAGE, True)
    assert sched.get_num_new_matched_tokens(
        hinted("l2", tokens, load_tiers=["l2"]), 0) == (2 * PAGE, False)
    assert sched.get_num_new_matched_tokens(
        hinted("none", tokens, load_tiers=[]), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(
        hinted("zero", tokens, max_load_tokens=0), 0) == (0, False)
    # A cap counts HiCache's tokens only (here beyond a one-page local hit), in pages.
    assert sched.get_num_new_matched_tokens(
        hinted("cap", tokens, max_load_tokens=2 * PAGE + 3), PAGE) == (2 * PAGE, True)
    assert sched.get_num_new_matched_tokens(
        hinted("cap2", tokens, max_load_tokens=PAGE), 0) == (PAGE, False)
    # Bad hints: served as if there were none, the reason kept for the response.
    bad = hinted("bad", tokens, load_tiers=["l3"])
    assert sched.get_num_new_matched_tokens(bad, 0) == (4 * PAGE, True)
    assert "load_tiers=['l3']" in sched.hint_error_of("bad")
    assert sched.hint_error_of("all") is None


def test_priority_classes_order_eviction(tmp_path):
    """L2 holds 16 pages. One-offs sent as ``low`` evict each other, never a normal
    session; normal traffic evicts a low session but not a prefix a ``high`` request
    used (raised, never lowered, by a later normal or low hit)."""
    sched = scheduler(tmp_path)
    session = list(range(1000, 1033))  # 4 full pages + 1 token
    pinned_by_class = list(range(2000, 2033))
    assert serve(sched, request("s", session)) == 0
    assert serve(sched, hinted("p", pinned_by_class, priority="low")) == 0
    assert serve(sched, hinted("p2", pinned_by_class, priority="high")) == 4 * PAGE
    assert serve(sched, hinted("p3", pinned_by_class, priority="low")) == 4 * PAGE
    for i in range(6):  # 24 pages of one-offs into the 8 slots left
        assert serve(sched, hinted(f"low{i}", list(range(3000 + 40 * i, 3033 + 40 * i)),
                                   priority="low")) == 0
    assert serve(sched, request("s-back", session)) == 4 * PAGE
    for i in range(6):  # as much normal traffic: the session goes, the high prefix stays
        assert serve(sched, request(f"n{i}", list(range(5000 + 40 * i, 5033 + 40 * i)))) == 0
    assert sched.get_num_new_matched_tokens(request("s-again", session), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(
        request("p-again", pinned_by_class), 0) == (4 * PAGE, False)
    sched.tree.check_invariants()
