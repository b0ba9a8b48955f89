"""What each write policy serves on a multi-turn workload, engine-free.

The real scheduler (through the simulator, which moves no bytes) replays
conversations that share a system prompt, one request at a time, with an L1
too small to keep any conversation between its turns. Every write policy is
checked here; the engine matrix (tests/e2e/test_engine_matrix.py) runs
each policy once on a real engine, paired with one L2 layout, because the
policy decides on the scheduler side and the layout only on the worker side.

Expected page counts are derived from the request shapes (page = 32 tokens).
"""

from __future__ import annotations

import random

import pytest

from hicache.integration.bench.sim_engine import SimConfig, SimEngine, SimResult
from hicache.integration.bench.trace import TraceRecord
from hicache.tiers.controller.policies import WRITE_POLICY_NAMES

BS = 32
CONVERSATIONS = 4
TURNS = 3
SHARED = 100  # system prompt tokens: 3 full pages every conversation computes
OWN, ANSWER, QUESTION = 500, 20, 40


def workload() -> list[TraceRecord]:
    """Conversation c's turn t arrives at t * CONVERSATIONS + c: one request at a time."""
    rng = random.Random(7)
    shared = [rng.randrange(8, 2000) for _ in range(SHARED)]
    recs = []
    for c in range(CONVERSATIONS):
        prompt = shared + [rng.randrange(8, 2000) for _ in range(OWN)]
        for t in range(TURNS):
            answer = [rng.randrange(8, 2000) for _ in range(ANSWER)]
            at = float(t * CONVERSATIONS + c)
            recs.append(TraceRecord(id=f"c{c}-t{t}", arrival=at, finish=at + 0.5,
                                    output_tokens=ANSWER, prompt=tuple(prompt),
                                    prompt_tokens=len(prompt), output=tuple(answer)))
            prompt = prompt + answer + [rng.randrange(8, 2000) for _ in range(QUESTION)]
    return sorted(recs, key=lambda r: r.arrival)


def run(policy: str) -> tuple[list[TraceRecord], SimResult]:
    recs = workload()
    # 30 blocks hold one request; three others pass between a conversation's turns.
    return recs, SimEngine(SimConfig(l1_blocks=30, l2_pages=1000, write_policy=policy)).run(recs)


def history_pages(recs: list[TraceRecord], turn: int) -> list[int]:
    """Full pages with KV of each conversation's history after ``turn`` (its
    prompt and answer, the last answer token never having been fed back)."""
    return [(r.prompt_tokens + r.output_tokens - 1) // BS
            for r in recs if r.id.endswith(f"-t{turn}")]


def cached_by_turn(res: SimResult, turn: int) -> list[int]:
    return [o.cached_pages for o in res.outcomes if o.id.endswith(f"-t{turn}")]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_copy_every_computed_page_serves_the_whole_history(policy):
    recs, res = run(policy)
    for turn in range(1, TURNS):
        assert cached_by_turn(res, turn) == history_pages(recs, turn - 1), turn
    # L1 could not keep a conversation between turns: what came back came from L2.
    assert sum(o.l2_pages for o in res.outcomes) > sum(o.l1_pages for o in res.outcomes)


def test_selective_keeps_a_page_once_it_was_computed_twice():
    recs, res = run("write_through_selective")
    # Turn 1: each history was computed once; only the shared system prompt,
    # computed by every conversation, was kept.
    assert cached_by_turn(res, 1) == [SHARED // BS] * CONVERSATIONS
    # Turn 1 computed the turn-0 history a second time and kept it; its own
    # answer and question were computed once, so turn 2 finds exactly that.
    assert cached_by_turn(res, 2) == history_pages(recs, 0)


def test_every_write_policy_is_covered_here():
    assert set(WRITE_POLICY_NAMES) == {"write_through", "write_through_selective", "write_back"}
