"""L2's and L3's KV events on the CPU vLLM engine, read by a real ZMQ subscriber as a
router would: vLLM publishes them (``--kv-events-config``) beside its own. Every page
HiCache stores in host memory is a ``BlockStored`` with medium "CPU" whose block
hashes are the ones vLLM's own (device) events named for the same tokens, so a router
can match them; vLLM's ``reset_prefix_cache(reset_connector=True)`` removes exactly
those hashes. Every page backed up to L3 (a file store) is a ``BlockStored`` with
medium "STORAGE". A conversation flushed from L2 stays in the HiRadixTree as
L3-only pages, so flushing it from L3 by prefix deletes every one of its pages from
the store, and exactly those are removed from "STORAGE". Tokens equal the
no-connector baseline."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    open_llm,
    scheduler_connector,
)

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


def storage(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind) and e.medium == "STORAGE"]


def drain_stepping(llm, sub: zmq.Socket, until, max_steps: int = 300) -> list:
    """Events until ``until(events)``, running a one-token request between polls:
    the workers report finished L3 backups with an engine step."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list = []
    for _ in range(max_steps):
        while sub.poll(0):
            _topic, _seq, payload = sub.recv_multipart()
            events.extend(decoder.decode(payload).events)
        if until(events):
            return events
        run_turns(llm, [[11, 12, 13]], 1)  # shorter than a page: stores nothing
    raise AssertionError(f"condition not met after {max_steps} engine steps")


def page_prefixes(events: list) -> dict[bytes, tuple[int, ...]]:
    """Each stored hash's whole token prefix, following parents (one block each)."""
    parent = {e.block_hashes[0]: (e.parent_block_hash, tuple(e.token_ids)) for e in events}
    out: dict[bytes, tuple[int, ...]] = {}
    for h in parent:
        tokens: tuple[int, ...] = ()
        at: bytes | None = h
        while at is not None and at in parent:
            up, mine = parent[at]
            tokens, at = mine + tokens, up
        if at is None:  # the chain reached the first page
            out[h] = tokens
    return out


@pytest.fixture(scope="module")
def run(tiny_model, baseline, tmp_path_factory):
    # An ipc endpoint: vLLM's publisher binds it (it would connect to a plain tcp
    # host:port), on this machine only; the subscriber connects before any event.
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events')}/events.sock"
    l3_dir = tmp_path_factory.mktemp("events-l3")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    llm = open_llm(EngineSpec(
        model=tiny_model, block_size=BLOCK_SIZE, num_blocks=SMALL_L1_BLOCKS,
        max_model_len=MAX_MODEL_LEN, in_process=True,
        hicache={"hicache_size": 0.05, "hicache_admin_port": 0,
                 "hicache_storage_backend": "file",
                 # One object per page: the flush below counts files as pages.
                 "hicache_storage_backend_extra_config": {"path": str(l3_dir),
                                                          "object_mib": 0}},
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
        # Every page reaches L3 (write_through backs each stored page up).
        before += drain_stepping(llm, sub, lambda ev: {
            tuple(e.token_ids) for e in storage(before + ev, BlockStored)} >= pages)
        flushed = flush_one_conversation(llm, sub, prompts[1], l3_dir)
        assert llm.reset_prefix_cache(reset_connector=True)
        run_turns(llm, prompts[:1], 1)  # a step, whose output carries the removals
        after = drain(sub, lambda ev: cpu(ev, BlockRemoved))
        yield got, prompts, before + flushed["events"], after, flushed
    finally:
        close_llm(llm)
        sub.close(0)
        ctx.term()


def flush_one_conversation(llm, sub, prompt: list[int], l3_dir) -> dict:
    """Flush conversation 1 from L2, then from L3 by the prefix that ends on its first
    page of its own: its pages are L3-only in the tree by then."""
    admin = scheduler_connector(llm)._admin
    tree = admin.scheduler.tree
    shared = WORKLOAD.shared_prefix_tokens // BLOCK_SIZE
    prefix = prompt[: (shared + 1) * BLOCK_SIZE]
    files = sum(1 for _ in l3_dir.rglob("*.page"))
    l2 = admin.flush(["l2"], prefix, None)
    l3_only = tree.l3_only_pages()
    l3 = admin.flush(["l3"], prefix, None)
    # The workers delete their shard (again) at the next step; the removals ride on it.
    events = drain_stepping(llm, sub, lambda ev: storage(ev, BlockRemoved))
    return {"l2": l2, "l3": l3, "l3_only": l3_only, "prefix": tuple(prefix),
            "files_deleted": files - sum(1 for _ in l3_dir.rglob("*.page")),
            "events": events}


def test_tokens_identical(run, baseline):
    got, _, _, _, _ = run
    assert got.outputs == baseline.turns[0].outputs[:CONVERSATIONS]


def test_stored_pages_name_vllms_own_block_hashes(run):
    _, prompts, before, _, _ = run
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
    _, _, before, after, _ = run
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


def test_backups_are_storage_events_with_the_l2_pages_hashes(run):
    _, _, before, _, _ = run
    def page(e):
        return tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids)

    in_l2 = {page(e) for e in cpu(before, BlockStored)}
    in_l3 = [page(e) for e in storage(before, BlockStored)]
    assert in_l3 and set(in_l3) <= in_l2
    assert len(set(in_l3)) == len(in_l3), "a page stored in L3 twice"


def test_l3_prefix_flush_deletes_exactly_the_conversation_through_the_tree(run):
    _, _, before, _, flushed = run
    prefix = flushed["prefix"]
    # Every page of conversation 1 from the prefix's last page on: their tokens
    # extend the prefix.
    mine = {h for h, tokens in page_prefixes(storage(before, BlockStored)).items()
            if tokens[: len(prefix)] == prefix}
    assert mine and flushed["l2"]["l2_pages"] > 0
    # L2 gave them up; the tree kept them as L3-only pages, found by the L3 flush.
    assert flushed["l3_only"] >= len(mine)
    removed = storage(flushed["events"], BlockRemoved)
    assert {h for e in removed for h in e.block_hashes} == mine
    # The store lost exactly those pages (the prefix's page plus the ones after it).
    assert flushed["l3"]["l3_pages"] == len(mine) == flushed["files_deleted"]
