"""The guard every backend runs behind (tiers/l3/guard.py): a third-party backend that
counts nothing, raises, or loses its store gets counters, a breaker and the never-raise
rule without writing them. A real in-memory backend; no mocks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hicache.tiers.l3.base import StorageBackend, StorageConfig
from hicache.tiers.l3.guard import GuardedBackend, guarded
from hicache.tiers.l3.report import Report

PAGE = 64


def config() -> StorageConfig:
    return StorageConfig(0, 1, "ns", "page_first", PAGE)


class DictBackend(StorageBackend):
    """What a third party writes: get / set / exists over a dict, nothing else."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.pages: dict[str, bytes] = {}
        self.raise_next: Exception | None = None
        self.calls = 0

    def _maybe_raise(self) -> None:
        self.calls += 1
        if self.raise_next is not None:
            raise self.raise_next

    def get(self, key: str, target: torch.Tensor) -> bool:
        self._maybe_raise()
        if key not in self.pages:
            return False
        target.copy_(torch.frombuffer(bytearray(self.pages[key]), dtype=torch.uint8))
        return True

    def set(self, key: str, value: torch.Tensor) -> bool:
        self._maybe_raise()
        if key in self.pages:
            self.report.skipped(1)
        else:
            self.pages[key] = bytes(value.numpy())
        return True

    def exists(self, key: str) -> bool:
        self._maybe_raise()
        return key in self.pages


class ProbedBackend(DictBackend):
    """A store that can go away: ``answers`` is the guard's probe."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.up = threading.Event()
        self.up.set()

    def answers(self) -> bool:
        return self.up.is_set()


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
    assert b.batch_set(["a", "b"], [page(1), page(2)]) == [True, True]
    assert b.set("a", page(9))  # stored already: reported skipped, still True
    out = torch.empty(PAGE, dtype=torch.uint8)
    assert b.batch_get(["a", "x"], [out, out.clone()]) == [True, False]
    assert torch.equal(out, page(1))
    assert b.batch_exists(["a", "b", "x"]) == 2
    st = b.stats()
    assert (st.set_pages, st.set_skipped_existing, st.set_failures) == (2, 1, 0)
    assert st.bytes_written == 2 * PAGE
    assert (st.get_pages, st.get_hits, st.get_misses, st.bytes_read) == (2, 1, 1, PAGE)
    assert st.exists_queries == 3 and st.errors == 0 and st.refused_calls == 0
    # the backend itself keeps nothing
    assert StorageBackend.stats(b.inner) == type(st)()


def test_a_raising_backend_never_raises_and_is_counted():
    inner = DictBackend(config())
    b = guarded(inner)
    inner.raise_next = OSError("disk gone")
    assert b.batch_get(["a"], [page(0)]) == [False]
    assert b.batch_set(["a"], [page(0)]) == [False]
    assert b.batch_exists(["a"]) == 0
    st = b.stats()
    assert st.errors == 3 and st.get_misses == 1 and st.set_failures == 1
    # no probe: no breaker, the store is asked every time
    assert b.reachable and inner.calls == 3
    # the caller's mistakes still propagate
    inner.raise_next = ValueError("keys and slots differ")
    with pytest.raises(ValueError):
        b.batch_get(["a"], [page(0)])


def test_a_store_that_goes_away_trips_the_breaker_and_comes_back():
    inner = ProbedBackend(config())
    b = GuardedBackend(inner, probe_interval_s=0.01)
    assert b.set("a", page(3))
    inner.up.clear()
    inner.raise_next = ConnectionError("refused")
    assert b.exists("a") is False
    assert not b.reachable and "ConnectionError" in b.last_error
    calls = inner.calls
    out = torch.empty(PAGE, dtype=torch.uint8)
    assert b.get("a", out) is False and b.set("b", page(1)) is False
    assert b.batch_exists(["a"]) == 0
    b.clear()
    assert inner.calls == calls  # refused without a call into the store
    st = b.stats()
    assert st.errors == 1 and st.refused_calls == 4
    inner.raise_next = None
    inner.up.set()
    wait_until(lambda: b.reachable, "the probe never closed the breaker")
    assert b.get("a", out) and torch.equal(out, page(3))
    b.close()


def test_a_backend_reports_down_without_raising():
    class Reporting(ProbedBackend):
        def exists(self, key: str) -> bool:
            self.report.failed("rpc -900", down=not self.up.is_set())
            return False

    inner = Reporting(config())
    b = GuardedBackend(inner, probe_interval_s=0.01)
    assert not b.exists("a") and b.reachable  # an error, the store still up
    inner.up.clear()
    assert not b.exists("a") and not b.reachable
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

        def get(self, key: str, target: torch.Tensor) -> bool:
            self.barrier.wait()  # both threads inside their call at once
            if key == "bad":
                self.report.corrupt(1)
            self.barrier.wait()
            return key == "good"

    inner = Slow(config())
    b = guarded(inner)
    out = [torch.empty(PAGE, dtype=torch.uint8) for _ in range(2)]
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda k=k, o=o: results.__setitem__(k, b.get(k, o)))
               for k, o in zip(["good", "bad"], out, strict=True)]
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
    assert not b.timed_batches
    assert b.batch_get_until(["a"], [0], deadline=time.monotonic() - 1) == [False]
    assert b.inner.calls == 0  # past its deadline: nothing started
    st = b.stats()
    assert st.get_pages == 0 and st.errors == 0


def test_attributes_are_the_backends():
    inner = DictBackend(config())
    b = guarded(inner)
    b.raise_next = None  # the backend's attribute, set through the guard
    assert b.pages is inner.pages
    b.raise_next = KeyError("x")
    assert isinstance(inner.raise_next, KeyError)
    with pytest.raises(AttributeError):
        b.no_such_attribute  # noqa: B018
