"""Background L3 lookups (tiers/controller/probes.py) and the scheduler's use of
them: vLLM's scheduling thread gets "not known yet" instead of waiting on a slow
store, probes of several requests run side by side, and a known answer is used.

Stores are gated with events, so nothing here depends on how fast the machine is;
the timeouts only bound a broken test."""

from __future__ import annotations

from concurrent.futures import wait

from support.fakes import GatedStore, file_store, keys_of, request, write_prompt_pages

from hicache.tiers.controller.probes import L3Probes
from hicache.tiers.controller.scheduler import HiCacheScheduler
from hicache.tiers.controller.scheduler_policy import SchedulerPolicy
from hicache.tiers.index.page_keys import KeyNamespace
from hicache.tiers.l2.geometry import PoolGeometry
from hicache.tiers.l3.base import Capabilities

BS, PAGE = 4, 8
GEOM = PoolGeometry(num_slots=16, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("m", "f32", "cpu", PAGE, 1)
KEYS = keys_of(NS.seed(), list(range(100, 164)), PAGE)


def settle(probes: L3Probes, req_id, keys, store):
    """The answer once the probe is done (waits on its future, not on a clock)."""
    done, _ = wait([probes._probes[req_id].future], timeout=30)
    assert done, "probe never finished"
    return probes.result(req_id, keys, store)


def test_pending_probe_answers_none_then_the_store_answer_once():
    store = GatedStore(found=5)
    probes = L3Probes(fast_wait_s=0)
    assert probes.result("r", KEYS, store) is None
    store.entered(1)
    assert probes.result("r", KEYS, store) is None  # still asking: no second probe
    assert probes.started == 1
    store.gate.set()
    assert settle(probes, "r", KEYS, store) == (5, False)
    # Kept until forgotten: asked again (vLLM could not admit it yet), no new probe;
    # the L2 match grew by 2 pages: the store holds 3 of the rest.
    assert probes.result("r", KEYS, store) == (5, False)
    assert probes.result("r", KEYS[2:], store) == (3, False)
    assert probes.started == 1
    probes.forget("r")  # admitted
    assert probes.pending() == 0
    probes.close()


def test_arrival_does_not_wait_and_admission_waits_once(monkeypatch):
    """An arrival (wait=False) never waits; the first lookup that needs the answer
    waits up to fast_wait_s once, later ones of the same probe not at all (the
    waits are recorded, not timed)."""
    from hicache.tiers.controller import probes as module

    waits: list[float] = []
    monkeypatch.setattr(module, "futures_wait",
                        lambda futures, timeout: waits.append(timeout))
    store = GatedStore(found=5)
    probes = L3Probes(fast_wait_s=0.5)
    assert probes.result("r", KEYS, store, wait=False) is None
    assert waits == []
    assert probes.result("r", KEYS, store) is None  # admission: waits once
    assert probes.result("r", KEYS, store) is None  # the next step: not again
    assert waits == [0.5] and probes.started == 1
    store.gate.set()
    assert settle(probes, "r", KEYS, store) == (5, False)
    assert waits == [0.5]
    probes.close()


def test_probes_of_several_requests_run_side_by_side():
    store = GatedStore(found=8)
    probes = L3Probes(threads=6, fast_wait_s=0)
    for i in range(6):
        assert probes.result(f"r{i}", KEYS, store) is None
    store.entered(6)  # all six are inside the store at once, none answered yet
    store.gate.set()
    assert [settle(probes, f"r{i}", KEYS, store) for i in range(6)] == [(8, False)] * 6
    probes.close()


def test_another_run_or_store_replaces_the_probe_and_a_failing_store_is_a_miss():
    first, down = GatedStore(found=3), GatedStore(fail=True)
    probes = L3Probes(fast_wait_s=0)
    assert probes.result("r", KEYS, first) is None
    assert probes.result("r", KEYS[1:], first) is None  # a tail of the same run: kept
    assert probes.result("r", KEYS[:-1], first) is None  # not a tail: a new probe
    assert probes.result("r", KEYS[:-1], down) is None  # the store was swapped
    assert probes.started == 3
    down.gate.set()
    first.gate.set()
    assert settle(probes, "r", KEYS[:-1], down) == (0, True)
    probes.forget("r")
    probes.close()


def test_scheduler_answers_none_while_a_slow_store_is_asked(tmp_path):
    tokens = list(range(100, 133))  # 4 full pages + 1 token
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)
    store = GatedStore(file_store(tmp_path, NS, GEOM))
    sched = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [[]],
        storage=store,
        policy=SchedulerPolicy(background_lookups=True, prefetch={"prefetch_threshold": 0}))
    req = request("r", tokens)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    store.entered(1)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert sched.stats.l3_lookups == 1 and sched.stats.l3_lookups_pending == 2
    store.gate.set()
    assert wait([sched.fetches.probes._probes["r"].future], timeout=30).done
    assert sched.get_num_new_matched_tokens(req, 0) == (4 * PAGE, True)
    sched.update_state_after_alloc(req, [list(range(10, 18))], 4 * PAGE)
    (fetch,) = sched.build_connector_meta({}).fetches
    assert len(fetch.l3_pages) == 4
    sched.fetches.probes.close()


def test_stores_that_forbid_concurrent_lookups_are_asked_inline(tmp_path):
    tokens = list(range(100, 133))
    write_prompt_pages(tmp_path, NS, GEOM, tokens, PAGE)
    store = GatedStore(file_store(tmp_path, NS, GEOM))
    store.capabilities = Capabilities(concurrent_lookups=False)
    store.gate.set()
    sched = HiCacheScheduler(
        geometry=GEOM, namespace=NS, page_size=PAGE, block_size=BS, block_ids_of=lambda rid: [[]],
        storage=store,
        policy=SchedulerPolicy(background_lookups=True, prefetch={"prefetch_threshold": 0}))
    assert sched.get_num_new_matched_tokens(request("r", tokens), 0) == (4 * PAGE, True)
    assert sched.fetches.probes.started == 0
    sched.fetches.probes.close()
