"""Tensor parallelism 2 on the CPU engine: every rank applies the same plan to its shard.

Three TP=2 engines (vLLM's CPU workers pinned one per core with
``VLLM_CPU_OMP_THREADS_BIND=0|1``; vLLM's automatic NUMA binding refuses two
workers on one node): vLLM without a connector (the oracle: TP=2 sums
partial products in its own order), HiCache with a small L1 and a file L3
(returning turns from L2, every rank backs its shard up), and a fresh
HiCache engine with an empty L2 that serves the returning turns from both
ranks' L3 shards. The L3 lookup asks every rank's shard, so no rank is
promised pages it lacks: with either rank's shard of a history deleted, the
history is not offered (recomputed), rather than promised and then failed.
Last, the Gemma-3-style hybrid at TP=2 (vLLM's hybrid manager on), against
vLLM without a connector.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, run_multi_turn

from hicache.integration.bench.multi_turn import (
    MultiTurnSpec,
    TurnResult,
    first_turn_prompts,
    next_turn_prompts,
    run_turns,
)
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm
from hicache.tiers.l3.integrity import HEADER_BYTES

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_worker_per_core")]

WORKLOAD = MultiTurnSpec(conversations=4, history_tokens=1536, shared_prefix_tokens=160,
                         question_tokens=64, answer_tokens=16, seed=21)
TURNS = 3


def _engine(model: str, hicache: dict | None = None):
    return open_llm(EngineSpec(
        model=model, hicache=hicache, prefix_caching=hicache is None, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
        extra_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}))


@pytest.fixture(scope="module")
def oracle(tiny_model) -> list[TurnResult]:
    llm = _engine(tiny_model)
    try:
        return run_multi_turn(llm, WORKLOAD, range(TURNS))
    finally:
        close_llm(llm)


def _l3(path: Path, **more) -> dict:
    return {"hicache_size": 0.05, "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(path)}, **more}


@pytest.fixture(scope="module")
def written(tiny_model, oracle, tmp_path_factory) -> tuple[list[TurnResult], Path]:
    path = tmp_path_factory.mktemp("l3-tp2")
    # Stores across steps (off by default on a CPU): each rank reports its own
    # finished stores, and the scheduler waits for both.
    llm = _engine(tiny_model, _l3(path, hicache_async_stores=True))
    try:
        return run_multi_turn(llm, WORKLOAD, range(TURNS), oracle), path
    finally:
        close_llm(llm)


def _history_pages(oracle: list[TurnResult], turn: int) -> list[int]:
    prev = oracle[turn - 1]
    return [(len(p) + len(o) - 1) // BLOCK_SIZE * BLOCK_SIZE
            for p, o in zip(prev.prompts, prev.outputs, strict=True)]


def test_tp2_l2_hits_token_identical(written, oracle):
    runs, _ = written
    for t in range(TURNS):
        assert runs[t].outputs == oracle[t].outputs, f"turn {t}"
    for t in range(1, TURNS):
        # vLLM's prefix cache is off: every cached token was loaded from L2 on both ranks.
        assert runs[t].num_cached_tokens == _history_pages(oracle, t), t


def _page_files(path: Path) -> dict[str, list[Path]]:
    """Stored page files grouped by storage fingerprint (one group per rank)."""
    groups: dict[str, list[Path]] = {}
    for f in (path / "pages").rglob("*.page"):
        groups.setdefault(f.stem.rsplit("_", 1)[-1], []).append(f)
    return groups


def test_both_ranks_backed_up_their_shards(written):
    _, path = written
    groups = _page_files(path)
    assert len(groups) == 2, sorted(groups)
    sizes = {len(v) for v in groups.values()}
    assert len(sizes) == 1  # the same pages on both ranks
    assert all(f.stat().st_size > HEADER_BYTES for v in groups.values() for f in v)


def _only(turn: TurnResult, convs: list[int]) -> list[list[int]]:
    return [turn.prompts[c] for c in convs]


def test_restarted_tp2_engine_serves_from_every_ranks_shard(tiny_model, written, oracle,
                                                             tmp_path_factory):
    """One fresh engine, empty L2: conversations 0-1 come back with L3 intact
    (served from both shards); conversation 2 with one rank's shard of its pages
    gone, conversation 3 with the other's. A lookup that asked one rank only
    would promise one of them its whole history; ours offers neither, and
    every token matches the oracle."""
    _, src = written
    path = tmp_path_factory.mktemp("l3-tp2-restart")
    shutil.copytree(src, path, dirs_exist_ok=True)
    (name_a, files_a), (name_b, files_b) = sorted(_page_files(path).items())
    turn = oracle[1]
    shared = WORKLOAD.shared_prefix_tokens // BLOCK_SIZE * BLOCK_SIZE
    llm = _engine(tiny_model, _l3(path, hicache_storage_prefetch_policy="wait_complete"))
    try:
        intact = run_turns(llm, _only(turn, [0, 1]), WORKLOAD.answer_tokens)
        for f in files_a:
            f.unlink()
        lost_a = run_turns(llm, _only(turn, [2]), WORKLOAD.answer_tokens)
        for f in files_a:
            shutil.copy(src / f.relative_to(path), f)
        for f in files_b:
            f.unlink()
        lost_b = run_turns(llm, _only(turn, [3]), WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    assert intact.outputs == turn.outputs[:2]
    # Engine A served this very turn too: its whole prompt is in L3, to the last page.
    assert intact.num_cached_tokens == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE
                                        for p in turn.prompts[:2]]
    assert lost_a.outputs == turn.outputs[2:3] and lost_b.outputs == turn.outputs[3:]
    # Only the shared system prompt, which the first two left in L2.
    assert lost_a.num_cached_tokens == [shared] == lost_b.num_cached_tokens, (name_a, name_b)


HYBRID = MultiTurnSpec(conversations=2, history_tokens=1536, shared_prefix_tokens=0,
                       question_tokens=64, answer_tokens=16, seed=33)


def _hybrid_turns(hicache: dict | None) -> list[TurnResult]:
    """The Gemma-3-style model (vLLM's hybrid manager: 5 sliding-window groups and
    a full one) at TP=2; with HiCache, vLLM's prefix caching is off, so every
    returning history comes from L2."""
    from hicache.integration.models.tiny_model import ensure_tiny_model

    llm = open_llm(EngineSpec(
        model=str(ensure_tiny_model("gemma3")), hicache=hicache,
        prefix_caching=hicache is None, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        extra_args={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}))
    try:
        out: list[TurnResult] = []
        for i in range(TURNS):
            prompts = (first_turn_prompts(HYBRID) if i == 0
                       else next_turn_prompts(HYBRID, out[-1], i))
            out.append(run_turns(llm, prompts, HYBRID.answer_tokens, one_by_one=True))
        return out
    finally:
        close_llm(llm)


def test_hybrid_model_at_tp2_token_identical():
    want = _hybrid_turns(None)
    got = _hybrid_turns({"hicache_size": 0.05})
    for turn, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.outputs == w.outputs, f"turn {turn}"
    for turn in (1, 2):
        for prompt, cached in zip(got[turn].prompts, got[turn].num_cached_tokens, strict=True):
            history = len(prompt) - HYBRID.question_tokens
            assert cached >= history // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE, (turn, cached)
