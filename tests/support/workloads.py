"""Prompt sequences shared by the engine tests of windowed models.

``turns_then_branches``: a multi-turn workload's first three turns, then
branches that share only the head of each conversation's first prompt (the
branch point lies inside a history, so a sliding window there must come from
the cache, not from the history's end).
"""

from __future__ import annotations

import random

from hicache.integration.bench.multi_turn import (
    MultiTurnSpec,
    TurnResult,
    first_turn_prompts,
    next_turn_prompts,
)

BRANCH_TOKENS = 200  # fresh tokens after a branch's shared head


def turns_then_branches(workload: MultiTurnSpec, previous: list[TurnResult], step: int,
                        head: int) -> list[list[int]]:
    """Steps 0-2: the conversations' turns; from step 3: branches sharing the first
    ``head`` tokens of each first-turn prompt (fresh tokens seeded by the step)."""
    if step == 0:
        return first_turn_prompts(workload)
    if step < 3:
        return next_turn_prompts(workload, previous[-1], step)
    rng = random.Random(step + 2)
    return [p[:head] + [rng.randrange(8, 2000) for _ in range(BRANCH_TOKENS)]
            for p in previous[0].prompts]
