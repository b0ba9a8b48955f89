"""L3 catches up with L2 on a live CPU vLLM engine, and what it caught up survives a crash.

Engine A (multiprocess, as in production; L2 + a file L3; admin over real HTTP)
serves the first turns of a few conversations. While their second turns run,
the admin flushes L3, detaches it and attaches it again: L3 is empty, and the
first turns' pages, which L2 still holds and which no request stores again,
would never reach it by write-through. The second turns are sent again (L2
hits, nothing new to store), ``GET /lookup`` waits for L3 to hold every
history, and the engine core is SIGKILLed. A fresh engine on that L3 (empty
L2, vLLM's prefix cache off) serves the third turns: every history token
comes from L3, tokens identical to the baseline. Without the catch-up
(tiers/controller/catch_up.py) the wait fails: L3 holds no history's first
pages.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD, history_lengths
from support.admin_http import TOKEN, held, post, tiers, wait_for

from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import EngineSpec, close_llm, kill_engine_core, open_llm

pytestmark = pytest.mark.engine

CONVS = 4


def spec(tiny_model: str, path: str, **hicache) -> EngineSpec:
    return EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=CONVS,
        hicache={"hicache_size": 0.05, "hicache_storage_backend": "file",
                 "hicache_storage_backend_extra_config": {"path": path}, **hicache})


def test_l3_flushed_and_reattached_under_load_catches_up_and_survives_a_kill(
        tiny_model, baseline, tmp_path):
    path = str(tmp_path / "l3")
    port = free_port()
    first, second, third = baseline.turns[:3]
    # Tokens of each returning history in full pages: what L3 must give back.
    full = [(h - 1) // BLOCK_SIZE * BLOCK_SIZE for h in history_lengths(baseline, 2)[:CONVS]]
    llm = open_llm(spec(tiny_model, path, hicache_admin_port=port, hicache_admin_token=TOKEN))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        got = run_turns(llm, first.prompts[:CONVS], WORKLOAD.answer_tokens)
        assert got.outputs == first.outputs[:CONVS]

        # L3 emptied and swapped while the second turns run.
        results = []
        load = threading.Thread(target=lambda: results.append(
            run_turns(llm, second.prompts[:CONVS], WORKLOAD.answer_tokens)))
        load.start()
        try:
            codes = [post(client, "/flush", {"tiers": ["l3"]}).status_code,
                     post(client, "/storage/detach").status_code,
                     post(client, "/storage/attach", {
                         "backend": "file", "extra_config": {"path": path}}).status_code]
        finally:
            load.join()
        assert codes == [200, 200, 200]
        assert results[0].outputs == second.outputs[:CONVS]
        # Keep serving: the same turns hit L2 and store nothing new.
        again = run_turns(llm, second.prompts[:CONVS], WORKLOAD.answer_tokens)
        assert again.outputs == second.outputs[:CONVS]

        def caught_up() -> bool:
            return all(held(client, p)["l3"] >= n
                       for p, n in zip(third.prompts[:CONVS], full, strict=True))

        wait_for(caught_up, "L3 never caught up with L2", limit_s=180)
        l3 = tiers(client)["l3"]
        assert l3["catch_up_pages"] > 0 and l3["backlog_pages"] == 0
        kill_engine_core(llm)
    finally:
        client.close()
        close_llm(llm)

    fresh = open_llm(spec(tiny_model, path, hicache_storage_prefetch_policy="wait_complete"))
    try:
        # One at a time, so which tier serves the shared system prompt is fixed.
        got = run_turns(fresh, third.prompts[:CONVS], WORKLOAD.answer_tokens,
                        one_by_one=True)
    finally:
        close_llm(fresh)
    assert got.outputs == third.outputs[:CONVS]
    assert got.num_cached_tokens == full
    # Every history from L3, but the system prompt the first one stored in L2 again.
    splits = [p["hicache"]["cached_tokens"] for p in got.kv_transfer_params]
    assert splits[0] == {"l1": 0, "l2": 0, "l3": full[0]}
    shared = WORKLOAD.shared_prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    for split, n in zip(splits[1:], full[1:], strict=True):
        assert split == {"l1": 0, "l2": shared, "l3": n - shared}, split
