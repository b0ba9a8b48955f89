"""The scheduler half with L3 span objects (tiers/index/spans.py), without an engine: which
stores become span objects, lookups through span and page objects, fetch plans that
name spans, and flushes and retention that reach span objects. The real file backend."""

from __future__ import annotations

import pytest
from support.fakes import file_store, keys_of, prefill, request

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.commands import DeletePages, RetainPages
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.index.spans import MIB, SpanLayout
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import WriteBatch

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=32, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
SPAN = 2  # pages per object in these tests
TOKENS = list(range(500, 500 + 7 * PAGE + 3))  # 7 full pages
KEYS = keys_of(NS.seed(), TOKENS, PAGE)
LAYOUT = SpanLayout(SPAN)

pytestmark = pytest.mark.skipif(not native_io.available(),
                                reason="file span objects need the GIL-free batch path")


def scheduler(tmp_path, object_mib: float = SPAN * GEOM.page_bytes / MIB) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    sched = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], storage=file_store(tmp_path, NS, GEOM),
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 0, "object_mib": object_mib}))
    sched.tables = tables  # type: ignore[attr-defined]
    return sched


def writer(tmp_path):
    store = file_store(tmp_path, NS, GEOM)
    store.register_host_pool(HostPagePool(GEOM, layout="page_first", pin_memory=False))
    return store


def test_a_prefill_stores_whole_spans_as_span_objects_and_the_tail_as_pages(tmp_path):
    sched = scheduler(tmp_path)
    assert sched.l2.spans == LAYOUT
    meta = prefill(sched, request("a", TOKENS), list(range(1, 16)))
    spans = [p.span for p in meta.stores]
    assert [s and (s.index, s.count) for s in spans] == [(0, 2), (1, 2)] * 3 + [None]
    assert [s.key for s in spans[:6]] == [k for k in LAYOUT.object_keys(KEYS) for _ in (0, 1)]


def test_span_objects_are_off_at_object_mib_0_and_for_stores_without_them(tmp_path):
    assert scheduler(tmp_path, object_mib=0).l2.spans == SpanLayout(1)
    sched = scheduler(tmp_path)
    sched.storage = None
    assert sched.l2.spans == SpanLayout(1)
    meta = prefill(sched, request("a", TOKENS), list(range(1, 16)))
    assert all(p.span is None for p in meta.stores)


def test_a_lookup_finds_pages_in_span_objects_and_page_objects_and_fetches_name_spans(
        tmp_path):
    store = writer(tmp_path)
    refs = [LAYOUT.ref(KEYS, i) for i in range(4)]
    # Pages 0..3 in two span objects, 4 and 5 as page objects (a span stored page by
    # page), page 6 nowhere.
    assert all(store.write(WriteBatch([k.hex() for k in KEYS[:4]], [0, 1, 2, 3], refs)))
    assert all(store.write(WriteBatch([k.hex() for k in KEYS[4:6]], [4, 5])))
    sched = scheduler(tmp_path)
    req = request("r", TOKENS)
    assert sched.get_num_new_matched_tokens(req, 0) == (6 * PAGE, True)
    sched.update_state_after_alloc(req, [list(range(1, 16))], 6 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [p.span and p.span.index for p in fetch.l3_pages] == [0, 1, 0, 1, 0, 1]
    assert fetch.l3_pages[4].span.key == LAYOUT.object_keys(KEYS)[2]  # not stored: pages
    sched.on_worker_report(WorkerReport(fetched={"r": [6]}))
    assert sched.tree.match_prefix(KEYS).num_pages == 6


def test_an_admin_prefetch_counts_and_reads_pages_in_span_objects(tmp_path):
    """POST /prefetch asks L3 as a lookup does: pages inside span objects count (a
    prefetch that asked for page objects only found none of a prefill's pages), and
    its fetch names the span objects; the admin wakes the engine for it and the
    scheduler has work for the workers until they report it."""
    from hicache.tiers.controller.admin import SchedulerAdmin

    class Config:
        hicache_storage_backend = "file"

    store = writer(tmp_path)
    refs = [LAYOUT.ref(KEYS, i) for i in range(4)]
    assert all(store.write(WriteBatch([k.hex() for k in KEYS[:4]], [0, 1, 2, 3], refs)))
    sched = scheduler(tmp_path)
    woke: list[int] = []
    admin = SchedulerAdmin(sched, Config(), engine={}, build_storage=None, l1_pages=0,
                           wake=lambda: woke.append(1))
    assert not sched.has_worker_work()
    got = admin.prefetch(TOKENS, None)
    assert (got["prefetch_tokens"], got["l3_tokens"], got["l2_tokens"]) == (4 * PAGE,
                                                                             4 * PAGE, 0)
    assert woke == [1] and sched.has_worker_work()
    (fetch,) = sched.build_connector_meta({}).fetches
    assert [p.span and (p.span.index, p.span.count) for p in fetch.l3_pages] == [
        (0, 2), (1, 2)] * 2
    assert sched.has_worker_work()  # handed over, not reported yet
    sched.on_worker_report(WorkerReport(fetched={fetch.req_id: [4]}))
    assert not sched.has_worker_work()
    assert sched.tree.match_prefix(KEYS).num_pages == 4
    assert admin.prefetch(TOKENS, None)["prefetch_tokens"] == 0 and woke == [1]


def test_flush_and_forget_delete_the_span_objects_of_what_goes(tmp_path):
    sched = scheduler(tmp_path)
    prefill(sched, request("a", TOKENS), list(range(1, 16)))
    spans = LAYOUT.object_keys(KEYS)
    # A prefix of 3 pages: pages 2.. go, so do the span objects ending at 3 and 5
    # (page 2's span holds page 3, the one ending at 1 stays).
    counts, removal = sched.flusher.flush({"l2", "l3"}, TOKENS[: 3 * PAGE])
    assert isinstance(removal, DeletePages)
    assert set(removal.keys) >= {spans[1], spans[2]} and spans[0] not in removal.keys
    assert set(KEYS[2:]) <= set(removal.keys) and KEYS[1] not in removal.keys
    # Forget the conversation: every span object of its prompt goes.
    _, removal = sched.flusher.forget(TOKENS)
    assert removal is not None and set(spans) <= set(removal.keys)


def test_retention_names_the_span_objects_too(tmp_path):
    sched = scheduler(tmp_path)
    sched.retain_in_l3(KEYS, 60)
    (command,) = sched._commands
    assert isinstance(command, RetainPages)
    assert set(command.keys) == set(KEYS) | set(LAYOUT.object_keys(KEYS))


def test_a_store_that_starts_inside_a_span_backs_the_whole_span_up_as_its_own_object(
        tmp_path):
    """Request b shares a's first 3 pages and goes on with its own: its store starts
    inside the span of pages 2 and 3, whose object (a's) a lookup of b cannot name. b's
    own span of pages 2-3 (a's page 2, b's page 3) goes to L3 as one object, read from
    L2 with the next plan, and b's page 3 gets no page object of its own; a lookup of
    b's prompt then finds every span through b's objects."""
    sched = scheduler(tmp_path)
    prefill(sched, request("a", TOKENS), list(range(1, 16)))
    other = TOKENS[: 3 * PAGE] + list(range(900, 900 + 4 * PAGE + 3))
    b = request("b", other)
    hit, _ = sched.get_num_new_matched_tokens(b, 0)
    assert hit == 3 * PAGE
    blocks = list(range(20, 35))
    sched.update_state_after_alloc(b, [blocks], hit)
    sched.tables["b"] = blocks  # type: ignore[attr-defined]
    b.num_computed_tokens = hit  # vLLM's: its hit is computed
    meta = sched.build_connector_meta({"b": b.num_tokens - hit})
    b_keys = keys_of(NS.seed(), other, PAGE)
    span = LAYOUT.object_keys(b_keys)[1]  # pages 2-3, named by b's page 3
    assert [(p.key, p.span and (p.span.key, p.span.index)) for p in meta.backups] == [
        (KEYS[2], (span, 0)), (b_keys[3], (span, 1))]
    assert meta.backups[0].slot == sched.tree.match_prefix(KEYS[:3]).host_slots[2]
    assert meta.stores[0].key == b_keys[3] and meta.stores[0].l3_keys == ()
    assert [p.span is not None for p in meta.stores[1:]] == [True, True, False]  # 4-5 whole
    assert sched.build_connector_meta({}).backups == []
    # What the worker writes: b's spans; a lookup of b's pages finds them.
    store = writer(tmp_path)
    for group in (meta.backups, [p for p in meta.stores if p.span is not None]):
        assert all(store.write(WriteBatch([p.key.hex() for p in group], [p.slot for p in group],
                                          [p.span for p in group])))
    assert LAYOUT.run_in_store(store.exists_prefix, b_keys, 2, 6) == 4  # pages 2-5


def test_a_prefill_cut_into_steps_still_stores_whole_spans_as_objects(tmp_path):
    """A prompt computed over two steps (chunked prefill): the span the first step
    begins and the second ends goes to L3 as one object when its last page is stored,
    not page by page; its first page gets no page object."""
    sched = scheduler(tmp_path)
    req = request("a", TOKENS)
    sched.get_num_new_matched_tokens(req, 0)
    blocks = list(range(1, 16))
    sched.update_state_after_alloc(req, [blocks], 0)
    sched.tables["a"] = blocks  # type: ignore[attr-defined]
    first = sched.build_connector_meta({"a": 3 * PAGE})  # pages 0-2
    req.num_computed_tokens = 3 * PAGE
    assert [(p.span is not None, p.l3_keys) for p in first.stores] == [
        (True, (KEYS[0],)), (True, (KEYS[1],)), (False, ())]
    second = sched.build_connector_meta({"a": req.num_tokens - 3 * PAGE})
    assert [(p.key, p.span.index) for p in second.backups] == [(KEYS[2], 0), (KEYS[3], 1)]
    assert second.stores[0].key == KEYS[3] and second.stores[0].l3_keys == ()


def test_a_request_that_leaves_a_span_early_is_never_promised_pages_only_that_span_holds(
        tmp_path):
    """a's pages 2 and 3 are one span object, which the tree indexes page by page. b
    shares a's first 3 pages: its own span of pages 2-3 has another key, so page 2 is
    out of b's reach as long as it lives only inside a's object. The lookup must not
    trust the tree for it (the fetch used to fail that page: the "failed L3 fetch
    pages" of a single engine nobody else writes to); it asks the store, which finds
    what b can read, and the real I/O thread then reads every page it was promised."""
    from hicache.tiers.worker.l3_io import StorageIO

    sched = scheduler(tmp_path)
    meta = prefill(sched, request("a", TOKENS), list(range(1, 16)))
    store = writer(tmp_path)
    pool = HostPagePool(GEOM, layout="page_first", pin_memory=False)
    store.register_host_pool(pool)
    # The worker's backups of a's plan: whole spans as span objects, the tail as pages.
    spanned = [p for p in meta.stores if p.span is not None]
    assert all(store.write(WriteBatch([p.key.hex() for p in spanned], [p.slot for p in spanned],
                                      [p.span for p in spanned])))
    assert all(store.write(WriteBatch([p.key.hex() for p in meta.stores if p.span is None],
                                  [p.slot for p in meta.stores if p.span is None])))
    sched.on_worker_report(WorkerReport(l3_stored={0: [p.key for p in meta.stores]}))
    sched.flush({"l2"}, None)  # a's pages leave L2; the tree still knows L3 has them
    assert sched.tree.match_prefix(KEYS).l3_pages == 7
    other = TOKENS[: 3 * PAGE] + list(range(900, 900 + 4 * PAGE + 3))
    b = request("b", other)
    hit, is_async = sched.get_num_new_matched_tokens(b, 0)
    assert is_async and hit == 2 * PAGE  # pages 0-1 (a's first span, b's too); not 2
    sched.update_state_after_alloc(b, [list(range(20, 35))], hit)
    (fetch,) = sched.build_connector_meta({}).fetches
    io = StorageIO(store, pool, lambda pages: None)
    try:
        io.submit_fetch(fetch)
        assert io.wait_results(60)  # a hang guard, not a speed check
        (result,) = io.poll()
    finally:
        io.shutdown()
    assert result.fetched_pages == len(fetch.l3_pages) == 2
    assert io.stats.fetch_failed_pages == 0
