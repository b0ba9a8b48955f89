"""A sliding-window model (tiny Mistral, every layer sees the last 384 tokens) on the CPU engine.

vLLM gives it one KV-cache group of ``SlidingWindowSpec`` and puts its shared
null block (block 0) wherever the window no longer reaches. Before the fix,
``write_back`` stored pages when a request finished, by which time their
blocks had become the null block: L2 then held the null block's bytes under
real page keys, and later requests that shared a history's head were served
them (6 of 6 wrong). Now the null block is never read or written; a page
that lost its window is stored without it and only serves as an inner page
of a hit whose window is complete (tiers/index/kv_groups.py).

Every write policy runs the same workload: returning turns, and branches
that share only the first 640 tokens of a history. Tokens must equal vLLM
without a connector (float32). L1 is small, so returning turns need L2.
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

pytestmark = pytest.mark.engine

BLOCK = 32
WINDOW = 384
HEAD = 640  # branches share this much of a history, more than the window
WORKLOAD = MultiTurnSpec(conversations=2, history_tokens=1536, shared_prefix_tokens=0,
                         question_tokens=64, answer_tokens=16, seed=33)
L1_BLOCKS = 72  # one conversation at a time
POLICIES = ("write_through", "write_through_selective", "write_back")


@pytest.fixture(scope="module")
def swa_model() -> str:
    return str(ensure_tiny_model("swa"))


def _run(llm) -> list[TurnResult]:
    """Steps 0-2: the conversations' turns; step 3: branches sharing HEAD tokens."""
    out: list[TurnResult] = []
    for step in range(4):
        prompts = turns_then_branches(WORKLOAD, out, step, HEAD)
        out.append(run_turns(llm, prompts, WORKLOAD.answer_tokens, one_by_one=True))
    return out


@pytest.fixture(scope="module")
def oracle(swa_model) -> list[TurnResult]:
    llm = open_llm(EngineSpec(model=swa_model, block_size=BLOCK, num_blocks=L1_BLOCKS,
                              max_model_len=MAX_MODEL_LEN, in_process=True))
    try:
        kv_spec = llm.llm_engine.vllm_config.model_config.hf_config.sliding_window
        assert kv_spec == WINDOW
        return _run(llm)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module", params=POLICIES)
def served(request, swa_model) -> tuple[str, list[TurnResult], dict]:
    llm = open_llm(EngineSpec(
        model=swa_model, block_size=BLOCK, num_blocks=L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        hicache={"hicache_size": 0.05, "hicache_write_policy": request.param},
        in_process=True))
    try:
        runs = _run(llm)
        sched = scheduler_connector(llm).hicache_scheduler
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        facts = {"spec": type(groups[0].kv_cache_spec).__name__, "groups": len(groups),
                 "stats": sched.stats.as_dict()}
        sched.tree.check_invariants()
        return request.param, runs, facts
    finally:
        close_llm(llm)


def test_one_sliding_window_group(served):
    _, _, facts = served
    assert (facts["groups"], facts["spec"]) == (1, "SlidingWindowSpec")


def test_tokens_identical_to_vllm_for_every_policy(served, oracle):
    policy, runs, _ = served
    for step, (got, want) in enumerate(zip(runs, oracle, strict=True)):
        assert got.prompts == want.prompts
        for c, (a, b) in enumerate(zip(got.outputs, want.outputs, strict=True)):
            assert a == b, f"{policy}: step {step} conversation {c}: {a} != {b}"


def test_write_through_serves_returning_turns_and_branches_from_l2(served, oracle):
    policy, runs, facts = served
    if policy == "write_back":
        # By the time a request finishes, the window has dropped all but its
        # last pages: the others are stored without the window (never the null
        # block's bytes), so the history returns whole but a branch cannot end
        # inside it.
        assert facts["stats"]["stored_partial_pages"] > 0
        for step in (1, 2):
            for prompt, cached in zip(runs[step].prompts, runs[step].num_cached_tokens,
                                      strict=True):
                assert cached >= 0.9 * (len(prompt) - WORKLOAD.question_tokens), (policy, step)
        return
    if policy == "write_through_selective":
        # A page enters L2 when its second request reaches it; when that request
        # got the page from vLLM's own prefix cache, the window has already put
        # the null block there, so how much is cached depends on what L1 kept.
        # Only the tokens are checked (above).
        return
    for step in (1, 2):
        for prompt, cached in zip(runs[step].prompts, runs[step].num_cached_tokens,
                                  strict=True):
            assert cached >= 0.9 * (len(prompt) - WORKLOAD.question_tokens), (policy, step)
    assert runs[3].num_cached_tokens == [HEAD] * WORKLOAD.conversations, policy
    assert facts["stats"]["l2_hit_pages"] > 0
