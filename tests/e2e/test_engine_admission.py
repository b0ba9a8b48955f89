"""Admission unchanged where HiCache has nothing to give (CPU engine, bf16: what users run).

A fresh HiCache engine, whose tiers hold nothing the prompts could use, gets a
batch of distinct prompts at once, and vLLM batches them as it likes: several
per step, prefills cut into chunks, decodes beside prefills. The oracle is the
same engine with the do-nothing connector (vLLM's CPU path computes
differently in bf16 once any connector is configured). Every step must
schedule the same requests with the same token counts (the step profile's
batches, connector/profile.py, ``HICACHE_PROFILE``), and every greedy token
must be the oracle's: in bf16 a different batch changes the numbers, so equal
tokens alone would not show equal batches, and equal batches are what makes
the tokens equal. Shapes:

- the tiny Llama, token prompts, then equal-length embedding prompts;
- the same, with HiCache inside vLLM's ``MultiConnector``;
- the sliding-window model, prompts longer than its window.

L1 is large enough that nothing is preempted: a preempted request's own pages
are something HiCache can give (it then loads them, and the batch differs by
design: ``tests/tiers/controller/test_scheduler_l3.py`` covers the admission
of requests vLLM's own cache already holds).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hicache.integration.models.tiny_model import ensure_tiny_model
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG as NULL
from hicache.tiers.profile import PROFILE_ENV

pytestmark = pytest.mark.engine

BLOCK = 32
HICACHE = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"hicache_size": 0.05, "hicache_admin_port": 0}}
MULTI = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"connectors": [NULL, HICACHE]},
         "kv_load_failure_policy": "recompute"}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 1900) for _ in range(length)] for _ in range(n)]


def _serve(model: str, kv: dict, profile: Path, embeds: list[torch.Tensor] | None = None,
           prompt_len: int = 300) -> tuple[list[list[int]], list[dict[str, int]]]:
    """Token prompts (then embedding prompts) submitted at once; greedy tokens, and
    every step's batch from the scheduler's profile records (request ids without
    vLLM's random suffix)."""
    from vllm import SamplingParams

    os.environ[PROFILE_ENV] = str(profile)
    try:
        llm = open_llm(EngineSpec(
            model=model, kv_transfer=kv, dtype="bfloat16", block_size=BLOCK,
            max_model_len=1024, max_num_seqs=8, in_process=True,
            extra_args={"max_num_batched_tokens": 512, "enable_prompt_embeds": True}))
    finally:
        del os.environ[PROFILE_ENV]  # read when the connectors were built
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    try:
        batches = [{"prompt_token_ids": p} for p in _prompts(10, prompt_len, 5)]
        if embeds is not None:
            batches += [{"prompt_embeds": e} for e in embeds]
        tokens = [list(r.outputs[0].token_ids)
                  for r in llm.generate(batches, params, use_tqdm=False)]
    finally:
        close_llm(llm)
    steps = [json.loads(line) for line in profile.read_text().splitlines()]
    # Inside MultiConnector every child is profiled: one child's records say it all.
    first = next(r["connector"] for r in steps if r["role"] == "scheduler")
    return tokens, [{rid.split("-")[0]: n for rid, n in r["batch"].items()} for r in steps
                    if r["role"] == "scheduler" and r["connector"] == first and r["batch"]]


@pytest.fixture(scope="module")
def embeds(tiny_model) -> list[torch.Tensor]:
    """Embeddings of four different prompts of 256 tokens."""
    with safe_open(f"{tiny_model}/model.safetensors", "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return [table[torch.tensor(p)].clone() for p in _prompts(4, 256, 9)]


@pytest.fixture(scope="module")
def llama(tiny_model, embeds, tmp_path_factory):
    d = tmp_path_factory.mktemp("admission")
    return {name: _serve(tiny_model, kv, d / f"{name}.jsonl", embeds)
            for name, kv in (("null", NULL), ("hicache", HICACHE), ("multi", MULTI))}


def test_the_profile_joins_both_halves_of_every_step(llama, tmp_path_factory):
    """The records the comparison read: worker steps carry their plan's number, every
    request's first token is found, and the report reads HiCache's own records inside
    MultiConnector."""
    from hicache.integration.bench.profile_report import compare_table, load, summarize

    d = tmp_path_factory.getbasetemp()
    files = {name: next(d.glob(f"admission*/{name}.jsonl")) for name in llama}
    profiles = {name: load(path, name) for name, path in files.items()}
    for name, prof in profiles.items():
        seqs = {r["seq"] for r in prof.scheduler}
        worker = [r for r in prof.worker if r["forward_s"] is not None]
        assert worker and {r["seq"] for r in worker} <= seqs, name
        s = summarize(prof)
        assert s["requests"] == 14 and s["to_first_token_ms"]["mean"] > 0, name
    assert {r["connector"] for r in profiles["multi"].scheduler} == {"HiCacheConnector"}
    hooks = {k for r in profiles["hicache"].worker for k in r["hooks"]}
    assert {"wait_for_save", "save_kv_layer", "build_connector_worker_meta"} <= hooks
    table = compare_table([summarize(p) for p in profiles.values()])
    assert "| forward ms |" in table and "hicache × null" in table


@pytest.mark.parametrize("subject", ["hicache", "multi"])
def test_a_hicache_engine_with_nothing_to_give_batches_and_answers_like_the_oracle(
        llama, subject):
    want_tokens, want_steps = llama["null"]
    tokens, steps = llama[subject]
    assert len(want_steps) > 20 and any(len(b) > 2 for b in want_steps)  # real batching
    assert steps == want_steps
    assert tokens == want_tokens


def test_a_sliding_window_model_past_its_window_batches_like_the_oracle(tmp_path):
    swa = str(ensure_tiny_model("swa"))  # every layer sees the last 384 tokens
    want_tokens, want_steps = _serve(swa, NULL, tmp_path / "null.jsonl", prompt_len=600)
    tokens, steps = _serve(swa, HICACHE, tmp_path / "hicache.jsonl", prompt_len=600)
    assert steps == want_steps
    assert tokens == want_tokens
