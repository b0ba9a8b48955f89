"""A Gemma-3-style model with vLLM's hybrid KV cache manager on, on the CPU engine.

The tiny ``gemma3`` preset has five sliding-window layers (window 384) to one
full-attention layer. With HiCache configured, vLLM keeps its hybrid manager
(HiCache is ``SupportsHMA``): six KV-cache groups, five ``SlidingWindowSpec``
and one ``FullAttentionSpec``. Before, vLLM turned the manager off ("Turning
off hybrid kv cache manager because `--kv-transfer-config` selects a KV
connector that does not support it") and kept full-context KV for every
layer.

Workload: two conversations of 1,536-token histories, window smaller than
the histories. Steps: first turns, two returning turns, then branches that
share only the first 640 tokens of a history (its head: the window at the
branch point lies inside the history). vLLM's own prefix cache (L1) is
emptied before every step, so every hit comes from HiCache.

- write_through with a file L3: returning turns and branches from L2.
- A second engine (a restart) on the same L3 directory, write_back: new
  branches from the histories' heads, then the returning turns, from L3.
- bf16: write_through against the bf16 oracle.

Oracle: vLLM with a connector that never loads (NullConnector, also
``SupportsHMA``, so the oracle runs the same hybrid manager) and an L1 large
enough to keep everything; tokens must be identical.
"""

from __future__ import annotations

import pytest
from conftest import MAX_MODEL_LEN
from support.workloads import turns_then_branches

from hicache.integration.bench.multi_turn import (
    MultiTurnSpec,
    TurnResult,
    run_turns,
)
from hicache.integration.models.tiny_model import ensure_tiny_model
from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    open_llm,
    scheduler_connector,
)
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

pytestmark = pytest.mark.engine

BLOCK = 32
HEAD = 640  # branches share this much of a history, more than the window (384)
WORKLOAD = MultiTurnSpec(conversations=2, history_tokens=1536, shared_prefix_tokens=0,
                         question_tokens=64, answer_tokens=16, seed=33)
ORACLE_L1_BLOCKS = 2000
# vLLM refuses fewer blocks than one max_model_len request needs in every group.
L1_BLOCKS = 400
STEPS = 4  # the HiCache engine's; the oracle also runs step 4, for the restarted engine


def _empty_l1(llm) -> None:
    """Empty vLLM's own prefix cache (write_back may still hold a finished request's
    blocks: one more step releases them)."""
    if not llm.reset_prefix_cache():
        run_turns(llm, [[7, 8, 9]], 1, one_by_one=True)
        assert llm.reset_prefix_cache()


def _run(llm, *, empty_l1: bool, steps: int = STEPS) -> list[TurnResult]:
    out: list[TurnResult] = []
    for step in range(steps):
        if empty_l1:
            _empty_l1(llm)
        # Steps 0-2: the conversations' turns; steps 3, 4: branches sharing HEAD tokens.
        prompts = turns_then_branches(WORKLOAD, out, step, HEAD)
        out.append(run_turns(llm, prompts, WORKLOAD.answer_tokens, one_by_one=True))
    return out


def _groups(llm) -> list[str]:
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    return [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups]


@pytest.fixture(scope="module")
def gemma3() -> str:
    return str(ensure_tiny_model("gemma3"))


def _oracle(model: str, dtype: str) -> list[TurnResult]:
    llm = open_llm(EngineSpec(model=model, block_size=BLOCK, num_blocks=ORACLE_L1_BLOCKS,
                              max_model_len=MAX_MODEL_LEN, kv_transfer=TRANSFER_CONFIG,
                              dtype=dtype, in_process=True))
    try:
        return _run(llm, empty_l1=False, steps=STEPS + 1)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def oracle(gemma3) -> list[TurnResult]:
    return _oracle(gemma3, "float32")


def _hicache(model: str, dtype: str = "float32", **config) -> object:
    return open_llm(EngineSpec(
        model=model, block_size=BLOCK, num_blocks=L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        dtype=dtype, in_process=True, hicache={"hicache_size": 0.05, **config}))


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid-l3")


def _l3(path) -> dict:
    return {"hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(path)},
            "hicache_storage_prefetch_policy": "wait_complete"}


@pytest.fixture(scope="module")
def served(gemma3, l3_dir) -> tuple[list[TurnResult], list[str], dict]:
    """write_through, file L3: the whole workload, L1 emptied before every step."""
    llm = _hicache(gemma3, hicache_write_policy="write_through", **_l3(l3_dir))
    try:
        groups = _groups(llm)
        runs = _run(llm, empty_l1=True)
        sched = scheduler_connector(llm).hicache_scheduler
        sched.tree.check_invariants()
        return runs, groups, sched.stats.as_dict()
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def restarted(gemma3, l3_dir, served, oracle) -> tuple[list[TurnResult], dict]:
    """A new engine on the same L3: new branches first, then the returning turns."""
    llm = _hicache(gemma3, hicache_write_policy="write_back", **_l3(l3_dir))
    try:
        branches = run_turns(llm, oracle[4].prompts, WORKLOAD.answer_tokens, one_by_one=True)
        _empty_l1(llm)
        returning = run_turns(llm, oracle[2].prompts, WORKLOAD.answer_tokens, one_by_one=True)
        return [branches, returning], scheduler_connector(llm).hicache_scheduler.stats.as_dict()
    finally:
        close_llm(llm)


def test_vllm_keeps_its_hybrid_manager(served):
    _, groups, _ = served
    assert groups == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]


def test_tokens_identical_to_the_oracle(served, oracle):
    runs, _, _ = served
    for step, (got, want) in enumerate(zip(runs, oracle[:STEPS], strict=True)):
        assert got.prompts == want.prompts
        assert got.outputs == want.outputs, f"step {step}"


def test_returning_turns_and_head_branches_come_from_l2(served):
    runs, _, stats = served
    for step in (1, 2):
        for prompt, cached in zip(runs[step].prompts, runs[step].num_cached_tokens,
                                  strict=True):
            history = len(prompt) - WORKLOAD.question_tokens
            assert cached >= history // BLOCK * BLOCK - BLOCK, (step, cached, history)
    # The branch point is inside a history: the window there came from L2.
    assert runs[3].num_cached_tokens == [HEAD] * WORKLOAD.conversations
    assert stats["l1_hit_pages"] == 0 and stats["l2_hit_pages"] > 0
    assert stats["stored_partial_pages"] == 0  # write_through stores every group


def test_a_restarted_engine_serves_branches_and_histories_from_l3(restarted, oracle):
    (branches, returning), stats = restarted
    assert branches.outputs == oracle[4].outputs
    assert returning.outputs == oracle[2].outputs
    assert branches.num_cached_tokens == [HEAD] * WORKLOAD.conversations
    for prompt, cached in zip(returning.prompts, returning.num_cached_tokens, strict=True):
        history = len(prompt) - WORKLOAD.question_tokens
        assert cached >= history // BLOCK * BLOCK - BLOCK, (cached, history)
    assert stats["l3_fetched_pages"] > 0 and stats["l3_failed_pages"] == 0


def test_bf16_tokens_identical_to_the_bf16_oracle(gemma3):
    want = _oracle(gemma3, "bfloat16")[:STEPS]
    llm = _hicache(gemma3, "bfloat16", hicache_write_policy="write_through")
    try:
        got = _run(llm, empty_l1=True)
    finally:
        close_llm(llm)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.outputs == w.outputs, f"bf16 step {step}"
    assert got[3].num_cached_tokens == [HEAD] * WORKLOAD.conversations
