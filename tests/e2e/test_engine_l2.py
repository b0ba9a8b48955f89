"""End to end on the CPU vLLM engine: returning conversations are served from L2.

Every engine here has an L1 (vLLM KV cache) far too small for the workload,
and the greedy tokens of every turn must equal the no-connector baseline.
"""

from __future__ import annotations

import pytest
from conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_TURNS,
    SMALL_L1_BLOCKS,
    WORKLOAD,
    history_lengths,
    run_workload,
)

from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    open_llm,
    scheduler_connector,
    worker_connector,
)

pytestmark = pytest.mark.engine


def assert_same_tokens(run, baseline):
    for t in range(NUM_TURNS):
        assert run.turns[t].prompts == baseline.turns[t].prompts
        for c, (got, want) in enumerate(
            zip(run.turns[t].outputs, baseline.turns[t].outputs, strict=True)
        ):
            assert got == want, f"turn {t} conversation {c}: {got} != {want}"


class TestL2ServesReturningTurns:
    """Multiprocess engine (as in production), vLLM prefix cache off, so every
    cached token vLLM reports was loaded by HiCache from L2. L2 is sized to hold
    the whole workload (the default hicache_ratio=2 x this tiny L1 would not)."""

    @pytest.fixture(scope="class")
    def run(self, tiny_model, baseline):
        llm = open_llm(EngineSpec(
            model=tiny_model, hicache={"hicache_size": 0.05}, prefix_caching=False, block_size=BLOCK_SIZE,
            num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        ))
        try:
            yield run_workload(llm, prompts_from=baseline.turns)
        finally:
            close_llm(llm)

    def test_tokens_identical_to_no_connector(self, run, baseline):
        assert_same_tokens(run, baseline)

    def test_first_turn_has_nothing_but_the_shared_prompt(self, run):
        # Conversations run one at a time; later ones find the shared system
        # prompt (160 tokens = 5 full pages) in L2.
        cached = run.turns[0].num_cached_tokens
        assert cached[0] == 0
        assert all(c == 160 for c in cached[1:]), cached

    def test_returning_histories_come_from_l2(self, run, baseline):
        for turn in range(1, NUM_TURNS):
            histories = history_lengths(baseline, turn)
            for conv, (cached, history) in enumerate(
                zip(run.turns[turn].num_cached_tokens, histories, strict=True)
            ):
                # Every full page whose KV was computed: all but the last
                # token's, rounded down to pages.
                expected = (history - 1) // BLOCK_SIZE * BLOCK_SIZE
                assert cached == expected, (turn, conv, cached, expected)
                assert cached >= 0.9 * history


class TestEvictionAndFaults:
    """In-process engine (to inspect both halves), vLLM prefix cache on, 2-block
    pages, and an L2 budget smaller than the workload so eviction must happen."""

    L2_BYTES = 12_000_000  # ~91 pages of 64 tokens: about 3 of the 8 histories

    @pytest.fixture(scope="class")
    def engine(self, tiny_model):
        llm = open_llm(EngineSpec(
            model=tiny_model, hicache={"page_size": 2 * BLOCK_SIZE,
                                       "hicache_size": self.L2_BYTES / 1e9},
            prefix_caching=True, block_size=BLOCK_SIZE, num_blocks=SMALL_L1_BLOCKS,
            max_model_len=MAX_MODEL_LEN, in_process=True,
        ))
        try:
            yield llm
        finally:
            close_llm(llm)

    @pytest.fixture(scope="class")
    def run(self, engine, baseline):
        return run_workload(engine, prompts_from=baseline.turns)

    def test_tokens_identical_under_eviction(self, run, baseline):
        assert_same_tokens(run, baseline)

    def test_host_pool_stays_within_budget(self, engine, run):
        sched = scheduler_connector(engine).hicache_scheduler
        worker = worker_connector().hicache_worker
        stats = sched.stats
        assert worker.pool.nbytes <= self.L2_BYTES
        assert sched.slots.capacity == worker.pool.geometry.num_slots
        # The workload is larger than L2: pages were evicted, yet never more
        # slots in use than exist, and the tree and the allocator agree.
        assert stats.evicted_pages > 0
        assert stats.max_used_slots <= sched.slots.capacity
        assert sched.tree.total_pages() == sched.slots.num_used <= sched.slots.capacity
        sched.tree.check_invariants()
        # On a CPU the copies run in vLLM's own thread at the end of each step
        # (kernels/layer_pipeline.py inline mode): none during the forward pass,
        # whose cores they would take. test_engine_async_stores.py has the other mode.
        assert worker.copies.pipeline.inline and worker.stats.layer_saves_in_forward == 0
        assert worker.stats.saved_pages > 0

    def test_recent_histories_still_hit_after_l1_reset(self, engine, run, baseline):
        """The 8 conversations come back in a cycle longer than L2 holds, where LRU
        cannot hit; but the most recent ones are in L2 and must be served from it."""
        from hicache.integration.bench.multi_turn import run_turns

        assert engine.reset_prefix_cache()  # empties vLLM's L1 cache only
        last = baseline.turns[NUM_TURNS - 1]
        recent = [7, 6]  # served last, in this order
        again = run_turns(engine, [last.prompts[c] for c in recent], WORKLOAD.answer_tokens,
                          one_by_one=True)
        assert again.outputs == [last.outputs[c] for c in recent]
        for conv, cached in zip(recent, again.num_cached_tokens, strict=True):
            page = 2 * BLOCK_SIZE
            assert cached == (len(last.prompts[conv]) - 1) // page * page, (conv, cached)
        # The loads were awaited layer by layer (wait_for_layer_load), not up front.
        assert worker_connector().hicache_worker.stats.layer_waits > 0

    def test_lost_l2_pages_are_recomputed_not_loaded(self, engine, run, baseline):
        """Forget what every L2 slot holds (as if their bytes were lost): the next
        returning turn must fail its key checks, recompute, and keep its tokens."""
        sched = scheduler_connector(engine).hicache_scheduler
        worker = worker_connector().hicache_worker
        engine.reset_prefix_cache()  # vLLM's L1 only; HiCache keeps L2
        assert sched.tree.total_pages() > 0
        worker.pool.invalidate_all()
        errors_before = worker.stats.load_errors
        from hicache.integration.bench.multi_turn import run_turns

        last = baseline.turns[NUM_TURNS - 1]
        again = run_turns(engine, last.prompts[6:], WORKLOAD.answer_tokens, one_by_one=True)
        assert again.outputs == last.outputs[6:]
        assert worker.stats.load_errors > errors_before
        # The scheduler dropped the pages it was told were bad.
        assert sched.stats.bad_slots_reported > 0
        sched.tree.check_invariants()
        assert sched.tree.total_pages() == sched.slots.num_used
