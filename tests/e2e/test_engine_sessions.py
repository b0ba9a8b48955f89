"""Agent sessions on a live CPU vLLM engine in bf16 (what users run), tokens against the
bf16 oracle: vLLM with a connector that never loads (NullConnector), its own prefix
cache on and an L1 that keeps every prompt. Each prompt goes to the oracle twice, one
request at a time: its first answer is the oracle of a miss, its second (the prompt's
full pages reused from vLLM's prefix cache, the same bytes HiCache serves, cut at the
same page boundary) the oracle of a returning turn.

- ``retain_s`` keeps a session's pages in L2 through a flood of other prompts four
  times the size of L2, so its returning turn is a full L2 hit; the same session
  without it is evicted; once its deadline has passed its pages are evictable again.
  Then ``priority``: a flood of one-off prompts sent as ``low`` evicts only itself, so
  a plain (normal) session stays. The hints travel in ``SamplingParams.extra_args
  ["kv_transfer_params"]``, as vLLM passes an OpenAI body's ``kv_transfer_params``.
  One in-process engine, vLLM's prefix cache off (every cached token reported is
  HiCache's), no L3 (a returning turn can only be an L2 hit), L2 as large as L1.
- With a file L3 and the admin endpoint: ``POST /prefetch`` of an L3-only session,
  while another request keeps the engine stepping, makes the session's next turn an
  L2 hit with no L3 read at its admission; then ``POST /forget`` of one of four
  conversations that share a system prompt, and a fresh engine on the same L3 serves
  that one nothing from L3 and the other three in full.

Engines in one process share vLLM's global KV-transfer group, so each is closed before
the next opens (function-scoped, or opened inside its test).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS

from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    greedy_params,
    open_llm,
    scheduler_connector,
)
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

pytestmark = pytest.mark.engine

ANSWER = 8
DTYPE = "bfloat16"
TOKEN = "sessions-admin-token"
SESSION_PAGES = 12
CONVS = 4
SYSTEM_PAGES = 5


def _draw(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 2000) for _ in range(n)]


def _session(seed: int) -> list[int]:
    return _draw(random.Random(seed), SESSION_PAGES * BLOCK_SIZE + 5)


# Every prompt whose answer is compared, by name: (prompt, asked again as a hit?).
RETAIN = {"kept": _session(31), "plain": _session(32), "short": _session(33),
          "favored": _session(34)}
PREFETCHED = _session(37)
_rng = random.Random(29)
_system = _draw(_rng, SYSTEM_PAGES * BLOCK_SIZE)
# Own parts past the L3 prefetch threshold (256 tokens), as the system prompt is not.
CONVERSATIONS = [_system + _draw(_rng, 400) for _ in range(CONVS)]
PROMPTS = {**RETAIN, "prefetched": PREFETCHED,
           **{f"conv{i}": p for i, p in enumerate(CONVERSATIONS)}}


def ask(llm, prompt: list[int], **hints):
    params = greedy_params(ANSWER)
    if hints:
        params.extra_args = {"kv_transfer_params": {"hicache": hints}}
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def oracle(tiny_model) -> dict[str, dict[str, list[int]]]:
    """Per prompt: ``miss`` (first answer) and ``hit`` (asked again, full pages cached)."""
    llm = open_llm(EngineSpec(model=tiny_model, dtype=DTYPE, block_size=BLOCK_SIZE,
                              max_model_len=MAX_MODEL_LEN, in_process=True,
                              kv_transfer=TRANSFER_CONFIG))
    try:
        out = {}
        for name, prompt in PROMPTS.items():
            miss = ask(llm, prompt)
            hit = ask(llm, prompt)
            assert hit.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
            out[name] = {"miss": tokens(miss), "hit": tokens(hit)}
        return out
    finally:
        close_llm(llm)


@pytest.fixture
def llm(tiny_model, oracle):
    engine = open_llm(EngineSpec(
        model=tiny_model, dtype=DTYPE, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_ratio": 1.0}))
    try:
        yield engine
    finally:
        close_llm(engine)


def l2_pages(llm) -> int:
    return scheduler_connector(llm).hicache_scheduler.slots.capacity


def flood(llm, rng: random.Random, batch: int = 4, **hints) -> None:
    """Fresh prompts worth four times L2 (none of them ever comes back), ``batch`` at
    a time (the pages of a batch are locked while their stores are in flight)."""
    size = 16 * BLOCK_SIZE
    prompts = [_draw(rng, size) for _ in range(4 * l2_pages(llm) // 16 + 1)]
    params = greedy_params(1)
    if hints:
        params.extra_args = {"kv_transfer_params": {"hicache": hints}}
    for lo in range(0, len(prompts), batch):
        llm.generate([{"prompt_token_ids": p} for p in prompts[lo:lo + batch]], params,
                     use_tqdm=False)


def test_retain_s_and_priority_keep_a_session_through_a_flood(llm, oracle):
    rng = random.Random(41)
    full = SESSION_PAGES * BLOCK_SIZE
    first = {name: ask(llm, RETAIN[name], **hints) for name, hints in (
        ("kept", {"retain_s": 3600}), ("plain", {}), ("short", {"retain_s": 1}))}
    assert first["kept"].kv_transfer_params["hicache"]["retained_pages"] == SESSION_PAGES
    assert "retained_pages" not in (first["plain"].kv_transfer_params or {}).get("hicache", {})
    time.sleep(1.5)  # past "short"'s deadline (the pin ends at the next plan)
    flood(llm, rng)
    again = {name: ask(llm, RETAIN[name]) for name in first}
    # The retained session returns as a full L2 hit; the others were evicted.
    assert again["kept"].num_cached_tokens == full
    assert again["kept"].kv_transfer_params["hicache"]["cached_tokens"] == {
        "l1": 0, "l2": full, "l3": 0}
    assert again["plain"].num_cached_tokens == 0
    assert again["short"].num_cached_tokens == 0
    for name in first:
        assert tokens(first[name]) == oracle[name]["miss"], name
    assert tokens(again["kept"]) == oracle["kept"]["hit"]
    assert tokens(again["plain"]) == oracle["plain"]["miss"]
    assert tokens(again["short"]) == oracle["short"]["miss"]
    stats = scheduler_connector(llm).hicache_scheduler.pins.stats()
    assert stats["pins"] >= 1 and stats["next_expiry_s"] > 3000

    # One-off prompts sent as priority "low" evict each other, not a normal session.
    # Two at a time: beside "kept"'s pin and "favored", L2 then always holds low pages
    # no store has locked (a class orders eviction; it cannot free locked pages).
    favored = ask(llm, RETAIN["favored"])
    flood(llm, rng, batch=2, priority="low")
    back = ask(llm, RETAIN["favored"])
    assert back.kv_transfer_params["hicache"]["cached_tokens"] == {"l1": 0, "l2": full, "l3": 0}
    assert tokens(favored) == oracle["favored"]["miss"]
    assert tokens(back) == oracle["favored"]["hit"]


def _step_until(engine, done, steps: int = 400) -> None:
    for _ in range(steps):
        if done():
            return
        engine.step()
    assert done(), "gave up after stepping the engine"


def test_admin_prefetch_and_forget_sessions_with_a_file_l3(tiny_model, tmp_path, oracle):
    """``POST /prefetch`` while the engine steps, then four conversations that share
    a system prompt, each a session: one's ``retain_s`` carries to its next turn, one
    is removed by ``POST /forget`` and one by ``POST /sessions/{id}/close`` with
    ``forget``, and a fresh engine on the same L3 serves only the other two from it
    (one engine start saved: the suite's time)."""
    port = free_port()
    llm = open_llm(EngineSpec(
        model=tiny_model, dtype=DTYPE, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_ratio": 1.0, "hicache_admin_port": port,
                 "hicache_admin_token": TOKEN, "hicache_storage_backend": "file",
                 "hicache_prefetch_at_arrival": False,
                 "hicache_storage_backend_extra_config": {"path": str(tmp_path)}}))
    admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}"})
    rng = random.Random(43)
    full = SESSION_PAGES * BLOCK_SIZE
    try:
        sched = scheduler_connector(llm).hicache_scheduler
        first = ask(llm, PREFETCHED)
        deadline = time.monotonic() + 120  # the L3 backups land in the background
        while admin.get("/stats").json()["tiers"]["l3"]["pages_saved"] < SESSION_PAGES:
            assert time.monotonic() < deadline, "the L3 backups never landed"
            ask(llm, _draw(rng, 8))  # steps the engine
        assert llm.reset_prefix_cache(reset_connector=True)  # L2 emptied: L3 only
        engine = llm.llm_engine
        # Another session generates meanwhile: the engine keeps stepping.
        engine.add_request("busy", {"prompt_token_ids": _draw(rng, 64)}, greedy_params(400))
        engine.step()
        r = admin.post("/prefetch", json={"prefix": PREFETCHED})
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["prefetch_tokens"], got["l3_tokens"], got["l2_tokens"]) == (full, full, 0)
        assert got["status"] in ("queued", "running") and got["pages"] == SESSION_PAGES
        keys = sched.prefix_keys(PREFETCHED)
        # Steps, not seconds: until every rank reported it.
        _step_until(engine, lambda: sched.tree.peek(keys) == SESSION_PAGES)
        fetched = admin.get("/stats").json()["tiers"]["l3"]["pages_loaded"]
        # The returning turn alone, as the oracle ran it (a batch rounds differently).
        engine.abort_request(["busy"])
        back = ask(llm, PREFETCHED)
        assert back.kv_transfer_params["hicache"]["cached_tokens"] == {
            "l1": 0, "l2": full, "l3": 0}
        # Its admission read nothing from L3.
        assert admin.get("/stats").json()["tiers"]["l3"]["pages_loaded"] == fetched
        assert tokens(first) == oracle["prefetched"]["miss"]
        assert tokens(back) == oracle["prefetched"]["hit"]

        # Forget one of four conversations that share a system prompt.
        convs = [ask(llm, p, session_id=f"conv{i}", **({"retain_s": 600} if i == 1 else {}))
                 for i, p in enumerate(CONVERSATIONS)]
        for i, out in enumerate(convs):
            assert tokens(out) == oracle[f"conv{i}"]["miss"], i
        deadline = time.monotonic() + 120
        while admin.get("/stats").json()["queues"]["l3_backup_queue_pages"]:
            assert time.monotonic() < deadline, "the L3 backups never landed"
            time.sleep(0.5)
        conv_full = (len(CONVERSATIONS[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE

        def held(prompt: list[int]) -> dict[str, int]:
            r = admin.get("/lookup", params={"prefix": ",".join(map(str, prompt))})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert held(CONVERSATIONS[0])["l3"] >= conv_full
        r = admin.post("/forget", json={"prefix": CONVERSATIONS[0]})
        assert r.status_code == 200, r.text
        counts = r.json()
        assert counts["kept_shared_pages"] == SYSTEM_PAGES and counts["l3_pages"] > 0, counts
        assert held(CONVERSATIONS[0])["l3"] == SYSTEM_PAGES * BLOCK_SIZE  # no more
        for other in CONVERSATIONS[1:]:
            assert held(other)["l3"] == conv_full

        # Session conv1's next turn sets no hint: it keeps the retention its first set.
        back = ask(llm, CONVERSATIONS[1], session_id="conv1")
        assert back.kv_transfer_params["hicache"]["retained_pages"] == conv_full // BLOCK_SIZE
        assert tokens(back) == oracle["conv1"]["hit"]
        view = admin.get("/sessions/conv1").json()
        assert (view["open"], view["turns"], view["retain_s"]) == (True, 2, 600), view
        assert admin.get("/stats").json()["sessions"] == {"open": CONVS, "closed": 0}
        r = admin.post("/sessions/conv1/close", json={"forget": True})
        assert r.status_code == 200, r.text
        closed = r.json()
        assert closed["released_pins"] >= 1 and closed["l3_pages"] > 0, closed
        assert closed["kept_shared_pages"] == SYSTEM_PAGES, closed
        assert held(CONVERSATIONS[1]) == {"l2": SYSTEM_PAGES * BLOCK_SIZE,
                                          "l3": SYSTEM_PAGES * BLOCK_SIZE}
        assert admin.get("/stats").json()["sessions"] == {"open": CONVS - 1, "closed": 1}
        r = admin.post("/sessions/nobody/close")
        assert r.status_code == 404 and "session_id" in r.json()["detail"]
    finally:
        admin.close()
        close_llm(llm)
    fresh = open_llm(EngineSpec(
        model=tiny_model, dtype=DTYPE, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_ratio": 1.0, "hicache_storage_backend": "file",
                 "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_backend_extra_config": {"path": str(tmp_path)}}))
    try:
        again = [ask(fresh, p) for p in CONVERSATIONS]
    finally:
        close_llm(fresh)
    # The forgotten ones: a system prompt alone is below the L3 prefetch threshold, so
    # the first is computed afresh, and the second finds only the system prompt the
    # first stored in L2 (as in the oracle, where it followed the first too).
    assert again[0].num_cached_tokens == 0
    assert again[1].kv_transfer_params["hicache"]["cached_tokens"] == {
        "l1": 0, "l2": SYSTEM_PAGES * BLOCK_SIZE, "l3": 0}
    for i in (0, 1):
        assert tokens(again[i]) == oracle[f"conv{i}"]["miss"], i
    for i in range(2, CONVS):
        # The system prompt from L2 (the forgotten one just stored it again), the rest
        # from L3.
        split = again[i].kv_transfer_params["hicache"]["cached_tokens"]
        assert split["l1"] == 0 and split["l2"] + split["l3"] == conv_full, (i, split)
        assert split["l3"] >= conv_full - SYSTEM_PAGES * BLOCK_SIZE, (i, split)
        assert tokens(again[i]) == oracle[f"conv{i}"]["hit"], i
