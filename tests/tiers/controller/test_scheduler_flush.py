"""Scheduler flush (the admin endpoint's): all pages or exactly the pages below a prefix,
in L2, and the L3 operation it plans; locked pages are skipped; per-tier lookup counters."""

from support.fakes import keys_of, request
from support.fakes import serve as serve_request

from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
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
    s = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS,
        block_ids_of=lambda rid: [tables[rid]], storage=storage,
        policy=SchedulerPolicy(prefetch={"prefetch_threshold": 10_000}))
    s.tables = tables
    return s


def serve(sched, rid, tokens):
    return serve_request(sched, request(rid, tokens + [1]))


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


# ---- forget: one conversation's own pages, from every tier ------------------------------

C = SHARED + list(range(300, 324))
D = SHARED + list(range(400, 424))


def test_forget_removes_a_conversation_but_not_the_prompt_others_share():
    """Four conversations hang from one 2-page system prompt; forgetting A (by any
    prefix of it that covers its own pages) removes A's 3 pages from L2 and plans the
    removal of exactly those keys from L3: the shared pages and B, C, D stay."""
    sched = scheduler()
    for rid, tokens in zip("abcd", (A, B, C, D), strict=True):
        serve(sched, rid, tokens)
    assert sched.tree.total_pages() == 2 + 4 * 3
    assert sched.forget(A[:20])[0]["l2_pages"] == 0  # full pages: only the shared ones
    counts, l3 = sched.forget(A[:28])  # ends inside A's second own page
    assert counts == {"l2_pages": 3, "skipped_locked": 0, "kept_shared_pages": 2}
    assert isinstance(l3, DeletePages) and set(l3.keys) == set(pages_of(A)[2:])
    assert sched.tree.match_prefix(pages_of(A)).num_pages == 2
    for tokens in (B, C, D):
        assert sched.tree.match_prefix(pages_of(tokens)).num_pages == 5
    sched.tree.check_invariants()


def test_forget_takes_the_later_turns_and_keeps_a_prefix_another_prompt_extends():
    sched = scheduler()
    turn2 = A + list(range(500, 516))  # A's next turn: 2 more pages below A's
    serve(sched, "a", A)
    serve(sched, "a2", turn2)
    serve(sched, "b", B)
    serve(sched, "c", C)
    counts, l3 = sched.forget(A)  # the first turn: its later turn goes too
    assert counts["l2_pages"] == 5 and counts["kept_shared_pages"] == 2
    assert set(l3.keys) == set(pages_of(turn2)[2:])
    assert sched.tree.match_prefix(pages_of(turn2)).num_pages == 2
    # The shared prompt itself: B and C part there, so nothing goes.
    counts, l3 = sched.forget(SHARED)
    assert counts == {"l2_pages": 0, "skipped_locked": 0, "kept_shared_pages": 2}
    assert l3 is None
    assert sched.tree.match_prefix(pages_of(B)).num_pages == 5


def test_forget_of_a_prompt_the_tree_never_saw_removes_its_l3_keys_but_keep_tokens():
    """A fresh engine knows no sharing: every L3 key of the prompt goes, unless the
    client names the leading tokens to keep (its system prompt)."""
    sched = scheduler()
    counts, l3 = sched.forget(A)
    assert counts["l2_pages"] == 0 and set(l3.keys) == set(pages_of(A))
    counts, l3 = sched.forget(A, keep_tokens=len(SHARED) + 3)
    assert counts["kept_shared_pages"] == 2 and set(l3.keys) == set(pages_of(A)[2:])


def test_lookup_counts_what_each_tier_holds_without_touching_the_tree(tmp_path):
    from support.fakes import file_store, write_prompt_pages

    from hicache.tiers.controller.admin import SchedulerAdmin

    write_prompt_pages(tmp_path, NS, GEOM, A + [1], PAGE)  # all 5 pages of A in L3
    sched = scheduler(storage=file_store(tmp_path, NS, GEOM))
    serve(sched, "b", B)
    admin = SchedulerAdmin(sched, _Config(), engine={}, build_storage=None, l1_pages=0)
    before = [(n.id, n.last_access, len(n.keys)) for n in sched.tree.iter_nodes()]
    got = admin.lookup(A + [7, 7], None)
    assert got["tokens"] == {"l2": 2 * PAGE, "l3": 5 * PAGE}  # B's pages are A's first 2
    assert got["expected_load_s"] == {"l2": None, "l3": None}  # nothing loaded yet
    assert [(n.id, n.last_access, len(n.keys)) for n in sched.tree.iter_nodes()] == before
    assert admin.lookup(list(range(50, 60)), None)["tokens"] == {"l2": 0, "l3": 0}


class _Config:
    hicache_storage_backend = "file"
