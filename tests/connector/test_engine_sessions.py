"""Agent sessions on a live CPU vLLM engine: a request's ``retain_s`` keeps its pages in
L2 through a flood of other prompts four times the size of L2, so its returning turn is
a full L2 hit; the same session without it is evicted; once its deadline has passed its
pages are evictable again. The hints travel in ``SamplingParams.extra_args
["kv_transfer_params"]``, as vLLM passes an OpenAI body's ``kv_transfer_params``.

One in-process engine, vLLM's prefix cache off (every cached token reported is
HiCache's), no L3 (a returning turn can only be an L2 hit), L2 as large as L1. A second
one with a file L3 and the admin endpoint: ``POST /prefetch`` of an L3-only session,
while another request keeps the engine stepping, makes the session's next turn an L2
hit with no L3 read at its admission.
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

pytestmark = pytest.mark.engine

ANSWER = 8


@pytest.fixture
def llm(tiny_model):
    # Function-scoped: the admin test below starts its own in-process engine, and two
    # in-process engines in one process share vLLM's global KV-transfer group.
    engine = open_llm(EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_ratio": 1.0}))
    try:
        yield engine
    finally:
        close_llm(engine)


def ask(llm, prompt: list[int], **hints):
    params = greedy_params(ANSWER)
    if hints:
        params.extra_args = {"kv_transfer_params": {"hicache": hints}}
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out


def l2_pages(llm) -> int:
    return scheduler_connector(llm).hicache_scheduler.slots.capacity


def flood(llm, rng: random.Random) -> None:
    """Fresh prompts worth four times L2 (none of them ever comes back)."""
    size = 16 * BLOCK_SIZE
    prompts = [[rng.randrange(8, 2000) for _ in range(size)]
               for _ in range(4 * l2_pages(llm) // 16 + 1)]
    for lo in range(0, len(prompts), 4):
        llm.generate([{"prompt_token_ids": p} for p in prompts[lo:lo + 4]],
                     greedy_params(1), use_tqdm=False)


def test_retain_s_keeps_a_session_through_a_flood_until_its_deadline(llm):
    rng = random.Random(31)
    kept, plain, short = ([rng.randrange(8, 2000) for _ in range(12 * BLOCK_SIZE + 5)]
                          for _ in range(3))
    full = 12 * BLOCK_SIZE
    first = {name: ask(llm, prompt, **hints) for name, prompt, hints in (
        ("kept", kept, {"retain_s": 3600}), ("plain", plain, {}),
        ("short", short, {"retain_s": 1}))}
    assert first["kept"].kv_transfer_params["hicache"]["retained_pages"] == 12
    assert "retained_pages" not in (first["plain"].kv_transfer_params or {}).get("hicache", {})
    time.sleep(1.5)  # past "short"'s deadline (the pin ends at the next plan)
    flood(llm, rng)
    again = {name: ask(llm, prompt) for name, prompt in (
        ("kept", kept), ("plain", plain), ("short", short))}
    # The retained session returns as a full L2 hit; the others were evicted.
    assert again["kept"].num_cached_tokens == full
    assert again["kept"].kv_transfer_params["hicache"]["cached_tokens"] == {
        "l1": 0, "l2": full, "l3": 0}
    assert again["plain"].num_cached_tokens == 0
    assert again["short"].num_cached_tokens == 0
    for name in first:
        assert list(again[name].outputs[0].token_ids) == list(first[name].outputs[0].token_ids)
    stats = scheduler_connector(llm).hicache_scheduler.pins.stats()
    assert stats["pins"] >= 1 and stats["next_expiry_s"] > 3000


TOKEN = "sessions-admin-token"


def test_admin_prefetch_brings_a_session_back_into_l2_while_the_engine_steps(
        tiny_model, tmp_path):
    port = free_port()
    llm = open_llm(EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_ratio": 1.0, "hicache_admin_port": port,
                 "hicache_admin_token": TOKEN, "hicache_storage_backend": "file",
                 "hicache_prefetch_at_arrival": False,
                 "hicache_storage_backend_extra_config": {"path": str(tmp_path)}}))
    admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                         headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        rng = random.Random(37)
        session = [rng.randrange(8, 2000) for _ in range(12 * BLOCK_SIZE + 5)]
        full = 12 * BLOCK_SIZE
        first = ask(llm, session)
        deadline = time.monotonic() + 120  # the L3 backups land in the background
        while admin.get("/stats").json()["tiers"]["l3"]["pages_saved"] < 12:
            assert time.monotonic() < deadline, "the L3 backups never landed"
            ask(llm, [rng.randrange(8, 2000) for _ in range(8)])  # steps the engine
        assert llm.reset_prefix_cache(reset_connector=True)  # L2 emptied: L3 only
        engine = llm.llm_engine
        # Another session generates meanwhile: the engine keeps stepping.
        engine.add_request("busy", {"prompt_token_ids": [rng.randrange(8, 2000)
                                                         for _ in range(64)]},
                           greedy_params(400))
        engine.step()
        r = admin.post("/prefetch", json={"prefix": session})
        assert r.status_code == 200, r.text
        assert r.json() == {"prefetch_tokens": full, "l3_tokens": full, "l2_tokens": 0}
        sched = scheduler_connector(llm).hicache_scheduler
        for _ in range(400):  # steps, not seconds: until every rank reported it
            if sched.tree.peek(sched.prefix_keys(session)) == 12:
                break
            engine.step()
        assert sched.tree.peek(sched.prefix_keys(session)) == 12, "prefetch never landed"
        fetched = admin.get("/stats").json()["tiers"]["l3"]["pages_loaded"]
        engine.add_request("back", {"prompt_token_ids": session}, greedy_params(ANSWER))
        done = None
        for _ in range(400):
            for out in engine.step():
                if out.request_id == "back" and out.finished:
                    done = out
            if done is not None:
                break
        assert done is not None
        assert done.kv_transfer_params["hicache"]["cached_tokens"] == {
            "l1": 0, "l2": full, "l3": 0}
        assert list(done.outputs[0].token_ids) == list(first.outputs[0].token_ids)
        # Its admission read nothing from L3.
        assert admin.get("/stats").json()["tiers"]["l3"]["pages_loaded"] == fetched
        engine.abort_request(["busy"])
    finally:
        admin.close()
        close_llm(llm)
