"""Scheduler flush (the admin endpoint's): all pages or exactly the pages below a prefix,
in L2, and the L3 operation it plans; locked pages are skipped; per-tier lookup counters."""

from support.fakes import keys_of, request

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.commands import ClearStore, DeletePages
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.geometry import PoolGeometry

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=32, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
SHARED = list(range(1000, 1016))  # 2 pages shared by both conversations
A = SHARED + list(range(100, 124))  # + 3 pages
B = SHARED + list(range(200, 224))




def scheduler(storage=None) -> HiCacheScheduler:
    tables: dict[str, list[int]] = {}
    s = HiCacheScheduler(geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
                         block_ids_of=lambda rid: [tables[rid]], storage=storage,
                         prefetch={"prefetch_threshold": 10_000})
    s.tables = tables
    return s


def serve(sched, rid, tokens):
    req = request(rid, tokens + [1])
    hit, _ = sched.get_num_new_matched_tokens(req, 0)
    blocks = list(range(1, len(req.all_token_ids) // BS + 2))  # 0 is vLLM's null block
    sched.update_state_after_alloc(req, [blocks], hit)
    sched.tables[rid] = blocks
    sched.build_connector_meta({rid: req.num_tokens - hit})
    req.num_computed_tokens = req.num_tokens
    sched.request_finished(req, [blocks])
    sched.build_connector_meta({})
    return hit


def pages_of(tokens):
    return keys_of(NS.seed(), tokens, PAGE)


def test_prefix_flush_removes_one_conversation_keeps_the_shared_prompt():
    sched = scheduler()
    serve(sched, "a", A)
    serve(sched, "b", B)
    assert sched.tree.total_pages() == 2 + 3 + 3
    counts, l3 = sched.flush({"l2"}, A[:24])  # page-aligned: A's 3rd page and below
    assert counts == {"l2_pages": 3, "skipped_locked": 0} and l3 is None
    assert sched.tree.match_prefix(pages_of(A)).num_pages == 2
    assert sched.tree.match_prefix(pages_of(B)).num_pages == 5
    assert sched.slots.num_used == sched.tree.total_pages() == 5
    sched.tree.check_invariants()


def test_mid_page_prefix_flushes_everything_after_its_full_pages():
    sched = scheduler()
    serve(sched, "a", A)
    serve(sched, "b", B)
    counts, _ = sched.flush({"l2"}, SHARED + [100, 101, 102])
    assert counts["l2_pages"] == 6  # both conversations share the 2 full pages
    assert sched.tree.total_pages() == 2


def test_flush_all_skips_locked_pages():
    sched = scheduler()
    serve(sched, "a", A)
    again = request("a2", A + [5])
    hit, _ = sched.get_num_new_matched_tokens(again, 0)
    sched.update_state_after_alloc(again, [list(range(11))], hit)  # locks A's pages
    counts, _ = sched.flush({"l2"}, None)
    assert counts["l2_pages"] == 0 and counts["skipped_locked"] == 5
    sched.build_connector_meta({})  # the load is planned, the lock released
    assert sched.flush({"l2"}, None)[0]["l2_pages"] == 5
    assert sched.flush({"l2", "l3"}, None)[1] == ClearStore()
    assert sched.slots.num_used == 0


def test_l3_prefix_flush_names_the_flushed_pages_and_the_prefix_end():
    sched = scheduler()
    serve(sched, "a", A)
    _, op = sched.flush({"l2", "l3"}, A[:24])
    keys = pages_of(A)
    assert op == DeletePages(tuple(keys[2:]))
    # Nothing of A's tail in L2 any more: L3 still loses the prefix's last page.
    assert sched.flush({"l3"}, A[:24])[1] == DeletePages((keys[2],))


def test_lookup_counters_per_tier():
    sched = scheduler()
    serve(sched, "a", A)  # 5 prompt pages, nothing cached
    serve(sched, "a2", A + list(range(300, 308)))  # 6 pages: 5 from L2, 1 new
    st = sched.stats
    assert (st.l1_hit_pages, st.l2_hit_pages, st.l2_miss_pages) == (0, 5, 5 + 1)
