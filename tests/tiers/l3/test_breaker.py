"""The L3 circuit breaker (tiers/l3/breaker.py): opens on a failure, fails fast while its
probe says the store is down, closes on the first probe that answers, never reopens
once stopped. Driven by gates (events), not by timing."""

from __future__ import annotations

import threading

from hicache.tiers.l3.breaker import Breaker


class Store:
    """A probe whose answers the test decides; each call is signalled."""

    def __init__(self) -> None:
        self.up = threading.Event()
        self.asked = threading.Semaphore(0)
        self.calls = 0

    def probe(self) -> bool:
        self.calls += 1
        self.asked.release()
        if self.calls == 2:
            raise RuntimeError("a probe that raises counts as down")
        return self.up.is_set()


def wait_closed(breaker: Breaker) -> bool:
    done = threading.Event()

    def watch() -> None:
        while breaker.is_open:
            threading.Event().wait(0.001)
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    return done.wait(60)  # the bound only turns a hang into a failure


def test_opens_once_probes_until_the_store_answers_then_closes():
    store = Store()
    breaker = Breaker("test store", store.probe, interval_s=0.001)
    assert not breaker.is_open
    assert breaker.trip("rc=-900") is True
    assert breaker.is_open and breaker.reason == "rc=-900"
    assert breaker.trip("again") is False and breaker.reason == "rc=-900"  # one prober
    for _ in range(3):  # down, raising, down: still open
        assert store.asked.acquire(timeout=60)
    assert breaker.is_open
    store.up.set()
    assert wait_closed(breaker)
    calls = store.calls
    # closed: no more probing, and a new failure opens it again
    assert breaker.trip("rc=-901") is True and breaker.is_open
    while store.calls == calls:  # a new prober asks (permits left from before drain)
        assert store.asked.acquire(timeout=60)
    assert wait_closed(breaker)
    breaker.stop()


def test_a_stopped_breaker_never_opens():
    store = Store()
    breaker = Breaker("test store", store.probe, interval_s=0.001)
    breaker.stop()
    assert breaker.stopped
    assert breaker.trip("rc=-900") is False
    assert not breaker.is_open and store.calls == 0
