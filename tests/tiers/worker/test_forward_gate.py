"""tiers/worker/forward_gate.py: work waits while a forward pass runs, on a CPU engine."""

from __future__ import annotations

import threading

from hicache.tiers.worker.forward_gate import ForwardGate


def test_work_waits_while_a_pass_runs_and_not_after():
    gate = ForwardGate(threading.Condition(), enabled=True, max_defer_s=3600.0)
    assert gate.wait_s() == 0.0  # no pass yet
    gate.started()
    assert 3500.0 < gate.wait_s() <= 3600.0
    assert gate.wait_s(stopping=True) == 0.0  # a stopping thread finishes its work
    gate.ended()
    assert gate.wait_s() == 0.0


def test_a_pass_longer_than_max_defer_lets_work_through():
    gate = ForwardGate(threading.Condition(), enabled=True, max_defer_s=0.0)
    gate.started()
    assert gate.wait_s() == 0.0


def test_off_on_a_gpu_engine():
    gate = ForwardGate(threading.Condition(), enabled=False)
    gate.started()
    assert gate.wait_s() == 0.0


def test_the_end_of_a_pass_wakes_the_waiting_thread():
    cv = threading.Condition()
    gate = ForwardGate(cv, enabled=True, max_defer_s=3600.0)
    gate.started()
    woke = threading.Event()

    def waiter() -> None:
        with cv:
            while gate.wait_s() > 0:
                cv.wait(gate.wait_s())
        woke.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not woke.wait(0.1)
    gate.ended()
    assert woke.wait(60)
    t.join()
