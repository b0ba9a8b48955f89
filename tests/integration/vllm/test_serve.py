"""`make serve`'s launcher: the real `vllm serve` CLI finds HiCacheConnector through the
plugin entry point, serves HTTP on loopback with the default config, and refuses a bad config."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from support.serve import launch_serve

from hicache.integration.bench.compare import free_port, stop_server, wait_ready

pytestmark = pytest.mark.engine

SMALL_ENGINE = ("--block-size 32 --num-gpu-blocks-override 80 --dtype float32 --enforce-eager "
                "--enable-prompt-tokens-details")


def launch(tiny_model: str, log: Path, **env: str) -> subprocess.Popen:
    full_env = dict(os.environ, MODEL=tiny_model, MAX_MODEL_LEN="2048",
                    SERVE_ARGS=SMALL_ENGINE, VLLM_CPU_KVCACHE_SPACE="1", **env)
    return launch_serve(full_env, log)


ADMIN_PORT = free_port()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # Dev mode adds vLLM's /reset_prefix_cache endpoint.
    l3 = tmp_path_factory.mktemp("serve-l3")
    proc = launch(tiny_model, log, PORT=str(port), VLLM_SERVER_DEV_MODE="1",
                  EXTRA_CONFIG=json.dumps({
                      "hicache_admin_port": ADMIN_PORT, "hicache_storage_backend": "file",
                      "hicache_storage_backend_extra_config": {"path": str(l3)}}))
    base = f"http://127.0.0.1:{port}"
    try:
        why = wait_ready(proc, base, 240)
        if why is not None:
            pytest.fail(f"{why}:\n{log.read_text()[-3000:]}")
        yield base, log
    finally:
        stop_server(proc)


def test_prints_the_exact_vllm_serve_command(server):
    _, log = server
    first = next(line for line in log.read_text().splitlines() if line.startswith("+ "))
    assert " serve " in first
    assert '"kv_connector":"HiCacheConnector"' in first and "kv_connector_module_path" not in first


def test_serves_completions_and_chat_with_connector_active(server, tiny_model):
    base, log = server
    prompt = list(range(100, 400))
    body = {"model": tiny_model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    first = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    again = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert first["usage"]["prompt_tokens"] == len(prompt)
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": tiny_model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "hello there, tiny model"}],
    })
    assert chat.status_code == 200, chat.text
    assert "HiCache scheduler: page_size=32" in log.read_text()
    # vLLM's CPU worker runs in a process of its own and does not freeze its heap itself
    # (connector/gc_heap.py).
    assert "froze this CPU worker's GC heap" in log.read_text()


def test_bad_config_stops_the_server_with_a_message_naming_the_key(tiny_model, tmp_path):
    log = tmp_path / "bad.log"
    proc = launch(tiny_model, log, PORT=str(free_port()),
                  EXTRA_CONFIG=json.dumps({"hicache_ratoi": 4}))
    try:
        code = proc.wait(240)
    finally:
        stop_server(proc)
    text = log.read_text()
    assert code != 0
    assert "unknown kv_connector_extra_config key(s) for HiCacheConnector: ['hicache_ratoi']" in text
    assert "allowed keys:" in text and "'hicache_ratio'" in text


def wait_reported(base: str, model: str, done: Callable[[], bool], what: str) -> None:
    """Until ``done()``: what the workers did reaches the stats with an engine step's
    report, and an idle engine makes no steps (backups that land after a request's last
    step, on a loaded machine, stay unreported). Each try sends a one-token request
    that neither stores nor loads, so a step runs; the deadline only guards a hang."""
    poke = {"model": model, "prompt": [7, 8, 9], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"hicache": {"store": False, "load_tiers": []}}}
    deadline = time.monotonic() + 600
    while not done():
        assert time.monotonic() < deadline, what
        assert httpx.post(f"{base}/v1/completions", json=poke, timeout=60).status_code == 200
        time.sleep(0.5)


def test_vllm_metrics_show_hicache_counters(server, tiny_model):
    base, _ = server
    body = {"model": tiny_model, "prompt": list(range(500, 700)), "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    metrics = ""

    def saved_bytes_rose() -> bool:
        nonlocal metrics
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        saved = [line for line in metrics.splitlines()
                 if line.startswith("vllm:hicache_saved_bytes_total{")]
        return bool(saved) and float(saved[0].rsplit(" ", 1)[1]) > 0

    wait_reported(base, tiny_model, saved_bytes_rose, "vllm:hicache_saved_bytes_total never rose")
    assert "vllm:hicache_l3_corrupt_pages_total" in metrics


def test_vllm_reset_prefix_cache_empties_l2(server, tiny_model):
    base, _ = server
    admin = f"http://127.0.0.1:{ADMIN_PORT}"
    body = {"model": tiny_model, "prompt": list(range(800, 900)), "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{admin}/stats").json()["tiers"]["l2"]["used_pages"] > 0
    r = httpx.post(f"{base}/reset_prefix_cache", params={"reset_external": "true"}, timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{admin}/stats").json()["tiers"]["l2"]["used_pages"] == 0


def test_each_response_says_which_tier_served_its_cached_tokens(server, tiny_model):
    """kv_transfer_params["hicache"]["cached_tokens"] as an OpenAI client sees it: the
    same prompt served from nothing, then vLLM's prefix cache (L1), then L2 (L1 reset),
    then L3 (L1 and L2 reset), each split adding up to usage's cached_tokens."""
    base, _ = server
    admin = f"http://127.0.0.1:{ADMIN_PORT}"
    prompt = list(range(1000, 1300))
    full = (len(prompt) - 1) // 32 * 32  # tokens in complete pages (block 32)
    body = {"model": tiny_model, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def saved() -> int:
        return httpx.get(f"{admin}/stats", timeout=10).json()["tiers"]["l3"]["pages_saved"]

    def ask() -> dict[str, int]:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        tiers = reply["kv_transfer_params"]["hicache"]["cached_tokens"]
        assert sum(tiers.values()) == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return tiers

    before = saved()
    assert ask() == {"l1": 0, "l2": 0, "l3": 0}
    assert ask() == {"l1": full, "l2": 0, "l3": 0}
    reset = f"{base}/reset_prefix_cache"
    assert httpx.post(reset, timeout=30).status_code == 200  # L1 only
    assert ask() == {"l1": 0, "l2": full, "l3": 0}
    # The pages' L3 backups land in the background: wait for them (not a timing check).
    wait_reported(base, tiny_model, lambda: saved() >= before + full // 32,
                  "the L3 backups never landed")
    r = httpx.post(reset, params={"reset_external": "true"}, timeout=30)  # L1 and L2
    assert r.status_code == 200, r.text
    assert ask() == {"l1": 0, "l2": 0, "l3": full}
    # One histogram per tier, in vLLM's /metrics and the admin's (every finished request
    # observed; vLLM publishes its stats a few times a second).
    def l3_observed() -> bool:
        nonlocal metrics
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        l3 = [line for line in metrics.splitlines()
              if line.startswith("vllm:hicache_request_cached_tokens_l3_sum{")]
        return bool(l3) and float(l3[0].rsplit(" ", 1)[1]) >= full

    metrics = ""
    wait_reported(base, tiny_model, l3_observed, "no L3 request in vLLM's /metrics")
    assert "vllm:hicache_request_cached_tokens_l1_bucket{" in metrics
    own = httpx.get(f"{admin}/metrics", timeout=10).text
    sums = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in own.splitlines()
            if line.startswith("hicache_request_cached_tokens_l")
            and line.split(" ")[0].endswith("_sum")}
    assert sums["hicache_request_cached_tokens_l3_sum"] >= full, sums
    assert sums["hicache_request_cached_tokens_l2_sum"] >= full, sums


def test_request_controls_in_the_openai_body(server, tiny_model):
    """kv_transfer_params["hicache"] in a completions body: store=false leaves nothing
    in L2 or L3 for the next request to find, load_tiers=["l2"] never reads L3, and a
    bad value is named in the response while the request and the server carry on."""
    base, _ = server
    admin = f"http://127.0.0.1:{ADMIN_PORT}"
    prompt = list(range(1400, 1700))
    full = (len(prompt) - 1) // 32 * 32
    reset = f"{base}/reset_prefix_cache"

    def ask(hints: object = None) -> dict:
        body = {"model": tiny_model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if hints is not None:
            body["kv_transfer_params"] = {"hicache": hints}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["kv_transfer_params"]["hicache"]

    def saved() -> int:
        return httpx.get(f"{admin}/stats", timeout=10).json()["tiers"]["l3"]["pages_saved"]

    assert ask({"store": False})["cached_tokens"] == {"l1": 0, "l2": 0, "l3": 0}
    assert httpx.post(reset, timeout=30).status_code == 200  # L1 only
    before = saved()
    # Nothing was stored: L2 and L3 have none of it (this request stores it).
    assert ask()["cached_tokens"] == {"l1": 0, "l2": 0, "l3": 0}
    wait_reported(base, tiny_model, lambda: saved() >= before + full // 32,
                  "the L3 backups never landed")
    assert httpx.post(reset, params={"reset_external": "true"}, timeout=30).status_code == 200
    assert ask({"load_tiers": ["l2"], "store": False})["cached_tokens"] == {
        "l1": 0, "l2": 0, "l3": 0}  # L3 holds it, but this request may not read it
    assert httpx.post(reset, timeout=30).status_code == 200  # what vLLM's L1 kept of it
    bad = ask({"load_tiers": ["l3"], "store": False})  # served as with no hints: from L3
    assert "kv_transfer_params.hicache.load_tiers=['l3']" in bad["error"]
    assert bad["cached_tokens"] == {"l1": 0, "l2": 0, "l3": full}
    assert "error" not in ask()
