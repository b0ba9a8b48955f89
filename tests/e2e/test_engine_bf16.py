"""bf16 end to end (what users run), and prompts given as embeddings.

The oracle is vLLM with a connector that never loads (NullConnector) and an
L1 large enough to keep every conversation: vLLM's CPU path computes
differently in bf16 once any connector is configured, and its own prefix
cache reuses the same decode-computed KV bytes that HiCache serves from L2.
Both engines get the same requests one at a time, so batches are identical.
HiCache runs with a small L1, so returning histories come from L2.

Prompt embeddings: three prompts of equal length given as embeddings of
different tokens. Page keys used to hash the (placeholder) token ids only,
so the second and third were served the first one's KV; now keys derive
from vLLM's block hashes, which cover the embeddings.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, NUM_TURNS, SMALL_L1_BLOCKS
from conftest import WORKLOAD as FP32_WORKLOAD
from safetensors import safe_open

from hicache.integration.bench.multi_turn import first_turn_prompts, next_turn_prompts, run_turns
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG

pytestmark = pytest.mark.engine

EMBED_PROMPT_TOKENS = 1536
# The fp32 workload's shape, fewer conversations (suite time).
WORKLOAD = dataclasses.replace(FP32_WORKLOAD, conversations=4)


def _spec(model: str, **kw) -> EngineSpec:
    # In-process (a third of a separate engine process's start), oracle and subject alike.
    return EngineSpec(model=model, dtype="bfloat16", block_size=BLOCK_SIZE,
                      max_model_len=MAX_MODEL_LEN, extra_args={"enable_prompt_embeds": True},
                      in_process=True, **kw)


def _serve(llm, embeds: list[torch.Tensor]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Multi-turn workload one request at a time, then the embedding prompts."""
    from vllm import SamplingParams

    turns = []
    for i in range(NUM_TURNS):
        prompts = first_turn_prompts(WORKLOAD) if i == 0 else next_turn_prompts(
            WORKLOAD, turns[-1], i)
        turns.append(run_turns(llm, prompts, WORKLOAD.answer_tokens, one_by_one=True))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs, cached = [], []
    for e in embeds:
        (r,) = llm.generate([{"prompt_embeds": e}], params, use_tqdm=False)
        outs.append(list(r.outputs[0].token_ids))
        cached.append(int(r.num_cached_tokens or 0))
    return [o for t in turns for o in t.outputs], outs, [
        c for t in turns for c in t.num_cached_tokens] + cached


@pytest.fixture(scope="module")
def embeds(tiny_model) -> list[torch.Tensor]:
    """Embeddings of three different 1,536-token prompts, then the first one again."""
    with safe_open(f"{tiny_model}/model.safetensors", "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    rng = random.Random(11)
    prompts = [[rng.randrange(100, table.shape[0]) for _ in range(EMBED_PROMPT_TOKENS)]
               for _ in range(3)]
    return [table[torch.tensor(p)].clone() for p in prompts + prompts[:1]]


@pytest.fixture(scope="module")
def oracle(tiny_model, embeds):
    llm = open_llm(_spec(tiny_model, kv_transfer=TRANSFER_CONFIG))
    try:
        return _serve(llm, embeds)
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def hicache(tiny_model, embeds):
    llm = open_llm(_spec(tiny_model, num_blocks=SMALL_L1_BLOCKS, hicache={"hicache_size": 0.05}))
    try:
        return _serve(llm, embeds)
    finally:
        close_llm(llm)


def test_bf16_multi_turn_tokens_identical_to_oracle(oracle, hicache):
    assert len(hicache[0]) == NUM_TURNS * WORKLOAD.conversations
    for i, (got, want) in enumerate(zip(hicache[0], oracle[0], strict=True)):
        assert got == want, f"turn {i // WORKLOAD.conversations} conversation " \
                            f"{i % WORKLOAD.conversations}: {got} != {want}"


def test_bf16_returning_histories_served_like_the_oracles_l1(oracle, hicache):
    # The oracle keeps every history in L1; HiCache (L1 of 72 blocks) serves
    # them from L2 instead, to the same page boundary.
    n = WORKLOAD.conversations
    returning = slice(n, NUM_TURNS * n)
    assert hicache[2][returning] == oracle[2][returning]
    assert min(hicache[2][returning]) >= 0.9 * WORKLOAD.history_tokens


def test_embedding_prompts_never_share_pages(oracle, hicache):
    first = len(hicache[2]) - 4
    cached = hicache[2][first:]
    # Different embeddings of equal length: nothing cached beyond... nothing.
    assert cached[1] == 0 and cached[2] == 0, cached
    # The first prompt again: served from L1/L2 up to its last full block.
    assert cached[3] == (EMBED_PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE, cached
    assert cached == oracle[2][first:]
    assert hicache[1] == oracle[1]
