"""`make serve`'s launcher: the real `vllm serve` CLI finds HiCacheConnector through the
plugin entry point, serves HTTP on loopback with the default config, and refuses a bad config."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.serve import launch_serve

from hicache.integration.bench.compare import free_port, stop_server, wait_ready

pytestmark = pytest.mark.engine

SMALL_ENGINE = "--block-size 32 --num-gpu-blocks-override 80 --dtype float32 --enforce-eager"


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
    proc = launch(tiny_model, log, PORT=str(port), VLLM_SERVER_DEV_MODE="1",
                  EXTRA_CONFIG=json.dumps({"hicache_admin_port": ADMIN_PORT}))
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


def test_vllm_metrics_show_hicache_counters(server, tiny_model):
    base, _ = server
    body = {"model": tiny_model, "prompt": list(range(500, 700)), "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        saved = [line for line in metrics.splitlines()
                 if line.startswith("vllm:hicache_saved_bytes_total{")]
        if saved and float(saved[0].rsplit(" ", 1)[1]) > 0:
            break
        time.sleep(1)
    else:
        pytest.fail("vllm:hicache_saved_bytes_total never rose:\n" + metrics[-2000:])
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
