"""MLA (a tiny DeepSeek-V2: multi-head latent attention) on the CPU engine, at TP=2.

vLLM's CPU MLA backend caches one latent vector per token (kv_lora_rank 512
+ 64 RoPE dims, the only size it supports, block size 16), replicated on
every rank. So HiCache keys MLA pages without the rank, and only rank 0
backs them up to L3: one shared shard, written once, read by every rank.
Engines: vLLM without a connector (the oracle, TP=2), HiCache with a small
L1 and a file L3 (returning turns from L2), and a fresh HiCache engine with
an empty L2 that serves the returning turns from the shared L3 shard.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import run_multi_turn

from hicache.integration.bench.multi_turn import (
    MultiTurnSpec,
    TurnResult,
)
from hicache.integration.models.tiny_model import ensure_tiny_model
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_worker_per_core")]

BLOCK = 16  # vLLM's CPU MLA backend forces it
WORKLOAD = MultiTurnSpec(conversations=2, history_tokens=1024, shared_prefix_tokens=0,
                         question_tokens=48, answer_tokens=16, seed=41)
L1_BLOCKS = 80  # 79 usable (the null block): one conversation at a time (turn 3: 1,168)
TURNS = 3


@pytest.fixture(scope="module")
def mla_model() -> str:
    return str(ensure_tiny_model("mla"))


def _engine(model: str, hicache: dict | None = None):
    return open_llm(EngineSpec(
        model=model, hicache=hicache, prefix_caching=hicache is None, block_size=BLOCK,
        num_blocks=L1_BLOCKS, max_model_len=(L1_BLOCKS - 1) * BLOCK,
        # vLLM prefers its AMX MLA backend where the CPU has AMX tiles, and that
        # backend refuses fp32 weights at load ("expect weight to be bfloat16, ...").
        # The reference CPU MLA backend runs everywhere, as on CI machines without AMX.
        extra_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
                    "attention_backend": "CPU_MLA"}))


def _l3(path: Path, **more) -> dict:
    return {"hicache_size": 0.05, "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(path)}, **more}


@pytest.fixture(scope="module")
def oracle(mla_model) -> list[TurnResult]:
    llm = _engine(mla_model)
    try:
        assert llm.llm_engine.vllm_config.model_config.use_mla
        return run_multi_turn(llm, WORKLOAD, range(TURNS))
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def written(mla_model, oracle, tmp_path_factory) -> tuple[list[TurnResult], Path]:
    path = tmp_path_factory.mktemp("l3-mla")
    llm = _engine(mla_model, _l3(path))
    try:
        return run_multi_turn(llm, WORKLOAD, range(TURNS), oracle), path
    finally:
        close_llm(llm)


def _pages(tokens: int) -> int:
    return (tokens - 1) // BLOCK * BLOCK


def test_mla_l2_hits_token_identical(written, oracle):
    runs, _ = written
    for t in range(TURNS):
        assert runs[t].outputs == oracle[t].outputs, f"turn {t}"
    for t in range(1, TURNS):
        prev = oracle[t - 1]
        want = [_pages(len(p) + len(o)) for p, o in zip(prev.prompts, prev.outputs, strict=True)]
        assert runs[t].num_cached_tokens == want, t


def test_mla_pages_written_once_to_one_shared_shard(written):
    _, path = written
    suffixes = {f.stem.rsplit("_", 1)[-1] for f in (path / "pages").rglob("*.page")}
    assert len(suffixes) == 1, suffixes  # not one shard per rank


def test_restarted_mla_engine_serves_every_rank_from_the_shared_shard(
        mla_model, written, oracle, tmp_path_factory):
    _, src = written
    path = tmp_path_factory.mktemp("l3-mla-restart")
    shutil.copytree(src, path, dirs_exist_ok=True)
    llm = _engine(mla_model, _l3(path, hicache_storage_prefetch_policy="wait_complete"))
    try:
        got = run_multi_turn(llm, WORKLOAD, range(1, 2), oracle)[0]
    finally:
        close_llm(llm)
    assert got.outputs == oracle[1].outputs
    assert got.num_cached_tokens == [_pages(len(p)) for p in oracle[1].prompts]
    assert not list((path / "quarantine").iterdir())
