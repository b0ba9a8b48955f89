"""The simulated engine: vLLM's block pool model and the real scheduler driven without an engine.

Expected hit counts are derived by hand from the request shapes (page = block
= 32 tokens unless said otherwise), so a wrong eviction order, a lost page
or a double count changes them.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from hicache.integration.bench.oracle import FutureUses, OracleEviction
from hicache.integration.bench.sim_engine import L1PrefixCache, SimConfig, SimEngine
from hicache.integration.bench.trace import TraceRecord
from hicache.tiers.index.page_keys import page_keys
from hicache.tiers.index.radix_tree import HiRadixTree

BS = 32


def keys(n: int, salt: int = 0) -> list:
    return page_keys(b"t%d" % salt, list(range(n * BS)), BS)


def test_l1_pool_reserves_the_null_block_and_refuses_without_change():
    l1 = L1PrefixCache(5)
    assert l1.num_free == 4
    assert l1.allocate([], 5) is None and l1.num_free == 4
    assert l1.allocate([], 4) is not None and l1.num_free == 0


def test_l1_evicts_a_finished_requests_last_block_first():
    l1 = L1PrefixCache(4)  # 3 usable blocks
    k = keys(3)
    blocks = l1.allocate([], 3)
    l1.cache(blocks, k)
    l1.free(blocks)
    assert l1.match(k) == 3
    l1.free(l1.allocate([], 1))  # evicts k[2], the request's last block
    assert l1.match(k) == 2 and l1.evictions == 1
    l1.allocate([], 1)  # the block freed above went to the tail: k[1] goes next
    assert l1.match(k) == 1 and l1.evictions == 2


def test_l1_shared_block_is_one_block_and_stays_while_held():
    l1 = L1PrefixCache(4)
    k = keys(2)
    a = l1.allocate([], 2)
    l1.cache(a, k)
    b = l1.allocate(k[:1], 1)  # hits k[0] (held by a): no new physical block for it
    assert b is not None and l1.num_free == 0
    l1.free(a)
    assert l1.num_free == 1  # k[1] is free; k[0] still held by b
    l1.allocate([], 1)  # evicts k[1]; k[0] cannot be evicted
    assert l1.match(k) == 1


def conversation(turns: int, history: int, answer: int, question: int, seed: int,
                 t0: float = 0.0, gap: float = 1.0, with_output: bool = True) -> list[TraceRecord]:
    rng = random.Random(seed)
    prompt = [rng.randrange(8, 2000) for _ in range(history)]
    out = []
    for t in range(turns):
        gen = [rng.randrange(8, 2000) for _ in range(answer)]
        out.append(TraceRecord(id=f"s{seed}-t{t}", arrival=t0 + t * gap, finish=t0 + t * gap + 0.5,
                               output_tokens=answer, prompt=tuple(prompt),
                               prompt_tokens=len(prompt),
                               output=tuple(gen) if with_output else None))
        prompt = prompt + gen + [rng.randrange(8, 2000) for _ in range(question)]
    return out


def interleaved(convs: int, turns: int, **kw) -> list[TraceRecord]:
    """Conversation c's turn t arrives at (t * convs + c) seconds, one request at a time."""
    recs = []
    for c in range(convs):
        recs += conversation(turns, seed=c, t0=float(c), gap=float(convs), **kw)
    return sorted(recs, key=lambda r: r.arrival)


def expected_returning_pages(recs: list[TraceRecord]) -> int:
    """Pages a perfect cache serves: each returning turn's previous turn's computed pages."""
    by_conv: dict[str, TraceRecord] = {}
    total = 0
    for r in recs:
        conv = r.id.split("-")[0]
        prev = by_conv.get(conv)
        if prev is not None:
            computed = prev.prompt_tokens + prev.output_tokens - 1
            total += min(computed // BS, (r.prompt_tokens - 1) // BS)
        by_conv[conv] = r
    return total


def pages(result, tier: str) -> int:
    return sum(getattr(o, f"{tier}_pages") for o in result.outcomes)


def test_vllm_alone_with_room_hits_every_returning_page():
    recs = interleaved(3, 3, history=300, answer=20, question=40)
    res = SimEngine(SimConfig(l1_blocks=200, l2_pages=0)).run(recs)
    assert pages(res, "l1") == expected_returning_pages(recs)
    assert pages(res, "l2") == pages(res, "l3") == 0


def test_small_l1_misses_and_l2_serves_what_l1_lost():
    recs = interleaved(4, 3, history=600, answer=20, question=40)
    perfect = expected_returning_pages(recs)
    alone = SimEngine(SimConfig(l1_blocks=30, l2_pages=0)).run(recs)
    assert pages(alone, "l1") < perfect / 4
    hi = SimEngine(SimConfig(l1_blocks=30, l2_pages=1000)).run(recs)
    assert pages(hi, "l1") == pages(alone, "l1")
    assert pages(hi, "l1") + pages(hi, "l2") == perfect
    assert hi.hit_rates()["total"] == pytest.approx(perfect * BS / hi.prompt_tokens)


def test_small_l2_with_l3_serves_the_rest_from_l3():
    recs = interleaved(4, 3, history=600, answer=20, question=40)
    perfect = expected_returning_pages(recs)
    # 30 L2 pages cannot hold 4 histories of >= 19 pages: LRU cycles, L2 keeps missing.
    no_l3 = SimEngine(SimConfig(l1_blocks=30, l2_pages=30)).run(recs)
    assert pages(no_l3, "l1") + pages(no_l3, "l2") < perfect / 2
    with_l3 = SimEngine(SimConfig(l1_blocks=30, l2_pages=30, l3_pages=-1,
                                  prefetch_threshold=32)).run(recs)
    assert pages(with_l3, "l3") > 0
    assert pages(with_l3, "l1") + pages(with_l3, "l2") + pages(with_l3, "l3") == perfect
    # A bounded L3 too small for the working set loses pages again.
    tiny_l3 = SimEngine(SimConfig(l1_blocks=30, l2_pages=30, l3_pages=20,
                                  prefetch_threshold=32)).run(recs)
    assert pages(tiny_l3, "l3") < pages(with_l3, "l3")


def test_selective_policy_stores_a_page_only_once_two_requests_computed_it():
    recs = interleaved(4, 3, history=600, answer=20, question=40)
    wt = SimEngine(SimConfig(l1_blocks=30, l2_pages=1000)).run(recs)
    sel = SimEngine(SimConfig(l1_blocks=30, l2_pages=1000,
                              write_policy="write_through_selective")).run(recs)
    by_turn = lambda res, t: sum(o.l2_pages for o in res.outcomes if o.id.endswith(f"t{t}"))  # noqa: E731
    assert by_turn(wt, 1) > 0 and by_turn(sel, 1) == 0  # turn 0's pages were seen once
    assert by_turn(sel, 2) > 0  # turn 1 saw its history a second time


def test_page_hash_trace_replays_like_its_token_trace():
    recs = interleaved(3, 3, history=400, answer=20, question=40, with_output=False)
    hashed = [
        TraceRecord(id=r.id, arrival=r.arrival, finish=r.finish, output_tokens=r.output_tokens,
                    page_hashes=tuple(k.hex() for k in page_keys(b"x", list(r.prompt), BS)),
                    page_size=BS, prompt_tokens=r.prompt_tokens)
        for r in recs
    ]
    cfg = SimConfig(l1_blocks=40, l2_pages=50, l3_pages=-1, prefetch_threshold=32)
    a, b = SimEngine(cfg).run(recs), SimEngine(cfg).run(hashed)
    assert a.hit_rates() == b.hit_rates() and a.hit_rates()["total"] > 0


def test_requests_wait_for_blocks_and_an_impossible_one_is_an_error():
    recs = [TraceRecord(id=f"r{i}", arrival=0.0, finish=1.0, output_tokens=1,
                        prompt=tuple(range(i * 1000, i * 1000 + 200)), prompt_tokens=200)
            for i in range(3)]
    res = SimEngine(SimConfig(l1_blocks=16, l2_pages=0)).run(recs)  # 15 blocks: 2 fit at once
    assert [o.queued_s for o in res.outcomes] == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="needs more L1 blocks"):
        SimEngine(SimConfig(l1_blocks=4, l2_pages=0)).run(recs)


@pytest.mark.parametrize("kw, key", [
    ({"write_policy": "lru"}, "write_policy"), ({"l1_blocks": 1}, "l1_blocks"),
    ({"l2_pages": -1}, "l2_pages"), ({"page_size": 48}, "page_size"),
    ({"eviction": "lfu"}, "eviction must be one of lru, tlru, oracle"),
])
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        SimConfig(**{"l1_blocks": 10, "l2_pages": 0, **kw})


def test_future_uses_and_the_oracles_eviction_order():
    a, b, c = keys(3)
    uses = FutureUses([[c], [a], [a, b], [c]])
    assert [uses.next_use(k, 0) for k in (a, b, c)] == [1, 2, 0]
    assert uses.next_use(c, 1) == 3 and uses.next_use(b, 3) == math.inf
    tree = HiRadixTree()
    tree.insert([a, b], [0, 1])
    tree.insert([c], [2])
    oracle = OracleEviction(uses)
    assert [oracle.evict(tree, 1) for _ in range(3)] == [[1], [0], [2]]  # b, a, then c
    tree.insert([a, b], [0, 1])
    tree.insert([c], [2])
    oracle.position = 1  # c's next use is now 3: it goes first
    assert oracle.evict(tree, 1) == [2]


def test_oracle_eviction_bounds_lru_from_above():
    recs = interleaved(4, 3, history=600, answer=20, question=40)
    perfect = expected_returning_pages(recs)
    lru = SimEngine(SimConfig(l1_blocks=30, l2_pages=30)).run(recs)
    oracle = SimEngine(SimConfig(l1_blocks=30, l2_pages=30, eviction="oracle")).run(recs)
    assert pages(oracle, "l1") == pages(lru, "l1")  # L1 is vLLM's LRU either way
    # LRU cycles through four histories that do not fit; Belady keeps what comes back.
    assert pages(lru, "l2") < pages(oracle, "l2") <= perfect - pages(oracle, "l1")


def agent_trace(prefetch: bool = False, retain_s: float | None = None,
                return_in_s: float | None = None) -> list[TraceRecord]:
    """Session 0 (300-token history) returns every 4 s between three 600-token ones; it
    may ask to be retained, have its history prefetched 0.1 s before it returns, or say
    when it returns (each turn finishes 0.5 s after it arrives)."""
    recs = conversation(3, 300, 20, 40, seed=0, gap=4.0)
    for t in range(1, 3):
        prev = recs[t - 1]
        recs[t] = dataclasses.replace(
            recs[t], prefetch_at=recs[t].arrival - 0.1 if prefetch else None,
            prefetch_tokens=prev.prompt_tokens + prev.output_tokens if prefetch else 0)
    if retain_s:
        recs = [dataclasses.replace(r, hints={"retain_s": retain_s}) for r in recs]
    if return_in_s is not None:
        recs = [dataclasses.replace(r, hints={"return_in_s": return_in_s}) for r in recs]
    for c in range(1, 4):
        recs += conversation(3, 600, 20, 40, seed=c, t0=float(c), gap=4.0)
    return sorted(recs, key=lambda r: r.arrival)


def session_pages(result, tier: str, session: str = "s0-") -> int:
    return sum(getattr(o, f"{tier}_pages") for o in result.outcomes if o.id.startswith(session))


def test_replayed_retain_s_keeps_the_session_in_l2():
    recs = agent_trace(retain_s=100)
    mine = expected_returning_pages([r for r in recs if r.id.startswith("s0-")])
    on = SimEngine(SimConfig(l1_blocks=30, l2_pages=30)).run(recs)
    off = SimEngine(SimConfig(l1_blocks=30, l2_pages=30, hints=False)).run(recs)
    assert session_pages(on, "l1") + session_pages(on, "l2") == mine
    assert session_pages(off, "l1") + session_pages(off, "l2") < mine


def test_replayed_prefetch_turns_the_sessions_l3_hits_into_l2_hits():
    recs = agent_trace(prefetch=True)
    cfg = SimConfig(l1_blocks=30, l2_pages=30, l3_pages=-1, prefetch_threshold=32)
    on = SimEngine(cfg).run(recs)
    off = SimEngine(dataclasses.replace(cfg, hints=False)).run(recs)
    assert session_pages(off, "l3") > 0 and off.prefetches == 0
    assert session_pages(on, "l3") == 0 and on.prefetches == 2 and on.prefetch_pages > 0
    assert session_pages(on, "l2") >= session_pages(off, "l2") + session_pages(off, "l3")


def test_replayed_return_in_s_books_the_read_before_the_session_returns():
    """Each turn finishes 0.5 s after it arrives and the next comes 4 s after it: a
    return_in_s of 4.4 books the read (1 s lead) for 0.1 s before the return, as the
    replayed POST /prefetch above; one booked 10 s out comes too late to help."""
    cfg = SimConfig(l1_blocks=30, l2_pages=30, l3_pages=-1, prefetch_threshold=32)
    off = SimEngine(dataclasses.replace(cfg, hints=False)).run(agent_trace(return_in_s=4.4))
    on = SimEngine(cfg).run(agent_trace(return_in_s=4.4))
    late = SimEngine(cfg).run(agent_trace(return_in_s=10.0))
    assert session_pages(off, "l3") > 0 and off.prefetches == 0
    assert session_pages(on, "l3") == 0 and on.prefetches == 3 and on.prefetch_pages > 0
    assert session_pages(on, "l2") >= session_pages(off, "l2") + session_pages(off, "l3")
    assert session_pages(late, "l3") == session_pages(off, "l3")


def test_sim_request_hashes_each_block_once_and_match_the_stand_in():
    from hicache.integration.bench.sim_engine import SimRequest
    from hicache.tiers.index.page_keys import token_block_hashes

    req = SimRequest("r", list(range(50)), block_size=8, cache_salt="t")
    assert req.block_hashes == token_block_hashes(list(range(50)), 8, "t")
    req.all_token_ids = req.all_token_ids + list(range(900, 930))  # the answer
    assert req.block_hashes == token_block_hashes(req.all_token_ids, 8, "t")
    req.all_token_ids = [7] + req.all_token_ids[1:]  # not an extension: hashed afresh
    assert req.block_hashes == token_block_hashes(req.all_token_ids, 8, "t")
