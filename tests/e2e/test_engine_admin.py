"""The admin endpoint on a live CPU vLLM engine, over real HTTP: stats that match a
scripted workload, a prefix flush that affects exactly one conversation, flush and
storage detach/attach while loads run, auth, and vLLM's own reset_prefix_cache.

One engine (multiprocess, as in production) with L2 + a file L3; vLLM's prefix
cache is off, so every hit vLLM reports came from HiCache.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD, history_lengths
from support.admin_http import TOKEN, held, post, prefetch_status, tiers, wait_for
from typer.testing import CliRunner

from hicache.integration.bench.mooncake_service import free_port
from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.cli.main import app as cli
from hicache.integration.vllm.engine import EngineSpec, close_llm, greedy_params, open_llm

pytestmark = pytest.mark.engine

CONVS = 4
SHARED_PAGES = WORKLOAD.shared_prefix_tokens // BLOCK_SIZE


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    port = free_port()
    llm = open_llm(EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        hicache={"hicache_size": 0.05, "hicache_admin_port": port,
                 "hicache_admin_token": TOKEN, "hicache_storage_backend": "file",
                 "hicache_storage_backend_extra_config": {
                     "path": str(tmp_path_factory.mktemp("admin-l3"))}},
    ))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        yield llm, client, port
    finally:
        client.close()
        close_llm(llm)


def prompt_pages(prompts):
    return [(len(p) - 1) // BLOCK_SIZE for p in prompts]


@pytest.fixture(scope="module")
def turns(live, baseline):
    """Turns 1 and 2 of 4 conversations, with /stats taken after each."""
    llm, client, _ = live
    seen = []
    for t in (0, 1):
        want = baseline.turns[t]
        got = run_turns(llm, want.prompts[:CONVS], WORKLOAD.answer_tokens)
        assert got.outputs == want.outputs[:CONVS], f"turn {t}"
        seen.append(tiers(client))
    return seen


def test_health_and_config_hide_the_token(live):
    _, client, _ = live
    assert client.get("/healthz").status_code == 200
    body = client.get("/config").text
    assert TOKEN not in body and "hicache_size" in body


def test_stats_agree_with_the_workload(turns, baseline):
    first, second = turns
    pages0 = prompt_pages(baseline.turns[0].prompts[:CONVS])
    # Turn 1: conversation 0 computes everything; the others find the shared
    # system prompt in L2. Nothing in L1 (prefix caching off) or L3 (empty).
    assert first["l1"]["hits"] == 0
    assert first["l2"]["hits"] == SHARED_PAGES * (CONVS - 1)
    assert first["l2"]["misses"] == sum(pages0) - SHARED_PAGES * (CONVS - 1)
    assert first["l3"]["hits"] == 0
    # Turn 2: every returning history comes from L2, the new message is a miss.
    pages1 = prompt_pages(baseline.turns[1].prompts[:CONVS])
    history = [(h - 1) // BLOCK_SIZE for h in history_lengths(baseline, 1)[:CONVS]]
    assert second["l2"]["hits"] - first["l2"]["hits"] == sum(history)
    assert second["l2"]["misses"] - first["l2"]["misses"] == sum(pages1) - sum(history)
    assert second["l2"]["used_pages"] > 0 and second["l2"]["bytes_loaded"] > 0


def test_backups_reach_l3(live, turns):
    _, client, _ = live
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.get("/stats").json()
        if stats["queues"]["l3_backup_queue_pages"] == 0 and stats["tiers"]["l3"]["pages_saved"]:
            break
        time.sleep(0.5)
    assert stats["tiers"]["l3"]["pages_saved"] >= stats["tiers"]["l2"]["used_pages"] * 0.9


def test_metrics_are_prometheus_text(live, turns):
    _, client, _ = live
    text = client.get("/metrics").text
    assert 'hicache_tier_hits_total{tier="l2"}' in text


def test_mutations_need_the_token(live):
    _, client, _ = live
    for path in ("/flush", "/storage/detach", "/storage/attach"):
        r = client.post(path, json={"tiers": ["l2"], "backend": "file", "extra_config": {}})
        assert r.status_code == 401, path
        assert TOKEN not in r.text


def test_prefix_flush_hits_exactly_one_conversation(live, turns, baseline):
    llm, client, _ = live
    want = baseline.turns[2]
    # Conversation 0's first turn up to its 7th page: the shared prompt (5
    # pages) plus its first unique pages.
    prefix = baseline.turns[0].prompts[0][: 7 * BLOCK_SIZE]
    r = post(client, "/flush", {"tiers": ["all"], "prefix": prefix})
    assert r.status_code == 200, r.text
    counts = r.json()
    assert counts["l2_pages"] > 0 and counts["l3_pages"] > 0
    got = run_turns(llm, want.prompts[:2], WORKLOAD.answer_tokens, one_by_one=True)
    assert got.outputs == want.outputs[:2]
    # Conversation 0 stops at the flushed page in every tier; 1 is untouched.
    assert got.num_cached_tokens[0] == 6 * BLOCK_SIZE
    full = (history_lengths(baseline, 2)[1] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert got.num_cached_tokens[1] == full


def test_flush_and_detach_while_loads_run(live, baseline):
    """Hammer the admin API while conversations return: no crash, same tokens. Prefetch
    operations started across the detaches end (done, failed or cancelled), never 5xx."""
    llm, client, _ = live
    want = baseline.turns[2]
    stop = threading.Event()
    codes: list[int] = []
    prefetches: dict[str, int] = {}

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            if i % 3 == 2:
                codes.append(post(client, "/storage/detach").status_code)
                codes.append(post(client, "/storage/attach", {
                    "backend": "file",
                    "extra_config": client.get("/config").json()["hicache"][
                        "hicache_storage_backend_extra_config"]}).status_code)
            else:
                codes.append(post(client, "/flush", {"tiers": ["l2"]}).status_code)
            op = f"hammer-{i}"  # 409 while no L3 is attached: refused, not failed
            prefetches[op] = post(client, "/prefetch", {
                "prefix": want.prompts[i % 2], "id": op}).status_code
            i += 1
            time.sleep(0.05)

    saved_before = tiers(client)["l3"]["pages_saved"]
    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        for _ in range(3):
            got = run_turns(llm, want.prompts[2:CONVS], WORKLOAD.answer_tokens)
            assert got.outputs == want.outputs[2:CONVS]
    finally:
        stop.set()
        thread.join()
    assert codes and all(c == 200 for c in codes), codes
    assert set(prefetches.values()) <= {200, 409} and 200 in prefetches.values(), prefetches

    def ended(op: str) -> bool:
        r = client.get(f"/prefetch/{op}", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        return r.json()["status"] in ("done", "failed", "cancelled")

    started = [op for op, code in prefetches.items() if code == 200]
    wait_for(lambda: all(ended(op) for op in started), "a prefetch never ended")
    assert client.get("/healthz").status_code == 200
    # Counters survive the backends swapped underneath them.
    run_turns(llm, want.prompts[:1], WORKLOAD.answer_tokens)
    assert tiers(client)["l3"]["pages_saved"] >= saved_before


def test_cli_stats_against_the_engine(live):
    _, _, port = live
    url = f"http://127.0.0.1:{port}"
    result = CliRunner().invoke(cli, ["admin", "stats", "--url", url, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tiers"]["l2"]["capacity_pages"] > 0
    table = CliRunner().invoke(cli, ["admin", "stats", "--url", url], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "l2" in table.output, table.output


def test_vllm_reset_prefix_cache_empties_l2(live, turns):
    llm, client, _ = live
    assert tiers(client)["l2"]["used_pages"] > 0
    assert llm.reset_prefix_cache(reset_connector=True)
    assert tiers(client)["l2"]["used_pages"] == 0


def test_tree_view(live, turns):
    _, client, _ = live
    r = client.get("/tree", params={"depth": 2})
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["page_size"] == BLOCK_SIZE and view["total_pages"] >= 0


def l3_only_history(live, baseline, i: int) -> tuple[list[int], list[int], int]:
    """Turn 0 of conversation ``i`` (one no other test sends) computed with the
    baseline's tokens, backed up to L3, then flushed from L2: (its prompt, its
    answer, the tokens of its full pages)."""
    llm, client, _ = live
    want = baseline.turns[0]
    prompt, answer = want.prompts[i], want.outputs[i]
    full = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert run_turns(llm, [prompt], WORKLOAD.answer_tokens).outputs == [answer]
    wait_for(lambda: held(client, prompt)["l3"] >= full, "the L3 backups never landed")
    assert post(client, "/flush", {"tiers": ["l2"]}).status_code == 200
    assert held(client, prompt)["l2"] == 0
    return prompt, answer, full


def test_prefetch_on_an_idle_engine_reaches_l2_before_the_turn_returns(live, baseline):
    """No request runs, so vLLM's engine core waits on its input queue: ``POST
    /prefetch`` wakes it (vLLM's own WAKEUP sentinel, connector/vllm_wake.py), and
    the engine steps without a forward pass until the worker has read the pages from
    L3 and reported them. Then the turn returns allowed L2 only, and L2 serves its
    whole history with the baseline's tokens. Before the wake, the pages stayed in L3
    until the next request arrived and this wait failed."""
    llm, client, _ = live
    prompt, answer, full = l3_only_history(live, baseline, CONVS + 1)

    r = post(client, "/prefetch", {"prefix": prompt, "id": "idle-turn"})
    assert r.status_code == 200, r.text
    assert r.json()["prefetch_tokens"] >= full, r.json()

    def status() -> dict:
        return prefetch_status(client, "idle-turn")

    wait_for(lambda: status()["status"] not in ("queued", "running"),
             "the prefetch never ended on an idle engine")
    assert status()["status"] == "done" and status()["fetched_pages"] == status()["pages"]
    assert held(client, prompt)["l2"] >= full
    loaded = tiers(client)["l3"]["pages_loaded"]

    params = greedy_params(WORKLOAD.answer_tokens)
    params.extra_args = {"kv_transfer_params": {"hicache": {"load_tiers": ["l2"]}}}
    (back,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert back.kv_transfer_params["hicache"]["cached_tokens"] == {
        "l1": 0, "l2": full, "l3": 0}
    assert list(back.outputs[0].token_ids) == answer
    assert tiers(client)["l3"]["pages_loaded"] == loaded  # nothing read at admission

    # /lookup costs L2 by the loads' own copy time, as this engine measured it.
    from prometheus_client.parser import text_string_to_metric_families

    copy_s = {s.name: s.value for f in text_string_to_metric_families(
        client.get("/metrics").text) for s in f.samples}["hicache_l2_load_seconds_sum"]
    r = client.get("/lookup", params={"prefix": ",".join(map(str, prompt))},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    gbps = r.json()["load_gbps"]["l2"]
    assert copy_s > 0 and gbps == pytest.approx(
        tiers(client)["l2"]["bytes_loaded"] / copy_s / 1e9, rel=1e-3)


def test_return_in_s_reads_the_history_back_on_an_idle_engine(live, baseline):
    """The prefetch form of an agent framework, with no second client: a turn that
    says its conversation returns (``return_in_s``) books the read of its prompt and
    answer back into L2; when it is due the engine, idle, is woken and reads what L3
    holds, and the next turn, allowed L2 only, is served its whole history from L2
    with the baseline's tokens. The hinted turn stores nothing (``store: false``), so
    only the booked read can have put the pages in L2."""
    llm, client, _ = live
    prompt, answer, full = l3_only_history(live, baseline, CONVS + 2)

    def turn(hints: dict):
        params = greedy_params(WORKLOAD.answer_tokens)
        params.extra_args = {"kv_transfer_params": {"hicache": hints}}
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == answer
        return out.kv_transfer_params["hicache"]

    booked = turn({"store": False, "load_tiers": [], "return_in_s": 0.5})
    assert booked["prefetch_id"].startswith("return-") and "error" not in booked

    def status() -> dict:
        return prefetch_status(client, booked["prefetch_id"])

    wait_for(lambda: status()["status"] not in ("booked", "queued", "running"),
             "the booked prefetch never ended on an idle engine")
    assert status()["status"] == "done" and status()["pages"] >= full // BLOCK_SIZE
    assert held(client, prompt)["l2"] >= full
    back = turn({"load_tiers": ["l2"]})
    assert back["cached_tokens"] == {"l1": 0, "l2": full, "l3": 0}


def test_fuzz_the_live_admin_api_finds_no_server_error(live):
    """schemathesis-generated requests (valid and invalid) against the real target:
    flushes of random prefixes and tiers, tree views. attach/detach are left to
    the app-level fuzz: random store configs would create directories anywhere."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    _, client, port = live
    api = schemathesis.openapi.from_url(f"http://127.0.0.1:{port}/openapi.json")
    ops = [r.ok() for r in api.get_all_operations()]
    ops = [op for op in ops if not op.path.startswith("/storage")]
    assert {op.path for op in ops} >= {"/flush", "/tree", "/stats", "/metrics", "/config"}
    for mode in ("positive", "negative"):
        # Only operations with inputs have invalid ones.
        for op in ops if mode == "positive" else [o for o in ops if o.path in ("/flush", "/tree")]:
            @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
            @settings(max_examples=10, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case) -> None:
                headers = dict(case.headers or {})
                if case.method.upper() == "POST":
                    headers["Authorization"] = f"Bearer {TOKEN}"
                response = case.call(headers=headers, timeout=30)
                case.validate_response(response, checks=[not_a_server_error])
                assert TOKEN not in response.text

            run()
    assert client.get("/healthz").status_code == 200
