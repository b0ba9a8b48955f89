"""The worker's L3 I/O thread with the real file backend: fetch order, deadlines,
best effort, failures, and backups that never read a slot being overwritten."""

import dataclasses
import threading
import time

import pytest
import torch
from support.fault_injection import FaultyFileBackend

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, RequestFetch
from hicache.tiers.index.spans import SpanLayout
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.worker.l3_io import StorageIO

GEOM = PoolGeometry(num_slots=80, num_layers=2, blocks_per_page=1, block_bytes=128)
NS = KeyNamespace("m", "f32", "cpu", 4, 1)
KEYS = page_keys(NS.seed(), list(range(4 * 40)), 4)


def make(tmp_path, fetch_threads=1, backend_class=FaultyFileBackend, io_options=None,
         **faults):
    """One I/O thread unless asked (the ordering tests hold it with a slow fetch)."""
    cfg = StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes,
                        extra_config={"path": str(tmp_path), **faults})
    pool = HostPagePool(GEOM, layout="page_first", pin_memory=False)
    backend = guarded(backend_class(cfg))
    backend.register_host_pool(pool)
    loaded: list[list[PagePlan]] = []
    io = StorageIO(backend, pool, loaded.append, fetch_threads=fetch_threads,
                   **(io_options or {}))
    return io, pool, backend, loaded


def seed_l3(tmp_path, n):
    io, pool, backend, _ = make(tmp_path)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    assert all(backend.write(WriteBatch([k.hex() for k in KEYS[:n]], list(range(n)))))
    io.shutdown()
    return pool.buffer[:n].clone()


def plan(first_slot, n, first_key=0):
    return tuple(PagePlan(first_slot + i, KEYS[first_key + i], 0, (100 + first_key + i,))
                 for i in range(n))


def wait_result(io, timeout=60.0):  # a bound for a loaded machine, not a speed check
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = io.poll()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("fetch did not finish")


def test_fetch_loads_l2_then_l3_pages_in_order(tmp_path):
    stored = seed_l3(tmp_path, 40)
    io, pool, _, loaded = make(tmp_path)
    for i in range(2):  # two pages already in L2
        pool.buffer[40 + i].copy_(stored[i])
        pool.set_key(40 + i, KEYS[i])
    fetch = RequestFetch("r", plan(40, 2), plan(42, 38, first_key=2), (999,), None)
    io.submit_fetch(fetch)
    (result,) = wait_result(io)
    assert result.fetched_pages == 38 and result.error_block_ids == {999}
    assert [p.slot for p in loaded[0]] == list(range(40, 80))
    assert torch.equal(pool.buffer[40:80], stored)
    assert all(pool.holds(42 + i, KEYS[2 + i]) for i in range(38))
    io.shutdown()


def test_missing_page_ends_the_prefix_and_reports_the_rest(tmp_path):
    seed_l3(tmp_path, 40)
    io, pool, backend, _ = make(tmp_path)
    (backend.inner.pages_dir / backend.inner._name(KEYS[5].hex())).unlink()
    io.submit_fetch(RequestFetch("r", (), plan(40, 10), (), None))
    (result,) = wait_result(io)
    assert result.fetched_pages == 5
    assert result.error_block_ids == {105, 106, 107, 108, 109}
    assert not pool.holds(45, KEYS[5])
    io.shutdown()


def test_l2_page_lost_means_nothing_after_it_is_loaded(tmp_path):
    seed_l3(tmp_path, 40)
    io, _, _, loaded = make(tmp_path)
    io.submit_fetch(RequestFetch("r", plan(40, 1), plan(41, 3, first_key=1), (), None))
    (result,) = wait_result(io)  # slot 40 never held KEYS[0]
    assert result.fetched_pages == 0 and result.error_block_ids == {100, 101, 102, 103}
    assert loaded == []
    io.shutdown()


class FakeTime:
    """The I/O thread's ``time`` module with a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.mark.parametrize("timeout_s", [0.3, 0.0])
def test_deadline_and_best_effort_stop_a_slow_fetch(tmp_path, monkeypatch, timeout_s):
    """The first batch is held in the store (a gate) while the deadline passes on an
    injected clock, or while best effort's second poll cancels the fetch: it stops
    after that batch, whatever the machine's speed."""
    seed_l3(tmp_path, 40)
    clock = FakeTime()
    monkeypatch.setattr("hicache.tiers.worker.l3_io.time", clock)
    io, _, backend, _ = make(tmp_path)
    backend.inner.get_gate = threading.Event()
    io.submit_fetch(RequestFetch("r", (), plan(40, 40), (), timeout_s))
    assert backend.inner.get_entered.wait(60)  # the first batch is in flight
    if timeout_s == 0.0:
        io.poll()  # best effort: stops at the second poll after submission
        io.poll()
    else:
        clock.now += timeout_s + 0.1  # past the deadline while the batch runs
    backend.inner.get_gate.set()
    (result,) = wait_result(io)
    # Stopped after the batch in flight: one batch of 32 pages.
    assert result.fetched_pages == 32 and len(result.error_block_ids) == 8
    assert io.stats.fetch_deadline_misses == 1
    # Never read, not failed: an operator tells a slow store from a broken one.
    assert (io.stats.fetch_late_pages, io.stats.fetch_failed_pages) == (8, 0)
    io.shutdown()


def test_a_cancelled_fetch_stops_after_the_batch_in_flight_and_others_go_on(tmp_path):
    """``cancel_fetches`` (an admin DELETE /prefetch/{id}): the fetch held in its first
    batch ends with that batch's pages once the gate opens; a fetch queued behind it
    and not named reads every page."""
    seed_l3(tmp_path, 40)
    io, _, backend, _ = make(tmp_path)
    backend.inner.get_gate = threading.Event()
    io.submit_fetch(RequestFetch("a", (), plan(40, 40), (), None))
    assert backend.inner.get_entered.wait(60)  # the first batch is in flight
    io.submit_fetch(RequestFetch("b", (), plan(0, 4, first_key=0), (), None))
    assert io.cancel_fetches({"a", "nobody"}) == 1
    backend.inner.get_gate.set()
    results: dict[str, int] = {}
    deadline = time.monotonic() + 60  # a hang guard, not a speed check
    while len(results) < 2:
        assert time.monotonic() < deadline, results
        results.update({r.req_id: r.fetched_pages for r in io.poll()})
        time.sleep(0.01)
    assert results == {"a": 32, "b": 4}
    io.shutdown()


def test_failing_store_is_a_miss_not_an_exception(tmp_path):
    seed_l3(tmp_path, 40)
    io, _, _, _ = make(tmp_path, fault_fail_gets=True)
    io.submit_fetch(RequestFetch("r", (), plan(40, 4), (), None))
    (result,) = wait_result(io)
    assert result.fetched_pages == 0 and len(result.error_block_ids) == 4
    assert (io.stats.fetch_failed_pages, io.stats.fetch_late_pages) == (4, 0)
    io.shutdown()


def test_backups_are_written_and_dropped_when_their_slot_is_reused(tmp_path):
    io, pool, backend, _ = make(tmp_path)
    for i in range(8):
        pool.set_key(i, KEYS[i])
    # Hold the I/O thread in a fetch (a gate) so the backups stay queued.
    backend.inner.get_gate = threading.Event()
    io.submit_fetch(RequestFetch("block", (), plan(70, 1, first_key=30), (), None))
    assert backend.inner.get_entered.wait(60)
    io.submit_backup([(KEYS[i], i, KEYS[i]) for i in range(8)])
    io.release_slots([3, 4])  # the worker is about to overwrite slots 3 and 4
    pool.set_key(3, None)
    pool.set_key(4, None)
    backend.inner.get_gate.set()
    io.shutdown()
    stored = [(backend.exists_prefix([KEYS[i].hex()]) == 1) for i in range(8)]
    assert stored == [True, True, True, False, False, True, True, True]
    assert io.stats.backups_dropped == 2 and io.stats.backup_pages == 6


def test_removal_drops_queued_backups_and_deletes_after_the_running_one(tmp_path):
    seed_l3(tmp_path, 40)
    io, pool, backend, _ = make(tmp_path)
    for i in range(8):
        pool.set_key(40 + i, KEYS[30 + i] if i < 4 else KEYS[i])
    backend.inner.get_gate = threading.Event()  # keep the thread in a fetch first
    io.submit_fetch(RequestFetch("block", (), plan(70, 1, first_key=20), (), None))
    assert backend.inner.get_entered.wait(60)
    io.submit_backup([(KEYS[30 + i], 40 + i, KEYS[30 + i]) for i in range(4)])
    io.submit_removal([KEYS[30], KEYS[31], KEYS[0]])
    backend.inner.get_gate.set()
    io.shutdown()
    # The queued backups of 30/31 were dropped (none can land after the flush)
    # and their stored copies deleted with 0's; 32/33 and 1 are untouched.
    assert [(backend.exists_prefix([KEYS[k].hex()]) == 1) for k in (30, 31, 32, 33, 0, 1)] == [
        False, False, True, True, False, True]
    assert io.stats.deleted_pages == 3 and io.stats.backups_dropped == 2


def test_wait_results_returns_once_a_fetch_finished_and_false_with_none_pending(tmp_path):
    """What an idle engine step does (connector get_finished): block, the GIL free,
    until the fetch is done. The generous timeout only bounds a broken wait."""
    seed_l3(tmp_path, 40)
    io, _, _, loaded = make(tmp_path)
    assert io.wait_results(0.001) is False  # nothing submitted: no wait at all
    io.submit_fetch(RequestFetch("r", (), plan(40, 40), (), None))
    assert io.wait_results(60.0) is True
    (result,) = io.poll()  # finished, without polling in a loop
    assert result.fetched_pages == 40 and len(loaded) == 1
    assert io.wait_results(0.001) is False
    io.shutdown()


def test_wait_results_gives_up_at_its_timeout_while_the_store_is_slow(tmp_path):
    seed_l3(tmp_path, 40)
    io, _, _, _ = make(tmp_path, fault_get_delay_s=5.0)
    io.submit_fetch(RequestFetch("r", (), plan(40, 4), (), None))
    assert io.wait_results(0.01) is False  # the store takes 5 s per batch
    assert io.poll() == []
    io.shutdown()


def test_wait_fetches_returns_once_every_fetch_ended(tmp_path):
    """Counters read after wait_fetches count every fetch handed over, however
    long the store took (the timeout only bounds a broken wait)."""
    seed_l3(tmp_path, 40)
    io, _, _, _ = make(tmp_path, fault_get_delay_s=0.5)
    assert io.wait_fetches(0.001) is True  # nothing submitted
    io.submit_fetch(RequestFetch("a", (), plan(40, 4), (), None))
    io.submit_fetch(RequestFetch("b", (), plan(44, 4), (), None))
    assert io.wait_fetches(0.001) is False  # the store takes 0.5 s per batch
    assert io.wait_fetches(60.0) is True
    assert io.stats.fetches == 2 and io.stats.fetched_pages == 8
    io.shutdown()


def test_prefetch_stops_in_l2_and_loads_nothing(tmp_path):
    stored = seed_l3(tmp_path, 6)
    io, pool, _, loaded = make(tmp_path)
    l3 = tuple(PagePlan(50 + i, KEYS[i], 0, ()) for i in range(6))
    io.submit_fetch(RequestFetch("hicache-prefetch:r", (), l3, (), None, prefetch=True))
    (result,) = wait_result(io)
    assert result.prefetch and result.fetched_pages == 6 and not result.error_block_ids
    assert loaded == []  # no vLLM block is touched
    assert torch.equal(pool.buffer[50:56], stored)
    assert all(pool.holds(50 + i, KEYS[i]) for i in range(6))
    io.shutdown()


class BarrierBackend(FaultyFileBackend):
    """Reads wait at a barrier of two: they pass only if two run at once."""

    barrier = threading.Barrier(2, timeout=30)

    def read(self, batch):
        self.barrier.wait()
        return super().read(batch)


def test_fetches_run_side_by_side_with_a_concurrent_io_backend(tmp_path):
    stored = seed_l3(tmp_path, 8)
    BarrierBackend.barrier.reset()
    io, pool, _, _ = make(tmp_path, fetch_threads=4, backend_class=BarrierBackend)
    io.submit_fetch(RequestFetch("a", (), plan(40, 4), (), None))
    io.submit_fetch(RequestFetch("b", (), plan(50, 4, first_key=4), (), None))
    results = []
    while len(results) < 2:
        results += wait_result(io, timeout=60)
    # A single thread would have broken the barrier (a failed read, 0 pages).
    assert sorted((r.req_id, r.fetched_pages) for r in results) == [("a", 4), ("b", 4)]
    assert io.stats.fetches == 2 and io.stats.fetched_pages == 8
    assert torch.equal(pool.buffer[40:44], stored[:4])
    assert torch.equal(pool.buffer[50:54], stored[4:8])
    io.shutdown()


class GatedBackups(FaultyFileBackend):
    """Backups wait for ``gate``; reads record whether a backup was inside."""

    gate = threading.Event()
    inside = threading.Event()
    read_during_backup: list[bool] = []

    def write(self, batch):
        self.inside.set()
        assert self.gate.wait(30)
        out = super().write(batch)
        self.inside.clear()
        return out

    def read(self, batch):
        self.read_during_backup.append(self.inside.is_set())
        return super().read(batch)


def test_a_helper_never_reads_into_a_slot_a_running_backup_reads(tmp_path):
    seed_l3(tmp_path, 4)
    GatedBackups.gate.clear()
    GatedBackups.inside.clear()
    GatedBackups.read_during_backup.clear()
    io, pool, _, _ = make(tmp_path, fetch_threads=4, backend_class=GatedBackups)
    pool.set_key(60, KEYS[30])
    io.submit_backup([(KEYS[30], 60, KEYS[30])])
    assert GatedBackups.inside.wait(30)  # the backup of slot 60 is running
    # Slot 60 was freed and reserved again for a fetch (the worker's order).
    io.submit_fetch(RequestFetch("r", (), (PagePlan(60, KEYS[0], 0, (100,)),), (), None))
    GatedBackups.gate.set()
    (result,) = wait_result(io, timeout=60)
    assert result.fetched_pages == 1
    assert GatedBackups.read_during_backup == [False]
    io.shutdown()


def test_an_idle_wait_with_no_fetch_lets_the_running_backup_finish(tmp_path):
    """An idle engine stepping for the L3 catch-up: wait_results blocks, the GIL free,
    until the backups are written (here: until their gate opens), not at once."""
    GatedBackups.gate.clear()
    GatedBackups.inside.clear()
    io, pool, backend, _ = make(tmp_path, backend_class=GatedBackups)
    pool.set_key(60, KEYS[30])
    io.submit_backup([(KEYS[30], 60, KEYS[30])])
    assert GatedBackups.inside.wait(30)
    seen: list[tuple[bool, bool]] = []  # (waited for a fetch, the page was in L3 then)
    waiter = threading.Thread(target=lambda: seen.append(
        (io.wait_results(60.0), (backend.exists_prefix([KEYS[30].hex()]) == 1))))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not seen  # still waiting: the backup is held
    GatedBackups.gate.set()
    waiter.join(60)
    assert seen == [(False, True)]
    io.shutdown()


def test_backups_done_before_a_waiting_removal_are_not_reported_stored(tmp_path):
    """A page backed up just before a flush that then deletes it must not reach the
    scheduler's tree as stored: nothing is taken while a removal waits, and the
    removal forgets what it deletes. (Before: the worker reported it, the tree
    marked it in L3, and the L3 catch-up never wrote it again.)"""
    seed_l3(tmp_path, 1)
    GatedBackups.gate.clear()
    GatedBackups.inside.clear()
    io, pool, backend, _ = make(tmp_path, backend_class=GatedBackups)
    backend.inner.get_gate = threading.Event()
    pool.set_key(60, KEYS[30])
    io.submit_backup([(KEYS[30], 60, KEYS[30])])
    assert GatedBackups.inside.wait(30)  # the backup runs
    io.submit_fetch(RequestFetch("r", (), plan(70, 1), (), None))  # runs next, held
    io.submit_removal(None)  # L3 flushed: waits behind the fetch
    GatedBackups.gate.set()
    assert backend.inner.get_entered.wait(60)  # the backup is done, the removal waits
    assert (backend.exists_prefix([KEYS[30].hex()]) == 1)
    assert io.take_backed_up() == []
    backend.inner.get_gate.set()
    wait_result(io)
    assert io.wait_backups(60)
    pool.set_key(61, KEYS[31])
    io.submit_backup([(KEYS[31], 61, KEYS[31])])  # after the removal: reported
    assert io.wait_backups(60)
    assert io.take_backed_up() == [KEYS[31]]
    assert not (backend.exists_prefix([KEYS[30].hex()]) == 1)
    io.shutdown()


def test_a_timed_backend_gets_byte_sized_batches_and_keeps_the_prefix_rule(tmp_path):
    """The plain file backend reads GIL-free batches that stop at the deadline by
    themselves (where numba runs): batches of TIMED_BATCH_BYTES, one call for these
    40 small pages; a missing page still ends the fetched prefix."""
    from hicache.tiers.l3 import native_io
    from hicache.tiers.l3.file.backend import FileBackend
    from hicache.tiers.worker import l3_io as io_thread

    stored = seed_l3(tmp_path, 40)
    io, pool, backend, loaded = make(tmp_path, backend_class=FileBackend)
    timed = native_io.available()
    assert backend.capabilities.timed == timed
    assert io._batch_pages() == (io_thread.TIMED_BATCH_BYTES // GEOM.page_bytes if timed
                                 else io_thread.BATCH_PAGES)
    backend.inner.page_path(KEYS[30].hex()).unlink()
    io.submit_fetch(RequestFetch("r", (), plan(40, 40), (), None))
    (result,) = wait_result(io)
    assert result.fetched_pages == 30
    assert result.error_block_ids == {100 + i for i in range(30, 40)}
    assert torch.equal(pool.buffer[40:70], stored[:30])
    assert [p.slot for p in loaded[0]] == list(range(40, 70))
    assert backend.stats().get_misses == 1  # the one missing page, nothing else
    io.shutdown()


def test_retention_reaches_the_backend_in_order_with_removals(tmp_path):
    io, _, backend, _ = make(tmp_path)
    io.submit_retention([KEYS[0], KEYS[1], KEYS[2]], time.time() + 60)
    io.submit_removal([KEYS[2]])  # a flush ends the retention of what it deletes
    io.submit_retention([KEYS[1]], 0)  # ended
    io.shutdown()
    assert io.stats.retained_pages == 3
    assert set(backend.inner.index.retained) == {backend.inner._name(KEYS[0].hex())}


@pytest.mark.skipif(not native_io.available(), reason="file span objects need the batch path")
def test_spans_are_backed_up_whole_and_fetched_with_page_objects_where_they_lack(tmp_path):
    layout = SpanLayout(4)
    io, pool, backend, _ = make(tmp_path, backend_class=FileBackend)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
    for i in range(10):
        pool.set_key(i, KEYS[i])
    # Pages 0..9 stored in one plan: two whole spans, pages 8 and 9 on their own.
    spans = layout.refs(KEYS, 0, 10, whole=True)
    io.submit_backup([(KEYS[i], i, KEYS[i]) for i in range(10)], spans)
    io.shutdown()
    assert sorted(io.take_backed_up()) == sorted(KEYS[:10])
    assert [(backend.exists_prefix([KEYS[i].hex()]) == 1) for i in (0, 7, 8, 9)] == [
        False, False, True, True]
    assert backend.exists_prefix([k.hex() for k in layout.object_keys(KEYS)]) == 2
    stored = pool.buffer[:10].clone()

    def fetch(req):
        io, pool, _, _ = make(tmp_path, backend_class=FileBackend)
        pages = tuple(dataclasses.replace(p, span=layout.ref(KEYS, i))
                      for i, p in enumerate(plan(40, 10)))
        io.submit_fetch(RequestFetch(req, (), pages, (), None))
        (result,) = wait_result(io)
        io.shutdown()
        return result, pool

    # Pages 8 and 9 name span [8, 12), which is no object: read from their page objects.
    result, pool = fetch("r")
    assert result.fetched_pages == 10
    assert torch.equal(pool.buffer[40:50], stored)
    # The second span gone (an operator removed it): the fetch stops at its first page.
    backend.inner.page_path(layout.object_keys(KEYS)[1].hex()).unlink()
    result, pool = fetch("r2")
    assert result.fetched_pages == 4 and torch.equal(pool.buffer[40:44], stored[:4])


def test_backups_wait_for_the_forward_pass_and_fetches_do_not(tmp_path):
    """On a CPU engine (``yield_to_forward``) backups run between forward passes:
    queued during one, none is written until it ends; a fetch runs meanwhile."""
    seed_l3(tmp_path / "seeded", 4)
    io, pool, backend, _ = make(tmp_path, io_options={"yield_to_forward": True,
                                                      "max_defer_s": 3600.0})
    for i in range(8):
        pool.set_key(i, KEYS[10 + i])
    io.forward_started()
    io.submit_backup([(KEYS[10 + i], i, KEYS[10 + i]) for i in range(8)])
    io.submit_fetch(RequestFetch("during", (), plan(70, 2, first_key=30), (), None))
    (result,) = wait_result(io)  # the fetch went ahead of the gate (a miss: not stored)
    assert result.req_id == "during"
    assert not io.wait_backups(0.2)  # still queued: the pass has not ended
    assert io.stats.backup_pages == 0 and io.queue_depths()[1] == 8
    io.forward_ended()
    assert io.wait_backups(60)
    assert io.stats.backup_pages == 8
    assert backend.exists_prefix([KEYS[10 + i].hex() for i in range(8)]) == 8
    io.shutdown()


def test_backups_go_ahead_in_a_forward_pass_longer_than_max_defer_and_at_shutdown(tmp_path):
    io, pool, backend, _ = make(tmp_path, io_options={"yield_to_forward": True,
                                                      "max_defer_s": 0.05})
    for i in range(4):
        pool.set_key(i, KEYS[i])
    io.forward_started()  # and never ended
    io.submit_backup([(KEYS[i], i, KEYS[i]) for i in range(2)])
    assert io.wait_backups(60)  # the pass ran past max_defer_s
    slow, pool2, backend2, _ = make(tmp_path / "second", io_options={
        "yield_to_forward": True, "max_defer_s": 3600.0})
    for i in range(4):
        pool2.set_key(i, KEYS[i])
    slow.forward_started()
    slow.submit_backup([(KEYS[i], i, KEYS[i]) for i in range(4)])
    slow.shutdown()  # finishes queued backups whatever the gate says
    assert backend2.exists_prefix([KEYS[i].hex() for i in range(4)]) == 4
    io.shutdown()


def test_without_yield_to_forward_the_step_hooks_change_nothing(tmp_path):
    io, pool, backend, _ = make(tmp_path)
    for i in range(2):
        pool.set_key(i, KEYS[i])
    io.forward_started()
    io.submit_backup([(KEYS[i], i, KEYS[i]) for i in range(2)])
    assert io.wait_backups(60)  # a GPU engine's host is free while the pass runs
    io.shutdown()


class HeldWrites(FaultyFileBackend):
    """Each write waits for ``release`` and records whether a forward pass ran when
    it started (``in_pass``, set by the test around its pass)."""

    release = threading.Event()
    started = threading.Event()
    in_pass = False
    writes: list[tuple[int, bool]] = []  # (pages, a pass ran at its start)

    def write(self, batch):
        self.writes.append((len(batch.keys), HeldWrites.in_pass))
        self.started.set()
        assert self.release.wait(30)
        return super().write(batch)


def test_a_long_backup_yields_to_a_pass_that_starts_while_it_runs(tmp_path):
    """A step's backup of 20 pages starts between passes; a pass begins during its
    first part: the part finishes, the other 12 pages wait for the pass's end
    (before: the whole backup ran on into the pass)."""
    HeldWrites.release.clear()
    HeldWrites.started.clear()
    HeldWrites.in_pass = False
    HeldWrites.writes.clear()
    io, pool, backend, _ = make(tmp_path, backend_class=HeldWrites, io_options={
        "yield_to_forward": True, "max_defer_s": 3600.0})
    for i in range(20):
        pool.set_key(i, KEYS[10 + i])
    io.submit_backup([(KEYS[10 + i], i, KEYS[10 + i]) for i in range(20)])
    assert HeldWrites.started.wait(30)  # the first part runs, between passes
    HeldWrites.in_pass = True
    io.forward_started()
    HeldWrites.release.set()
    assert not io.wait_backups(0.3)  # the rest waits for the pass to end
    assert io.stats.backup_pages == 8 and io.queue_depths()[1] == 12
    HeldWrites.in_pass = False
    io.forward_ended()
    assert io.wait_backups(60)
    assert HeldWrites.writes == [(8, False), (8, False), (4, False)]
    assert backend.exists_prefix([KEYS[10 + i].hex() for i in range(20)]) == 20
    io.shutdown()
