"""HiCache composed inside vLLM's MultiConnector keeps its failure semantics (CPU engine).

Engine A (MultiConnector[NullConnector, HiCache + file L3]) serves the first
turn and stops. Two thirds of its L3 pages are then damaged (bytes flipped,
files truncated). Engine B, a fresh process with the same composition and an
empty L2, serves the returning turn: every request completes, with the
no-connector baseline's tokens, from the pages that survived plus recompute.
vLLM applies the top-level ``kv_load_failure_policy`` to every child, so the
composition sets it; without it the engine refuses to start, naming the key.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD

from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG as NULL
from hicache.tiers.config import HiCacheConfigError

pytestmark = pytest.mark.engine


def composed(path: Path, policy: str | None = "recompute") -> dict:
    hicache = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {
                   "hicache_size": 0.05, "hicache_admin_port": 0,
                   "hicache_storage_backend": "file",
                   "hicache_storage_prefetch_policy": "wait_complete",
                   "hicache_storage_backend_extra_config": {"path": str(path)}}}
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [NULL, hicache]}}
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


def engine(tiny_model: str, path: Path, in_process: bool = False, **kw):
    return open_llm(EngineSpec(model=tiny_model, kv_transfer=composed(path, **kw),
                               prefix_caching=False, block_size=BLOCK_SIZE,
                               num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN,
                               in_process=in_process))


def damage(path: Path) -> int:
    pages = sorted((path / "pages").rglob("*.page"))
    rng = random.Random(5)
    rng.shuffle(pages)
    third = len(pages) // 3
    for f in pages[:third]:
        data = bytearray(f.read_bytes())
        data[rng.randrange(128, len(data))] ^= 0xFF
        f.write_bytes(bytes(data))
    for f in pages[third : 2 * third]:
        f.write_bytes(f.read_bytes()[: rng.randrange(1, f.stat().st_size)])
    return 2 * third


@pytest.fixture(scope="module")
def runs(tiny_model, baseline, tmp_path_factory):
    path = tmp_path_factory.mktemp("l3-multi")
    # Engine A in this process (a third of the start); B in processes of its own.
    llm = engine(tiny_model, path, in_process=True)
    try:
        first = run_turns(llm, baseline.turns[0].prompts, WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    damaged = damage(path)
    llm = engine(tiny_model, path)
    try:
        second = run_turns(llm, baseline.turns[1].prompts, WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    return first, second, damaged, path


def test_composed_engine_serves_identical_tokens(runs, baseline):
    first, second, damaged, _ = runs
    assert damaged > 0
    assert first.outputs == baseline.turns[0].outputs
    assert second.outputs == baseline.turns[1].outputs  # every request completed


def test_damaged_pages_were_read_rejected_and_the_rest_served(runs):
    _, second, _, path = runs
    assert list((path / "quarantine").iterdir()), "no damaged page was read"
    # Empty L2 and no vLLM prefix cache: what is cached came from intact L3 pages.
    assert sum(second.num_cached_tokens) > 0


def test_composition_without_the_top_level_policy_is_refused(tiny_model, tmp_path):
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    try:
        with pytest.raises(HiCacheConfigError, match='"kv_load_failure_policy": "recompute"'):
            open_llm(EngineSpec(model=tiny_model, kv_transfer=composed(tmp_path, policy=None),
                                block_size=BLOCK_SIZE, num_blocks=SMALL_L1_BLOCKS,
                                max_model_len=MAX_MODEL_LEN, in_process=True))
    finally:
        # The in-process worker built its connector before the scheduler refused:
        # drop it, or the next in-process engine of this session would reuse it.
        ensure_kv_transfer_shutdown()
