"""Mamba "align" mode (vLLM's prefix caching on) through vLLM's own KV-cache manager, no engine.

The CPU build of vLLM cannot run a Mamba2 model with prefix caching, so this drives
HiCache's scheduler half with what a GPU engine's scheduler gives it: vLLM's
``KVCacheManager`` (its ``MambaManager`` in "align" mode over a real ``BlockPool``)
allocates the blocks, caches them and hands the boundary states off in its scheduler
output; ``HiCacheConnector.build_connector_meta`` (the scheduler half, built here
around the scheduler without an engine) plans from that output. Checked:
- a store takes, for the page a step ends on, the state block vLLM handed off (not a
  column of the block table), and pages without a hand-off go without a checkpoint;
- a returning request's hit ends on a checkpointed page, and its load writes that
  checkpoint into the one real state block vLLM gave the hit: the column its model
  runner reads a new request's initial state from (``(num_computed_tokens - 1) //
  block_size``, vllm/v1/worker/mamba_utils.py ``preprocess_mamba``);
Token identity with such a model needs the GPU (docs/gpu.md, issue 31 item 3).
"""

from __future__ import annotations

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

from hicache.connector.connector import HiCacheConnector
from hicache.connector.vllm_shape import kv_groups
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.index.plans import NULL_BLOCK_ID
from hicache.tiers.l2.geometry import PoolGeometry

BS = 4  # tokens per vLLM block (attention and Mamba: align mode makes them equal)
PAGE = 8  # tokens per HiCache page: two blocks
MAMBA, ATTN = 0, 1  # vLLM's group ids


@pytest.fixture
def engine() -> tuple[KVCacheManager, HiCacheConnector]:
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float32)
    mamba = MambaSpec(block_size=BS, shapes=((4, 16), (2, 8, 8)),
                      dtypes=(torch.float32, torch.float32), mamba_cache_mode="align",
                      page_size_padded=attn.page_size_bytes)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.mixer"], mamba),
        KVCacheGroupSpec(["model.layers.1.self_attn"], attn)])
    init_none_hash(sha256)
    manager = KVCacheManager(config, max_model_len=256, scheduler_block_size=BS,
                             hash_block_size=BS, enable_caching=True)
    groups = kv_groups(config)
    assert groups.aligned
    connector = object.__new__(HiCacheConnector)  # its scheduler half, no engine config
    connector._scheduler = HiCacheScheduler(
        geometry=PoolGeometry(num_slots=32, num_layers=2, blocks_per_page=PAGE // BS,
                              block_bytes=attn.page_size_bytes),
        namespace=KeyNamespace("m", "f32", "cpu", PAGE, 1), page_size=PAGE, block_size=BS,
        block_ids_of=manager.get_block_ids, groups=groups)
    connector._admin = None
    return manager, connector


def vllm_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=8),
                   pooling_params=None, block_hasher=get_request_block_hasher(BS, sha256))


def scheduler_output(manager: KVCacheManager, scheduled: dict[str, int]) -> SchedulerOutput:
    """The parts of vLLM's scheduler output the connector reads, the hand-off drained
    from the manager as vLLM's scheduler does."""
    output = SchedulerOutput.make_empty()
    output.num_scheduled_tokens = scheduled
    output.total_num_scheduled_tokens = sum(scheduled.values())
    output.kv_connector_block_state = KVConnectorBlockState(
        req_ids=set(scheduled), resolve_block_ids=manager.get_block_ids,
        boundary_state_offloads=manager.take_boundary_state_offloads())
    return output


def step(manager: KVCacheManager, connector: HiCacheConnector, req: Request, n: int):
    """One engine step computing ``n`` tokens of ``req``: vLLM allocates (and caches
    the blocks the step fills), HiCache plans; the plan and vLLM's hand-off."""
    first = req.num_computed_tokens == 0
    if first:
        blocks, local, _ = manager.get_computed_blocks(req)
        assert local == 0
    assert manager.allocate_slots(req, n, new_computed_blocks=blocks if first else None)
    output = scheduler_output(manager, {req.request_id: n})
    plan = connector.build_connector_meta(output)
    req.num_computed_tokens += n
    manager.new_step_starts()
    assert output.kv_connector_block_state is not None
    return plan, output.kv_connector_block_state.boundary_state_offloads.get(req.request_id, [])


def test_stores_take_vllms_handed_off_states_and_a_return_loads_where_vllm_reads(engine):
    manager, connector = engine
    scheduler = connector.hicache_scheduler
    prompt = list(range(100, 121))  # 21 tokens
    req = vllm_request("a", prompt)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, (), 0)
    # A chunked prefill: 8 tokens (page 0's end), then the other 13.
    plan, handoff = step(manager, connector, req, 8)
    ((group, block, boundary),) = handoff
    assert (group, boundary) == (MAMBA, 8)
    # The state after 8 tokens sits in the block vLLM handed off, page 0's last offset.
    attn = manager.get_block_ids("a")[ATTN]
    assert [p.block_ids for p in plan.stores] == [(NULL_BLOCK_ID, block, *attn[:2])]
    assert scheduler.l2.missing_of(plan.stores[0].slot) == 0
    plan, handoff = step(manager, connector, req, 13)
    assert handoff == []  # 21 ends no block: nothing handed off
    (page_1,) = plan.stores  # tokens 8-15: no step ended there, no checkpoint
    assert page_1.block_ids[:2] == (NULL_BLOCK_ID, NULL_BLOCK_ID)
    assert scheduler.l2.missing_of(page_1.slot) == 0b01
    # Decode to 24 tokens: the step that ends on page 2's end hands its state off.
    for token in (7, 8, 9):
        req.append_output_token_ids(token)
        plan, handoff = step(manager, connector, req, 1)
    ((group, page_2_state, boundary),) = handoff
    assert (group, boundary) == (MAMBA, 24)
    (page_2,) = plan.stores
    assert page_2.block_ids[:2] == (NULL_BLOCK_ID, page_2_state)
    assert scheduler.l2.missing_of(page_2.slot) == 0
    manager.free(req)

    # A new conversation over the same 24 tokens returns: vLLM's own cache was
    # emptied (another tenant took the blocks), HiCache serves the hit from L2.
    assert manager.reset_prefix_cache()
    back = vllm_request("b", prompt + [7, 8, 9] + [1, 2, 3, 4, 5])
    blocks, local, _ = manager.get_computed_blocks(back)
    assert local == 0
    hit, is_async = scheduler.get_num_new_matched_tokens(back, local)
    assert (hit, is_async) == (3 * PAGE, True)  # up to page 2's checkpoint
    # vLLM allocates for the external hit as its scheduler does for an async load.
    assert manager.allocate_slots(back, 0, new_computed_blocks=blocks,
                                  num_external_computed_tokens=hit, delay_cache_blocks=True)
    tables = manager.get_blocks("b").get_block_ids()
    scheduler.update_state_after_alloc(back, tables, hit)
    (fetch,) = connector.build_connector_meta(scheduler_output(manager, {})).fetches
    # The model runner reads b's initial state from column (24 - 1) // 4 = 5, the
    # only real block vLLM gave the Mamba group; the checkpoint goes there.
    read_from = tables[MAMBA][(hit - 1) // BS]
    assert read_from != NULL_BLOCK_ID
    assert [b for b in tables[MAMBA] if b != NULL_BLOCK_ID] == [read_from]
    assert [p.block_ids for p in fetch.l2_pages] == [
        (NULL_BLOCK_ID, NULL_BLOCK_ID, *tables[ATTN][0:2]),
        (NULL_BLOCK_ID, NULL_BLOCK_ID, *tables[ATTN][2:4]),
        (NULL_BLOCK_ID, read_from, *tables[ATTN][4:6])]
    # The slots hold a's pages: the last one with a's state after 24 tokens.
    assert [p.slot for p in fetch.l2_pages][-1] == page_2.slot
