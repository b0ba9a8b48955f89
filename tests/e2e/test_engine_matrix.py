"""Every L2 layout and every write policy on the CPU vLLM engine: greedy tokens
equal the no-connector baseline, and each policy serves from L2 what it should.

One engine per layout, each with a different write policy: the layout decides
only how the worker copies bytes, the policy only what the scheduler stores,
so the two do not interact and every layout x policy product would start nine
engines to test the same code paths. What each policy serves is checked for
all of them, engine-free, in tests/tiers/controller/test_policy_semantics.py.
4 of the baseline's 8 conversations, all turns, vLLM's prefix cache off so
every cached token vLLM reports was loaded from L2.
"""

from __future__ import annotations

from typing import get_args

import pytest
from conftest import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_TURNS,
    SMALL_L1_BLOCKS,
    WORKLOAD,
    history_lengths,
)

from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm
from hicache.tiers.controller.policies import WRITE_POLICY_NAMES
from hicache.tiers.l2.geometry import MemLayoutName

pytestmark = pytest.mark.engine

# (layout, write policy): each layout once, each policy once.
PAIRS = [
    ("layer_first", "write_through_selective"),
    ("page_first", "write_back"),
    ("page_first_direct", "write_through"),
]
CONVERSATIONS = 4
SHARED_PAGES_TOKENS = WORKLOAD.shared_prefix_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_every_layout_and_every_policy_is_in_a_pair():
    assert {layout for layout, _ in PAIRS} == set(get_args(MemLayoutName))
    assert {policy for _, policy in PAIRS} == set(WRITE_POLICY_NAMES)


@pytest.mark.parametrize(("layout", "policy"), PAIRS)
def test_layout_and_policy_keep_tokens_and_hit(tiny_model, baseline, layout, policy):
    llm = open_llm(EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        hicache={"hicache_size": 0.05, "hicache_mem_layout": layout,
                 "hicache_write_policy": policy},
        in_process=True,
    ))
    try:
        cached = []
        for turn in range(NUM_TURNS):
            want = baseline.turns[turn]
            got = run_turns(llm, want.prompts[:CONVERSATIONS], WORKLOAD.answer_tokens)
            assert got.outputs == want.outputs[:CONVERSATIONS], f"turn {turn}"
            cached.append(got.num_cached_tokens)
    finally:
        close_llm(llm)
    # Full pages of each conversation's turn-1 history (prompt + answer) with KV.
    history_pages = [(h - 1) // BLOCK_SIZE * BLOCK_SIZE
                     for h in history_lengths(baseline, 1)[:CONVERSATIONS]]
    if policy == "write_through_selective":
        # Turn 1 computes each history once (< 2 hits): only the shared system
        # prompt, computed by every conversation, is kept. Turn 2 computes the
        # turn-1 history a 2nd time and keeps it, so turn 3 finds exactly that.
        assert cached[1] == [SHARED_PAGES_TOKENS] * CONVERSATIONS, cached[1]
        assert cached[2] == history_pages, cached[2]
    else:
        # Both copy every computed page (write_back when each request ends).
        assert cached[1] == history_pages, cached[1]
