"""One tree for L2 and L3 (issue 15 part 3) on the scheduler, without an engine.

The HiRadixTree records which pages L3 holds: pages enter its L3 index when
every writing rank reported their backup, when a lookup found them and when a
fetch read them; eviction from L2 keeps them as L3-only pages; lookups walk
the tree before asking the store; a flush of L3 by prefix finds L3-only pages
through the tree; a fetch that could not read a page takes it out of the index.
L3's KV events (medium STORAGE) follow the index. The store is the real file
backend; ``CountingStore`` only counts its ``exists_prefix`` calls.
"""

from __future__ import annotations

from support.fakes import file_store, keys_of, request, scheduler_args, write_prompt_pages

from hicache.tiers.controller.events import MEDIUM_L2, MEDIUM_L3, PagesRemoved
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.commands import ClearStore, DeletePages
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)


class CountingStore:
    """The file backend, counting the lookups that reach it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def exists_prefix(self, keys):
        self.calls += 1
        return self.store.exists_prefix(keys)

    def delete(self, keys):
        return self.store.delete(keys)

    def clear(self):
        self.store.clear()

    def close(self):
        self.store.close()


def make(tmp_path, slots: int = 8, **kw) -> HiCacheScheduler:
    geometry = PoolGeometry(num_slots=slots, num_layers=2, blocks_per_page=2, block_bytes=64)
    tables: dict[str, list[int]] = {}
    sched = HiCacheScheduler(**scheduler_args(
        geometry=geometry, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]],
        storage=CountingStore(file_store(tmp_path, NS, geometry)), **kw,
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0})))
    sched.tables = tables  # type: ignore[attr-defined]
    sched.geom = geometry  # type: ignore[attr-defined]
    return sched


def tokens_of(base: int, pages: int) -> list[int]:
    return list(range(base, base + pages * PAGE + 1))  # full pages + one token


def compute(sched: HiCacheScheduler, rid: str, tokens: list[int]) -> list[bytes]:
    """A request with no hit computes its prompt; its pages are stored in L2.
    Returns the page keys whose stores were planned."""
    req = request(rid, tokens)
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    assert hit == 0
    blocks = list(range(1, len(tokens) // BS + 2))
    sched.update_state_after_alloc(req, [blocks], 0)
    sched.tables[rid] = blocks  # type: ignore[attr-defined]
    plan = sched.build_connector_meta({rid: len(tokens)})
    req.num_computed_tokens = len(tokens)
    return [p.key for p in plan.stores]


def backed_up(sched: HiCacheScheduler, keys: list[bytes], ranks=(0,)) -> None:
    for rank in ranks:
        sched.on_worker_report(WorkerReport(l3_stored={rank: list(keys)}))


def test_a_page_is_in_l3_once_every_writing_rank_backed_it_up(tmp_path):
    sched = make(tmp_path, tp_size=2)
    keys = compute(sched, "a", tokens_of(100, 3))
    backed_up(sched, keys, ranks=(0,))
    assert sched.tree.l3_pages() == 0  # rank 1 has not stored its shard yet
    backed_up(sched, keys[:2], ranks=(1,))
    assert sched.tree.l3_pages() == 2
    # MLA: one shard, one writer.
    mla = make(tmp_path / "mla", tp_size=2, l3_writers=1)
    backed_up(mla, compute(mla, "a", tokens_of(100, 3)), ranks=(0,))
    assert mla.tree.l3_pages() == 3
    sched.tree.check_invariants()


def test_evicted_pages_stay_in_the_tree_and_lookups_skip_the_store(tmp_path):
    sched = make(tmp_path, slots=4)
    first = tokens_of(100, 3)
    keys = compute(sched, "a", first)
    write_prompt_pages(tmp_path, NS, sched.geom, first, PAGE)  # what the backups wrote
    backed_up(sched, keys)
    store = sched.storage
    asked = store.calls
    compute(sched, "b", tokens_of(500, 3))  # 3 more pages in a 4-page L2: a's go
    assert store.calls == asked + 1  # b's own lookup
    assert sched.tree.total_pages() == 4  # b's 3 pages and a's first
    assert sched.tree.l3_only_pages() == 2  # a's evicted pages: still indexed
    # a returns: its pages after the L2 match come from L3, known by the tree alone.
    again = request("a2", first)
    hit, is_async = sched.get_num_new_matched_tokens(again, 0)
    assert hit == 3 * PAGE and is_async
    assert store.calls == asked + 1 and sched.stats.l3_lookups_from_tree == 1
    sched.tree.check_invariants()


def test_flush_of_l3_by_prefix_finds_pages_only_l3_holds(tmp_path):
    sched = make(tmp_path, slots=8)
    convo, other = tokens_of(100, 3), tokens_of(500, 2)
    keys = compute(sched, "a", convo) + compute(sched, "b", other)
    for tokens in (convo, other):
        write_prompt_pages(tmp_path, NS, sched.geom, tokens, PAGE)
    backed_up(sched, keys)
    counts, op = sched.flush({"l2"}, None)
    assert counts["l2_pages"] == 5 and op is None
    assert sched.tree.total_pages() == 0 and sched.tree.l3_only_pages() == 5
    # Flush L3 from the conversation's second page on (a page-aligned prefix):
    # those pages, found in the tree though no L2 copy is left.
    a_keys = keys_of(NS.seed(), convo, PAGE)
    counts, op = sched.flush({"l3"}, convo[: 2 * PAGE])
    assert isinstance(op, DeletePages) and set(op.keys) == set(a_keys[1:])
    assert sched.storage.delete([k.hex() for k in op.keys]) == 2
    # A prefix ending mid-page flushes the pages after its full ones: none left.
    counts, op = sched.flush({"l3"}, convo[: PAGE + 3])
    assert isinstance(op, DeletePages) and op.keys == ()
    # From the first page on; the other conversation's pages stay.
    counts, op = sched.flush({"l3"}, convo[:PAGE])
    assert isinstance(op, DeletePages) and set(op.keys) == set(a_keys[:1])
    assert sched.storage.delete([k.hex() for k in op.keys]) == 1
    b_keys = keys_of(NS.seed(), other, PAGE)
    assert sched.storage.store.exists_prefix([k.hex() for k in b_keys]) == 2
    assert sched.tree.l3_only_pages() == 2 and sched.tree.find(a_keys[:1]) is None
    # Flush all of L3: the index forgets every page, the store is cleared.
    counts, op = sched.flush({"l3"}, None)
    assert isinstance(op, ClearStore) and sched.tree.l3_pages() == 0
    sched.tree.check_invariants()


def test_l2_flush_keeps_what_l3_holds_and_l3_flush_keeps_l2(tmp_path):
    sched = make(tmp_path, slots=8)
    convo = tokens_of(100, 3)
    keys = compute(sched, "a", convo)
    backed_up(sched, keys[:2])  # the third page's backup has not finished
    sched.flush({"l2"}, convo[:PAGE])
    assert sched.tree.total_pages() == 0 and sched.tree.l3_only_pages() == 2
    sched = make(tmp_path / "2", slots=8)
    keys = compute(sched, "a", convo)
    backed_up(sched, keys)
    sched.flush({"l3"}, convo[: 2 * PAGE])
    assert sched.tree.total_pages() == 3 and sched.tree.l3_pages() == 1


def test_a_restarted_engine_rebuilds_the_index_from_lookups(tmp_path):
    convo = tokens_of(100, 4)
    sched = make(tmp_path)
    write_prompt_pages(tmp_path, NS, sched.geom, convo, PAGE)  # a previous engine's pages
    store = sched.storage
    assert sched.get_num_new_matched_tokens(request("r1", convo), 0) == (4 * PAGE, True)
    assert store.calls == 1 and sched.tree.l3_only_pages() == 4
    # Another request with that history: the tree answers.
    assert sched.get_num_new_matched_tokens(request("r2", convo), 0) == (4 * PAGE, True)
    assert store.calls == 1
    sched.tree.check_invariants()


def test_a_page_a_fetch_could_not_read_leaves_the_index(tmp_path):
    convo = tokens_of(100, 4)
    sched = make(tmp_path, kv_events=True)
    write_prompt_pages(tmp_path, NS, sched.geom, convo, PAGE)
    req = request("r", convo)
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, True)
    sched.update_state_after_alloc(req, [list(range(10, 19))], 4 * PAGE)
    sched.build_connector_meta({})
    found = sched.take_events()
    assert [e.medium for e in found] == [MEDIUM_L3] * 4
    # The store lost pages 3 and 4 meanwhile: the worker read 2.
    sched.on_worker_report(WorkerReport(fetched={"r": [2]}))
    h = req.block_hashes
    *stored, lost = sched.take_events()
    assert [(e.medium, e.block_hashes) for e in stored] == [
        (MEDIUM_L2, tuple(h[0:2])), (MEDIUM_L2, tuple(h[2:4]))]
    assert lost == PagesRemoved(tuple(h[4:8]), MEDIUM_L3)
    assert sched.tree.total_pages() == 2 and sched.tree.l3_pages() == 2
    # The next lookup asks the store for what the tree no longer vouches for.
    calls = sched.storage.calls
    sched.get_num_new_matched_tokens(request("r2", convo), 0)
    assert sched.storage.calls == calls + 1
    sched.tree.check_invariants()


def test_l3_events_follow_backups_and_flushes(tmp_path):
    sched = make(tmp_path, kv_events=True)
    convo = tokens_of(100, 2)
    keys = compute(sched, "a", convo)
    l2_events = sched.take_events()
    assert [e.medium for e in l2_events] == [MEDIUM_L2] * 2
    backed_up(sched, keys)
    l3_events = sched.take_events()
    # Same pages, same hashes, parents and tokens; another medium.
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in l3_events] == [
        (e.block_hashes, e.parent_block_hash, e.token_ids) for e in l2_events]
    assert [e.medium for e in l3_events] == [MEDIUM_L3] * 2
    backed_up(sched, keys)  # reported twice: no second event
    assert sched.take_events() == []
    sched.flush({"l3"}, convo[:PAGE])
    (removed,) = sched.take_events()
    assert removed == PagesRemoved(tuple(h for e in l3_events for h in e.block_hashes),
                                   MEDIUM_L3)


def test_the_l3_only_index_is_bounded(tmp_path):
    sched = make(tmp_path, slots=8)
    sched.tree.max_l3_only_pages = 4
    for i in range(3):
        convo = tokens_of(1000 * (i + 1), 2)
        backed_up(sched, compute(sched, f"r{i}", convo))
        sched.flush({"l2"}, None)  # every page L3-only now
    assert sched.tree.l3_only_pages() <= 4
    sched.tree.check_invariants()


def test_reused_admission_backs_a_page_up_once_a_later_request_reaches_it(tmp_path):
    """``hicache_l3_admission: reused``: a first computation is stored in L2 only; the
    first later request that finds it in L2 gets it backed up with the next plan (once);
    with ``all`` every store goes on to L3."""
    sched = make(tmp_path, l3_admission="reused")
    first = tokens_of(100, 3)
    req = request("a", first)
    sched.get_num_new_matched_tokens(req, 0)
    blocks = list(range(1, len(first) // BS + 2))
    sched.update_state_after_alloc(req, [blocks], 0)
    sched.tables["a"] = blocks  # type: ignore[attr-defined]
    plan = sched.build_connector_meta({"a": len(first)})
    assert [p.l3_keys for p in plan.stores] == [()] * 3 and plan.backups == []
    req.num_computed_tokens = len(first)
    # b shares a's first two pages: they are in L2, b reached them.
    b = request("b", first[: 2 * PAGE] + list(range(900, 900 + PAGE + 1)))
    assert sched.get_num_new_matched_tokens(b, 0)[0] == 2 * PAGE
    backups = sched.build_connector_meta({}).backups
    assert [(p.key, p.l3_keys) for p in backups] == [(k, (k,)) for k in keys_of(
        NS.seed(), first, PAGE)[:2]]
    assert [p.slot for p in backups] == sched.tree.match_prefix(
        [p.key for p in backups]).host_slots
    sched.get_num_new_matched_tokens(b, 0)  # asked again next step: nothing new
    assert sched.build_connector_meta({}).backups == []
    every = make(tmp_path / "all")
    again = request("a", first)
    every.get_num_new_matched_tokens(again, 0)
    every.update_state_after_alloc(again, [blocks], 0)
    every.tables["a"] = blocks  # type: ignore[attr-defined]
    stores = every.build_connector_meta({"a": len(first)}).stores
    assert len(stores) == 3 and all(p.l3_keys == (p.key,) for p in stores)
