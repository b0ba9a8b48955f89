"""Worker half of stores across steps (tiers/worker/core.py): a step returns while its
store runs; the page lands intact later; what reads that slot waits or follows it.

Real worker, host pool and copy thread. The store's copy function is wrapped
with a gate the test opens, so "still in flight" is a fact, not a timing."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from hicache.connector.metadata import HiCacheStepMetadata
from hicache.tiers.index.commands import RetainPages
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, RequestFetch, RequestLoad
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.worker.core import HiCacheWorker
from hicache.tiers.worker.store_queue import MAX_STORE_STEPS_IN_FLIGHT

GEOM = PoolGeometry(num_slots=8, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 2)
KEY_A, KEY_B = page_keys(NS.seed(), list(range(16)), 8)
L1_BLOCKS = 12


class Gate:
    """Holds every store copy until opened; ``fail`` makes them raise instead."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.fail = False
        self.entered = threading.Event()

    def wrap(self, save):
        def gated(*args):
            self.entered.set()
            self.open.wait()
            if self.fail:
                raise RuntimeError("store copy failed (test)")
            save(*args)
        return gated


def make_worker(gate: Gate, *, async_stores: bool = True) -> HiCacheWorker:
    w = HiCacheWorker(GEOM, L1_BLOCKS, layout="page_first", async_stores=async_stores)
    kv = {f"layer.{i}": torch.randn(L1_BLOCKS, 16) for i in range(2)}  # 64 B blocks
    w.register_kv_caches(kv)
    copies = w.copies
    copies.copy_path = replace(copies.copy_path, save=gate.wrap(copies.copy_path.save))
    w.kv = kv
    return w


def store(seq: int, slot: int, key: bytes, blocks: tuple[int, int], **kw) -> HiCacheStepMetadata:
    return HiCacheStepMetadata(stores=[PagePlan(slot, key, 0, blocks)], seq=seq, **kw)


def holds_blocks(w: HiCacheWorker, slot: int, blocks: tuple[int, ...]) -> bool:
    """Whether the slot's bytes are exactly those L1 blocks', in every layer."""
    return all(torch.equal(w.pool.canonical[slot, i].flatten(),
                           torch.cat([w.kv[f"layer.{i}"][b].view(torch.uint8) for b in blocks]))
               for i in range(2))


def blocks_equal(w: HiCacheWorker, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return all(torch.equal(w.kv[f"layer.{i}"][list(a)], w.kv[f"layer.{i}"][list(b)])
               for i in range(2))


def open_later(gate: Gate) -> threading.Thread:
    """Opens the gate once the copy thread waits in it (the test is then blocked)."""
    def run() -> None:
        gate.entered.wait(60)
        gate.open.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.open.set()


@pytest.fixture
def w(gate):
    worker = make_worker(gate)
    yield worker
    gate.open.set()  # a failed assertion must not leave the copy thread gated
    worker.shutdown()


def load(slot: int, key: bytes, blocks: tuple[int, int], seq: int) -> HiCacheStepMetadata:
    return HiCacheStepMetadata(loads=[RequestLoad("r", (PagePlan(slot, key, 0, blocks),))],
                               seq=seq)


def test_a_step_returns_while_its_store_runs_and_the_page_lands_intact_later(w, gate):
    w.finish_step(store(1, 0, KEY_A, (3, 4), release_after_store=["done"]))
    assert gate.entered.wait(60)  # the copy thread is inside the store now
    assert not w.pool.holds(0, KEY_A)  # not published while in flight
    assert w.take_released() == set()  # vLLM keeps the finished request's blocks
    report = w.take_report()
    assert report is None or report.stores_done == {}
    w.finish_step(HiCacheStepMetadata(seq=2))  # the next step does not wait either
    assert w.stats.store_waits == 0
    gate.open.set()
    w.stores.pending[0].mark.wait()
    assert w.take_released() == {"done"}
    assert w.pool.holds(0, KEY_A) and holds_blocks(w, 0, (3, 4))
    assert w.take_report().stores_done == {0: 1}
    assert w.stats.saved_pages == 1 and w.stats.save_errors == 0


def test_a_load_of_a_slot_still_being_stored_runs_after_the_store(w, gate):
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    w.start_load(load(0, KEY_A, (6, 7), seq=2))
    assert w.take_load_errors() == set()  # not a key mismatch: the store is queued
    gate.open.set()
    w.finish_step(HiCacheStepMetadata(seq=2))
    assert w.take_load_errors() == set() and w.take_report().bad_slots == set()
    assert blocks_equal(w, (6, 7), (3, 4))


def test_a_load_behind_a_failed_store_is_reported_and_the_slot_is_bad(w, gate):
    gate.fail = True
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    w.start_load(load(0, KEY_A, (6, 7), seq=2))
    gate.open.set()
    w.finish_step(HiCacheStepMetadata(seq=2))
    assert w.take_load_errors() == {6, 7}
    assert w.take_report().bad_slots == {0}
    assert not w.pool.holds(0, KEY_A) and w.stats.save_errors == 1


def test_a_preemption_waits_for_the_stores_in_flight(w, gate):
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    w.handle_preemptions(HiCacheStepMetadata(seq=2))  # nobody preempted: no wait
    assert not w.pool.holds(0, KEY_A)
    opener = open_later(gate)
    w.handle_preemptions(HiCacheStepMetadata(seq=2, flush_stores=True))
    opener.join()
    assert w.pool.holds(0, KEY_A) and holds_blocks(w, 0, (3, 4))
    assert w.stats.store_waits == 1


def test_a_fetch_out_of_a_slot_being_stored_waits_for_the_store(w, gate):
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    fetch = RequestFetch("r", (PagePlan(0, KEY_A, 0, (8, 9)),), ())
    opener = open_later(gate)
    w.start_load(HiCacheStepMetadata(fetches=[fetch], seq=2))  # off the copy queue
    opener.join()
    w.finish_step(HiCacheStepMetadata(seq=2))
    assert w.take_received() == {"r"} and w.take_load_errors() == set()
    assert blocks_equal(w, (8, 9), (3, 4)) and w.stats.store_waits == 1


def test_a_slot_stored_again_belongs_to_the_later_store(w, gate):
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    w.finish_step(store(2, 0, KEY_B, (5, 6)))  # L2 evicted A and reused its slot
    gate.open.set()
    w.finish_step(HiCacheStepMetadata(seq=3))
    while w.stores.pending:
        w.stores.pending[-1].mark.wait()
        w.take_released()
    assert w.pool.holds(0, KEY_B) and not w.pool.holds(0, KEY_A)
    assert holds_blocks(w, 0, (5, 6))


def test_a_backlog_beyond_the_bound_makes_the_step_wait(w, gate):
    for seq in range(1, MAX_STORE_STEPS_IN_FLIGHT + 1):
        w.finish_step(store(seq, seq, KEY_A if seq % 2 else KEY_B, (seq, seq + 1)))
    assert w.stats.store_waits == 0 and len(w.stores.pending) == MAX_STORE_STEPS_IN_FLIGHT
    opener = open_later(gate)
    w.finish_step(store(MAX_STORE_STEPS_IN_FLIGHT + 1, 7, KEY_B, (9, 10)))
    opener.join()
    assert w.stats.store_waits == 1 and len(w.stores.pending) <= MAX_STORE_STEPS_IN_FLIGHT


def test_without_async_stores_each_step_waits_for_its_own(gate):
    w = make_worker(gate, async_stores=False)
    try:
        opener = open_later(gate)
        w.finish_step(store(1, 0, KEY_A, (3, 4), release_after_store=["done"]))
        opener.join()
        assert w.pool.holds(0, KEY_A) and w.take_released() == {"done"}
        report = w.take_report()
        assert report is not None and report.stores_done == {}  # nothing to track
    finally:
        gate.open.set()  # a failed assertion must not leave the copy thread gated
        w.shutdown()


def test_an_l3_retention_never_waits_for_the_stores_in_flight(w, gate):
    """An L3 deletion waits for stores in flight (none may land after it); a retention
    (a request's retain_s) has no such reason and must not stall the step."""
    w.finish_step(store(1, 0, KEY_A, (3, 4)))
    assert gate.entered.wait(60)  # the store is in flight, held by the gate
    step = HiCacheStepMetadata(seq=2, storage_commands=[RetainPages((KEY_A,), 1.0)])
    applied = threading.Thread(target=w.begin_step, args=(step,), daemon=True)
    applied.start()
    applied.join(60)  # bounds a broken test only: the gate stays closed meanwhile
    assert not applied.is_alive() and w.stats.store_waits == 0


@pytest.mark.parametrize("async_stores", [True, False])
def test_layer_saves_run_inside_the_forward_pass_only_with_async_stores(gate, async_stores):
    """vLLM's save_kv_layer: with stores across steps, a layer whose KV is final is
    copied while later layers compute (above the per-layer size, lowered to 0 here);
    inline (a CPU's default) nothing runs until the step ends, then every layer at
    once. The page is whole either way."""
    worker = make_worker(gate, async_stores=async_stores)
    try:
        worker.copies.per_layer_min = 0
        gate.open.set()
        meta = store(1, 0, KEY_A, (3, 4))
        worker.save_layer("layer.0", meta)
        assert worker.stats.layer_saves_in_forward == (1 if async_stores else 0)
        assert worker.copies.pipeline.inline is not async_stores
        worker.finish_step(meta)
        for pending in list(worker.stores.pending):  # inline: already done
            pending.mark.wait()
        worker.finish_step(HiCacheStepMetadata(seq=2))
        assert worker.pool.holds(0, KEY_A) and holds_blocks(worker, 0, (3, 4))
        assert worker.stats.saved_pages == 1 and worker.stats.save_errors == 0
    finally:
        worker.shutdown()
