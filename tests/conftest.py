"""Shared fixtures: the tiny model and the no-connector baseline of the multi-turn workload.

Engines are expensive (10-45 s to start), so every engine fixture is module-
or session-scoped, and the baseline workload runs once per session.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from hicache.integration.bench.multi_turn import (
    MultiTurnSpec,
    TurnResult,
    first_turn_prompts,
    next_turn_prompts,
    run_turns,
)
from hicache.integration.bench.systems import rpc_dir
from hicache.integration.models.tiny_model import ensure_tiny_model
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm

# 8 conversations x >= 1,500-token histories, a 160-token system prompt shared
# by all (not page-aligned, so vLLM's own prefix hits end mid-page), 3 turns.
WORKLOAD = MultiTurnSpec(
    conversations=8,
    history_tokens=1536,
    shared_prefix_tokens=160,
    question_tokens=64,
    answer_tokens=16,
    seed=7,
)
NUM_TURNS = 3
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
# L1 holds one conversation at a time (72 blocks x 32 tokens = 2,304 tokens):
# far too small to keep 8 histories, so returning turns miss in vLLM's cache.
SMALL_L1_BLOCKS = 72


@dataclass
class WorkloadRun:
    turns: list[TurnResult]


def run_workload(llm, prompts_from: list[TurnResult] | None = None) -> WorkloadRun:
    """Run every turn; with ``prompts_from``, reuse that run's prompts (same inputs)."""
    turns: list[TurnResult] = []
    for i in range(NUM_TURNS):
        if prompts_from is not None:
            prompts = prompts_from[i].prompts
        elif i == 0:
            prompts = first_turn_prompts(WORKLOAD)
        else:
            prompts = next_turn_prompts(WORKLOAD, turns[-1], i)
        turns.append(run_turns(llm, prompts, WORKLOAD.answer_tokens))
    return WorkloadRun(turns)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(ensure_tiny_model("test"))


@pytest.fixture(scope="session")
def baseline(tiny_model) -> WorkloadRun:
    """The workload on vLLM without any connector (prefix caching on, small L1)."""
    llm = open_llm(
        EngineSpec(model=tiny_model, block_size=BLOCK_SIZE, num_blocks=SMALL_L1_BLOCKS,
                   max_model_len=MAX_MODEL_LEN, in_process=True)
    )
    try:
        return run_workload(llm)
    finally:
        close_llm(llm)


def history_lengths(run: WorkloadRun, turn: int) -> list[int]:
    """Tokens of each conversation's history when it returns for ``turn``."""
    prev = run.turns[turn - 1]
    return [len(p) + len(o) for p, o in zip(prev.prompts, prev.outputs, strict=True)]


def run_multi_turn(llm, spec: MultiTurnSpec, turns: range,
                   prompts_from: list[TurnResult] | None = None) -> list[TurnResult]:
    """Turns ``turns`` of ``spec``'s workload; with ``prompts_from``, that run's prompts."""
    out: list[TurnResult] = []
    for i in turns:
        if prompts_from is not None:
            prompts = prompts_from[i].prompts
        else:
            prompts = first_turn_prompts(spec) if i == 0 else next_turn_prompts(spec, out[-1], i)
        out.append(run_turns(llm, prompts, spec.answer_tokens))
    return out


@pytest.fixture(scope="module")
def one_worker_per_core():
    """TP=2 on the CPU engine: one worker per core (vLLM's automatic NUMA binding
    refuses two workers on one node of this 2-core machine)."""
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if saved is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


def pytest_configure(config) -> None:
    """vLLM's ZMQ IPC sockets (about eight per multi-process engine, left behind when it
    stops) go into the benchmark servers' folder of this process (``rpc_dir``, removed
    at exit), not into the temp folder."""
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir())


def pytest_terminal_summary(terminalreporter) -> None:
    """How many vLLM engines this run started: the suite's main cost."""
    from hicache.integration.vllm.engine import ENGINE_STARTS

    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(ENGINE_STARTS.items()))
    terminalreporter.write_line(
        f"vLLM engine starts: {sum(ENGINE_STARTS.values())}" + (f" ({kinds})" if kinds else ""))
