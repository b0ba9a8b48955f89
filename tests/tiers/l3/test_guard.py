"""The guard every backend runs behind (tiers/l3/guard.py): a third-party backend that
counts nothing, raises, or loses its store gets counters, a breaker and the never-raise
rule without writing them. A real in-memory backend over a real host pool; no mocks."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import ReadBatch, StorageBackend, StorageConfig, WriteBatch
from hicache.tiers.l3.guard import GuardedBackend, guarded
from hicache.tiers.l3.report import Report

PAGE = 64
GEOM = PoolGeometry(num_slots=4, num_layers=1, blocks_per_page=1, block_bytes=PAGE)


def config() -> StorageConfig:
    return StorageConfig(0, 1, "ns", "page_first", PAGE)


class DictBackend(StorageBackend):
    """What a third party writes: the three required verbs over a dict, nothing else."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.pages: dict[str, bytes] = {}
        self.raise_next: Exception | None = None
        self.calls = 0
        self.register_host_pool(HostPagePool(GEOM, layout="page_first", pin_memory=False))

    def _maybe_raise(self) -> None:
        self.calls += 1
        if self.raise_next is not None:
            raise self.raise_next

    def read_one(self, key: str, slot: int) -> bool:
        if key not in self.pages:
            return False
        self._require_pool().write_page(
            slot, torch.frombuffer(bytearray(self.pages[key]), dtype=torch.uint8))
        return True

    def read(self, batch: ReadBatch) -> list[bool]:
        self._maybe_raise()
        return [self.read_one(k, s) for k, s in zip(batch.keys, batch.slots, strict=True)]

    def write(self, batch: WriteBatch) -> list[bool]:
        self._maybe_raise()
        for key, slot in zip(batch.keys, batch.slots, strict=True):
            if key in self.pages:
                self.report.skipped(1)
            else:
                self.pages[key] = bytes(self._require_pool().read_page(slot).numpy())
        return [True] * len(batch.keys)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._maybe_raise()
        return next((i for i, k in enumerate(keys) if k not in self.pages), len(keys))

    def clear(self) -> None:
        self._maybe_raise()
        self.pages.clear()


class ProbedBackend(DictBackend):
    """A store that can go away: ``answers`` is the guard's probe."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, probe=True)
        self.up = threading.Event()
        self.up.set()

    def answers(self) -> bool:
        return self.up.is_set()


def fill(b: StorageBackend, slot: int, value: int) -> None:
    assert b.pool is not None
    b.pool.write_page(slot, page(value))


def slot_bytes(b: StorageBackend, slot: int) -> torch.Tensor:
    assert b.pool is not None
    return b.pool.read_page(slot)


def page(fill: int) -> torch.Tensor:
    return torch.full((PAGE,), fill, dtype=torch.uint8)


def wait_until(cond, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_counters_come_from_results_and_reports():
    b = guarded(DictBackend(config()))
    assert isinstance(b, GuardedBackend) and guarded(b) is b
    fill(b, 0, 1)
    fill(b, 1, 2)
    assert b.write(WriteBatch(["a", "b"], [0, 1])) == [True, True]
    assert b.write(WriteBatch(["a"], [2]))  # stored already: reported skipped, still True
    assert b.read(ReadBatch(["a", "x"], [3, 2])) == [True, False]
    assert torch.equal(slot_bytes(b, 3), page(1))
    assert b.exists_prefix(["a", "b", "x"]) == 2
    st = b.stats()
    assert (st.set_pages, st.set_skipped_existing, st.set_failures) == (2, 1, 0)
    assert st.bytes_written == 2 * PAGE
    assert (st.get_pages, st.get_hits, st.get_misses, st.bytes_read) == (2, 1, 1, PAGE)
    assert st.exists_queries == 3 and st.errors == 0 and st.refused_calls == 0
    # stats() is a snapshot: later calls move the guard's counters, not this copy.
    assert b.read(ReadBatch(["a"], [3])) == [True]
    assert (st.get_pages, b.stats().get_pages) == (2, 3)


def test_a_raising_backend_never_raises_and_is_counted():
    inner = DictBackend(config())
    b = guarded(inner)
    inner.raise_next = OSError("disk gone")
    assert b.read(ReadBatch(["a"], [0])) == [False]
    assert b.write(WriteBatch(["a"], [0])) == [False]
    assert b.exists_prefix(["a"]) == 0
    b.clear()
    st = b.stats()
    assert st.errors == 4 and st.get_misses == 1 and st.set_failures == 1
    # no probe: no breaker, the store is asked every time
    assert b.reachable and inner.calls == 4
    # the caller's mistakes still propagate
    inner.raise_next = ValueError("keys and slots differ")
    with pytest.raises(ValueError):
        b.read(ReadBatch(["a"], [0]))
    with pytest.raises(ValueError, match="one slot"):
        ReadBatch(["a", "b"], [0])


def test_a_store_that_goes_away_trips_the_breaker_and_comes_back():
    inner = ProbedBackend(config())
    b = GuardedBackend(inner, probe_interval_s=0.01)
    fill(b, 0, 3)
    assert b.write(WriteBatch(["a"], [0])) == [True]
    inner.up.clear()
    inner.raise_next = ConnectionError("refused")
    assert b.exists_prefix(["a"]) == 0
    assert not b.reachable and "ConnectionError" in b.last_error
    calls = inner.calls
    assert b.read(ReadBatch(["a"], [1])) == [False]
    assert b.write(WriteBatch(["b"], [1])) == [False]
    assert b.exists_prefix(["a"]) == 0
    b.clear()
    assert inner.calls == calls  # refused without a call into the store
    st = b.stats()
    assert st.errors == 1 and st.refused_calls == 4
    inner.raise_next = None
    inner.up.set()
    wait_until(lambda: b.reachable, "the probe never closed the breaker")
    assert b.read(ReadBatch(["a"], [2])) == [True] and torch.equal(slot_bytes(b, 2), page(3))
    b.close()


def test_a_backend_reports_down_without_raising():
    class Reporting(ProbedBackend):
        def exists_prefix(self, keys: Sequence[str]) -> int:
            self.report.failed("rpc -900", down=not self.up.is_set())
            return 0

    inner = Reporting(config())
    b = GuardedBackend(inner, probe_interval_s=0.01)
    assert not b.exists_prefix(["a"]) and b.reachable  # an error, the store still up
    inner.up.clear()
    assert not b.exists_prefix(["a"]) and not b.reachable
    assert inner.report.down  # what a backend asks inside a long batch
    inner.up.set()
    wait_until(lambda: b.reachable, "the probe never closed the breaker")
    assert b.stats().errors == 2
    b.close()


def test_reports_outside_a_call_and_on_several_threads_are_kept_apart():
    class Slow(DictBackend):
        def __init__(self, config: StorageConfig) -> None:
            super().__init__(config)
            self.barrier = threading.Barrier(2)

        def read(self, batch: ReadBatch) -> list[bool]:
            self.barrier.wait()  # both threads inside their call at once
            if batch.keys[0] == "bad":
                self.report.corrupt(1)
            self.barrier.wait()
            return [batch.keys[0] == "good"]

    inner = Slow(config())
    b = guarded(inner)
    results: dict[str, bool] = {}
    threads = [threading.Thread(
        target=lambda k=k, s=s: results.__setitem__(k, b.read(ReadBatch([k], [s]))[0]))
        for k, s in (("good", 0), ("bad", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    inner.report.evicted(2)  # a background thread's eviction: no call under way
    st = b.stats()
    assert results == {"good": True, "bad": False}
    assert (st.get_hits, st.get_misses, st.corrupt_pages, st.evicted_pages) == (1, 1, 1, 2)


def test_a_detached_report_keeps_nothing_and_is_never_down():
    r = Report()
    r.corrupt(3)
    r.failed("x", down=True)
    assert not r.down


def test_a_plain_backend_starts_nothing_past_its_deadline():
    b = guarded(DictBackend(config()))
    assert not b.capabilities.timed
    assert b.read(ReadBatch(["a"], [0], deadline=time.monotonic() - 1)) == [False]
    assert b.inner.calls == 0  # past its deadline: nothing started
    st = b.stats()
    assert st.get_pages == 0 and st.errors == 0


def test_the_guard_forwards_the_contract_and_nothing_else():
    inner = DictBackend(config())
    b = guarded(inner)
    assert b.capabilities is inner.capabilities and b.inner.pages is inner.pages
    with pytest.raises(AttributeError):
        b.pages  # noqa: B018 - a backend's own attribute does not leak through
    b.raise_next = KeyError("x")  # the guard's own attribute now, not the backend's
    assert inner.raise_next is None
    public = [n for n, v in inspect.getmembers(GuardedBackend)
              if not n.startswith("_") and (callable(v) or isinstance(v, property))]
    assert len(public) <= 15, public
    assert "__getattr__" not in vars(GuardedBackend)
    # deleting and clearing are the backend's to offer: a clear error where it does not
    with pytest.raises(NotImplementedError, match="cannot delete"):
        b.delete(["a"])
