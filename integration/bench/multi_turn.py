"""Seeded multi-turn chat workloads in token ids, for engine tests and benchmarks.

A conversation starts with an optional system prompt shared by every
conversation, then its own history; each later turn sends the whole history
(previous prompt + the model's answer) plus a new user message. Working in
token ids keeps prompts exact: nothing depends on tokenizer round trips.

``run_turns`` drives any object with vLLM's ``LLM.generate`` signature and
records, per request, the generated tokens and ``num_cached_tokens``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.integration.vllm.engine import greedy_params


@dataclass(frozen=True)
class MultiTurnSpec:
    """Shape of a multi-turn workload."""

    # Number of independent conversations.
    conversations: int = 8
    # Tokens of each conversation's first-turn prompt (system prompt included).
    history_tokens: int = 1536
    # Tokens of a system prompt shared by all conversations (part of history_tokens).
    shared_prefix_tokens: int = 0
    # Tokens of each new user message on returning turns.
    question_tokens: int = 64
    # Tokens generated per turn (greedy).
    answer_tokens: int = 16
    # Smallest and one-past-largest token id drawn (avoid special tokens).
    token_low: int = 8
    token_high: int = 2000
    seed: int = 0


@dataclass
class TurnResult:
    """Outcome of one turn of every conversation."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    num_cached_tokens: list[int]
    seconds: float
    ttft_seconds: list[float] = field(default_factory=list)
    # Each request's kv_transfer_params as vLLM returned them (HiCache's tier split).
    kv_transfer_params: list[dict[str, Any] | None] = field(default_factory=list)


def first_turn_prompts(spec: MultiTurnSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    draw = lambda n: [rng.randrange(spec.token_low, spec.token_high) for _ in range(n)]  # noqa: E731
    shared = draw(spec.shared_prefix_tokens)
    return [shared + draw(spec.history_tokens - spec.shared_prefix_tokens)
            for _ in range(spec.conversations)]


def next_turn_prompts(
    spec: MultiTurnSpec, previous: TurnResult, turn_index: int
) -> list[list[int]]:
    """History (prompt + answer) of each conversation plus a new user message."""
    rng = random.Random(spec.seed * 1_000_003 + turn_index)
    return [
        prompt + answer + [rng.randrange(spec.token_low, spec.token_high)
                           for _ in range(spec.question_tokens)]
        for prompt, answer in zip(previous.prompts, previous.outputs, strict=True)
    ]


def run_turns(
    llm: Any, prompts: Sequence[Sequence[int]], answer_tokens: int, *, one_by_one: bool = False
) -> TurnResult:
    """Generate greedily for every prompt; ``one_by_one`` sends them sequentially."""
    params = greedy_params(answer_tokens)
    batches = [[p] for p in prompts] if one_by_one else [list(prompts)]
    outputs: list[list[int]] = []
    cached: list[int] = []
    params_out: list[dict[str, Any] | None] = []
    ttfts: list[float] = []
    start = time.perf_counter()
    for batch in batches:
        t0 = time.perf_counter()
        results = llm.generate(
            [{"prompt_token_ids": list(p)} for p in batch], params, use_tqdm=False
        )
        ttfts.append(time.perf_counter() - t0)
        for r in results:
            outputs.append(list(r.outputs[0].token_ids))
            cached.append(int(r.num_cached_tokens or 0))
            params_out.append(getattr(r, "kv_transfer_params", None))
    return TurnResult(
        prompts=[list(p) for p in prompts],
        outputs=outputs,
        num_cached_tokens=cached,
        seconds=time.perf_counter() - start,
        ttft_seconds=ttfts if one_by_one else [],
        kv_transfer_params=params_out,
    )
