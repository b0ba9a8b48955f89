"""L2's KV events on the CPU vLLM engine, read by a real ZMQ subscriber as a router
would: vLLM publishes them (``--kv-events-config``) beside its own. Every page HiCache
stores in host memory is a ``BlockStored`` with medium "CPU" whose block hashes are
the ones vLLM's own (device) events named for the same tokens, so a router can match
them; vLLM's ``reset_prefix_cache(reset_connector=True)`` removes exactly those hashes.
Tokens equal the no-connector baseline."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm

pytestmark = pytest.mark.engine

CONVERSATIONS = 3


def drain(sub: zmq.Socket, until, timeout_ms: int = 60_000) -> list:
    """Events received until ``until(events)`` holds (a bound for a broken test, not
    a speed check: the publisher thread sends them as soon as vLLM hands them over)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list = []
    while not until(events):
        assert sub.poll(timeout_ms), f"no event in {timeout_ms} ms; got {len(events)}"
        _topic, _seq, payload = sub.recv_multipart()
        events.extend(decoder.decode(payload).events)
    return events


def cpu(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind) and e.medium == "CPU"]


@pytest.fixture(scope="module")
def run(tiny_model, baseline, tmp_path_factory):
    # An ipc endpoint: vLLM's publisher binds it (it would connect to a plain tcp
    # host:port), on this machine only; the subscriber connects before any event.
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events')}/events.sock"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    llm = open_llm(EngineSpec(
        model=tiny_model, block_size=BLOCK_SIZE, num_blocks=SMALL_L1_BLOCKS,
        max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_size": 0.05, "hicache_admin_port": 0},
        extra_args={"kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": endpoint, "topic": "kv"}}))
    try:
        prompts = baseline.turns[0].prompts[:CONVERSATIONS]
        got = run_turns(llm, prompts, WORKLOAD.answer_tokens)
        # Every full page of every prompt is stored in L2 (write_through).
        pages = {tuple(p[i : i + BLOCK_SIZE]) for p in prompts
                 for i in range(0, len(p) - BLOCK_SIZE + 1, BLOCK_SIZE)}
        before = drain(sub, lambda ev: {tuple(e.token_ids) for e in cpu(ev, BlockStored)}
                       >= pages)
        assert llm.reset_prefix_cache(reset_connector=True)
        run_turns(llm, prompts[:1], 1)  # a step, whose output carries the removals
        after = drain(sub, lambda ev: cpu(ev, BlockRemoved))
        yield got, prompts, before, after
    finally:
        close_llm(llm)
        sub.close(0)
        ctx.term()


def test_tokens_identical(run, baseline):
    got, _, _, _ = run
    assert got.outputs == baseline.turns[0].outputs[:CONVERSATIONS]


def test_stored_pages_name_vllms_own_block_hashes(run):
    _, prompts, before, _ = run
    stored = cpu(before, BlockStored)
    device = {h: e for e in before if isinstance(e, BlockStored) and e.medium != "CPU"
              for h in e.block_hashes}
    assert stored
    for event in stored:
        assert event.block_size == BLOCK_SIZE and len(event.block_hashes) == 1
        (h,) = event.block_hashes
        # vLLM's own event for these tokens named the same hash.
        assert h in device
        i = device[h].block_hashes.index(h)
        assert device[h].token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] == event.token_ids
    # The shared system prompt's first page was stored once, with no parent.
    first = [e for e in stored if e.parent_block_hash is None]
    assert [e.token_ids for e in first] == [prompts[0][:BLOCK_SIZE]]


def test_reset_removes_exactly_what_was_stored(run):
    _, _, before, after = run
    stream = before + after
    last = max(i for i, e in enumerate(stream)
               if isinstance(e, BlockRemoved) and e.medium == "CPU")
    resident: set = set()
    for event in stream[: last + 1]:  # replayed as a router would
        if isinstance(event, BlockStored) and event.medium == "CPU":
            assert not resident & set(event.block_hashes), "stored twice"
            resident |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium == "CPU":
            assert set(event.block_hashes) <= resident, "removed what was never stored"
            resident -= set(event.block_hashes)
    # The reset's removal named every page L2 still held, and nothing else.
    assert stream[last].block_hashes and resident == set()
