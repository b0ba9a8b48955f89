"""The step profile's engine-free parts: hook clocks on an injected clock, per-thread
CPU clocks, and records appended as whole lines by several writers at once."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading

import pytest

from hicache.tiers.profile import (
    PROFILE_ENV,
    GcClock,
    HookClock,
    ProfileWriter,
    ThreadClock,
    profile_path,
)


def test_profiling_is_off_unless_the_variable_names_a_file(monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert profile_path() is None
    monkeypatch.setenv(PROFILE_ENV, "  ")
    assert profile_path() is None
    monkeypatch.setenv(PROFILE_ENV, "/tmp/p.jsonl")
    assert profile_path() == "/tmp/p.jsonl"


def test_hook_clock_sums_calls_and_seconds_until_taken():
    now = [0.0]

    def clock() -> float:
        return now[0]

    def hook(seconds: float) -> str:
        now[0] += seconds
        return "done"

    hooks = HookClock(clock)
    assert hooks.call("a", hook, 0.25) == "done"
    hooks.call("a", hook, 0.5)
    hooks.call("b", hook, 1.0)
    assert hooks.take() == {"a": [2, 0.75], "b": [1, 1.0]}
    assert hooks.take() == {}
    try:
        hooks.call("c", lambda: 1 / 0)
    except ZeroDivisionError:
        pass
    assert hooks.take() == {"c": [1, 0.0]}  # a hook that raised is still counted


def test_gc_clock_counts_collections_per_generation_and_their_seconds():
    """Real collections (automatic ones off meanwhile, so the counts are exact), timed
    on an injected clock that moves 1 s per reading."""
    ticks = iter(range(1000))
    clock = GcClock(lambda: float(next(ticks)))
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect(2)
        gc.collect(0)
        assert clock.take() == {"s": 2.0, "collections": [1, 0, 1]}
        assert clock.take() == {"s": 0.0, "collections": [0, 0, 0]}
    finally:
        if enabled:
            gc.enable()
        clock.close()
    assert clock._on_gc not in gc.callbacks
    gc.collect(1)
    assert clock.take()["collections"] == [0, 0, 0]  # closed: no longer counting
    clock.close()  # twice is harmless


def test_thread_clock_tells_hicache_threads_from_the_calling_thread():
    clock = ThreadClock()
    clock.delta()
    worked, stop = threading.Event(), threading.Event()

    def spin() -> None:
        x = 0
        while x < 2_000_000:
            x += 1
        worked.set()
        stop.wait(30)

    helper = threading.Thread(target=spin, name="hicache-test-helper")
    other = threading.Thread(target=spin, name="not-ours")
    helper.start()
    assert worked.wait(60)
    sum(range(300_000))  # the calling thread works too
    d = clock.delta()  # the helper is alive (waiting): its CPU is counted
    assert d["hicache_threads"] > 0 and d["thread"] > 0
    assert d["hicache_by_thread"] == {"hicache-test-helper": d["hicache_threads"]}
    assert d["process"] >= d["thread"] + d["hicache_threads"] - 1e-3
    worked.clear()
    other.start()
    assert worked.wait(60)
    d = clock.delta()  # a thread not named hicache-* is not HiCache's
    assert d["hicache_threads"] < d["process"]
    stop.set()
    helper.join()
    other.join()
    assert set(d) == {"thread", "hicache_threads", "hicache_by_thread", "process",
                      "thread_waited"}


def test_thread_clock_groups_a_pools_threads_into_one_family():
    clock = ThreadClock()
    go, stop = threading.Event(), threading.Event()
    done = [threading.Event(), threading.Event()]

    def spin(i: int) -> None:
        go.wait(30)
        x = 0
        while x < 1_000_000:
            x += 1
        done[i].set()
        stop.wait(30)

    pool = [threading.Thread(target=spin, args=(i,), name=f"hicache-pool-fetch_{i}")
            for i in range(2)]
    for t in pool:
        t.start()
    clock.delta()
    go.set()
    assert all(e.wait(60) for e in done)
    d = clock.delta()
    stop.set()
    for t in pool:
        t.join()
    assert set(d["hicache_by_thread"]) == {"hicache-pool-fetch"}
    assert d["hicache_by_thread"]["hicache-pool-fetch"] == pytest.approx(d["hicache_threads"])


APPEND = """
import sys
from hicache.tiers.profile import ProfileWriter
w = ProfileWriter(sys.argv[1], "worker", "X")
for i in range(300):
    w.write({"seq": i, "pad": "x" * 200})
w.close()
"""


def test_records_from_several_processes_stay_whole_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", APPEND, str(path)]) for _ in range(3)]
    mine = ProfileWriter(str(path), "scheduler", "Y")
    for i in range(300):
        mine.write({"seq": i})
    mine.close()
    assert all(p.wait(120) == 0 for p in procs)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 4 * 300
    assert sum(r["role"] == "worker" and r["connector"] == "X" for r in records) == 900


def test_an_unwritable_profile_warns_once_and_stops(tmp_path, caplog):
    w = ProfileWriter(str(tmp_path / "no" / "such" / "dir.jsonl"), "worker")
    w.write({"seq": 1})
    w.write({"seq": 2})
    assert sum("cannot be written" in r.message for r in caplog.records) == 1
