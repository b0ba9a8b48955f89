"""End to end on the CPU vLLM engine: stores across steps under preemption.

An L1 of 24 blocks and six requests that each grow to 11 blocks: vLLM admits
several, then preempts some of them to let the others decode, and frees the
preempted requests' blocks for reuse in the same step. HiCache's stores of
those blocks may still be queued then; the step waits for them
(``flush_stores``) before vLLM's forward pass writes the blocks again. The
same prompts come back afterwards and are served from L2. fp32: the oracle is
vLLM without a connector, same L1, same prompts.
"""

from __future__ import annotations

import random

import pytest

from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    greedy_params,
    open_llm,
    scheduler_connector,
    worker_connector,
)

pytestmark = pytest.mark.engine

L1_BLOCKS = 24
PROMPTS = 6
PROMPT_TOKENS = 100
ANSWER_TOKENS = 240


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]


def generate(llm, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in batch],
                           greedy_params(ANSWER_TOKENS), use_tqdm=False)
    return ([list(r.outputs[0].token_ids) for r in results],
            [int(r.num_cached_tokens or 0) for r in results])


def spec(tiny_model: str, hicache: dict | None) -> EngineSpec:
    return EngineSpec(model=tiny_model, hicache=hicache, block_size=32, num_blocks=L1_BLOCKS,
                      max_model_len=704, in_process=True, prefix_caching=True)


@pytest.fixture(scope="module")
def oracle(tiny_model):
    llm = open_llm(spec(tiny_model, None))
    try:
        first, _ = generate(llm, prompts())
        # The returning turn: each prompt with its answer and a new question.
        again = [p + a + [7, 8, 9] for p, a in zip(prompts(), first, strict=True)]
        second, _ = generate(llm, again)
        return first, again, second
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def run(tiny_model, oracle):
    llm = open_llm(spec(tiny_model, {"hicache_size": 0.05, "hicache_async_stores": True}))
    try:
        sched = scheduler_connector(llm).hicache_scheduler
        preempted: list[str] = []
        plan = sched.build_connector_meta

        def spy(num_scheduled_tokens, preempted_ids=(), handoffs=None):
            preempted.extend(preempted_ids)
            return plan(num_scheduled_tokens, preempted_ids, handoffs)

        sched.build_connector_meta = spy  # records what vLLM preempted; plans unchanged
        first, _ = generate(llm, prompts())
        llm.reset_prefix_cache()  # L1 forgets: the returning turn must come from L2
        second, cached = generate(llm, oracle[1])
        worker = worker_connector().hicache_worker
        yield {"first": first, "second": second, "cached": cached, "preempted": preempted,
               "worker": worker, "sched": sched}
    finally:
        close_llm(llm)


def test_the_workload_makes_vllm_preempt(run):
    assert run["preempted"], "the workload must make vLLM preempt (L1 of 24 blocks)"


def test_tokens_identical_to_no_connector_under_preemption(run, oracle):
    assert run["first"] == oracle[0]
    assert run["second"] == oracle[2]


def test_returning_prompts_are_served_from_l2(run, oracle):
    for prompt, cached in zip(oracle[1], run["cached"], strict=True):
        # Every full page but the prompt's last token, which vLLM computes.
        assert cached == (len(prompt) - 1) // 32 * 32, (len(prompt), cached)
    worker = run["worker"]
    assert worker.stats.save_errors == 0 and worker.stats.load_errors == 0
    # hicache_async_stores: copies run on the copy thread, not inline (this
    # workload's stores are below the per-layer size: tests/tiers/worker has the
    # per-layer saves).
    assert not worker.copies.pipeline.inline
    # Every store was published and reported; nothing is left in flight.
    assert not worker.stores.pending and not run["sched"].has_pending_stores()
