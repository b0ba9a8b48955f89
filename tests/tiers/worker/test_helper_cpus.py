"""tiers/worker/helper_cpus.py: where the worker's L3 threads run beside vLLM's forward
pass; the placement rules on made-up hosts, and real threads pinned by a real worker
(pool and file L3 under tmp_path) whose forward thread is pinned as vLLM pins it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from support.threads import in_thread

from hicache.tiers.config import HiCacheConfig, HiCacheConfigError
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, StepPlan
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.worker.core import HiCacheWorker
from hicache.tiers.worker.helper_cpus import omp_team, place_helpers

CPUS16 = frozenset(range(16))
NODES = {0: frozenset(range(8)), 1: frozenset(range(8, 16))}


def test_the_setting_is_checked_naming_the_key_and_what_it_allows():
    assert HiCacheConfig.from_extra_config({}).hicache_helper_cpus == "auto"
    assert HiCacheConfig.from_extra_config(
        {"hicache_helper_cpus": "2-3,6"}).hicache_helper_cpus == "2-3,6"
    with pytest.raises(HiCacheConfigError, match=r"hicache_helper_cpus.*auto, inherit or a "
                                                 r"CPU list.*'two'"):
        HiCacheConfig.from_extra_config({"hicache_helper_cpus": "two"})


def test_the_openmp_team_is_read_as_vllm_writes_it_for_each_runtime():
    assert omp_team({"GOMP_CPU_AFFINITY": "0 1"}) == {0, 1}  # libgomp (this VM)
    assert omp_team({"GOMP_CPU_AFFINITY": "0-6:2 9"}) == {0, 2, 4, 6, 9}
    assert omp_team({"OMP_PLACES": "{4,5,6}", "OMP_PROC_BIND": "true"}) == {4, 5, 6}
    assert omp_team({"OMP_PLACES": "{0:2},{8}"}) == {0, 1, 8}
    assert omp_team({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3,7-8]"}) \
        == {2, 3, 7, 8}  # Intel's OpenMP
    assert omp_team({}) is None
    assert omp_team({"OMP_PLACES": "cores"}) is None  # abstract places: not a CPU list
    assert omp_team({"GOMP_CPU_AFFINITY": "zero"}) is None


def test_auto_takes_cores_no_forward_pass_uses_and_then_drops_the_gate():
    # A rank on 0-6 of a 16-CPU, two-node host, with one core of its node reserved.
    p = place_helpers("auto", frozenset({0}), frozenset(range(7)), "auto", CPUS16, NODES)
    assert p.cpus == {7} and not p.shares_forward  # not node 1's: rank 1 computes there
    # An explicit bind: no rank's cores, whichever node.
    p = place_helpers("auto", frozenset({0}), frozenset(range(6)), "0-5|8-13", CPUS16, {})
    assert p.cpus == {6, 7, 14, 15} and not p.shares_forward
    # No team in the environment: the forward thread's own CPUs are the pass's.
    p = place_helpers("auto", frozenset({0}), None, None, frozenset({0, 1}), {})
    assert p.cpus == {1} and not p.shares_forward


def test_hyperthreads_of_the_teams_cores_come_after_free_cores_and_keep_the_gate():
    # 8 cores x 2 hyperthreads (CPU n and n + 8 share a core); vLLM's team takes one
    # thread of cores 0-5, leaving cores 6-7 whole and the siblings 8-13.
    online = frozenset(range(16))
    siblings = {cpu: frozenset({cpu % 8, cpu % 8 + 8}) for cpu in online}
    team = frozenset(range(6))
    p = place_helpers("auto", frozenset({0}), team, None, online, {}, siblings)
    assert p.cpus == {6, 7, 14, 15} and not p.shares_forward
    # Every core in the team: only its hyperthreads are left, and they share its cores.
    p = place_helpers("auto", frozenset({0}), frozenset(range(8)), None, online, {}, siblings)
    assert p.cpus == set(range(8, 16)) and p.shares_forward


def test_auto_takes_the_teams_other_cores_where_none_is_spare_and_keeps_the_gate():
    # This VM: vLLM's team on both cores ("auto", GOMP_CPU_AFFINITY="0 1"), the forward
    # thread on CPU 0: the other core idles between passes.
    p = place_helpers("auto", frozenset({0}), frozenset({0, 1}), None, frozenset({0, 1}),
                      {0: frozenset({0, 1})})
    assert p.cpus == {1} and p.shares_forward  # backups wait for the gaps
    # TP=2 over two cores, one thread each: nothing beside the forward thread.
    tp2 = place_helpers("auto", frozenset({0}), frozenset({0}), "0|1", frozenset({0, 1}), {})
    unbound = place_helpers("auto", frozenset({0, 1}), None, "nobind", frozenset({0, 1}), {})
    for p in (tp2, unbound):
        assert p.cpus == frozenset() and p.shares_forward
    assert "nobind" in unbound.why


def test_a_list_is_taken_as_given_and_inherit_pins_nothing():
    team = frozenset(range(8))
    p = place_helpers("12-13", frozenset({0}), team, None, CPUS16, NODES)
    assert p.cpus == {12, 13} and not p.shares_forward
    assert place_helpers("6-9", frozenset({0}), team, None, CPUS16, NODES).shares_forward
    p = place_helpers("inherit", frozenset({0}), None, None, frozenset({0, 1}), {})
    assert p.cpus == frozenset() and p.shares_forward


GEOM = PoolGeometry(num_slots=4, num_layers=1, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 1)
LAYER = "model.layers.0.self_attn.attn"


def _worker(tmp_path: Path, helper_cpus: str, built_on: list | None = None) -> HiCacheWorker:
    def build(name: str, extra: dict) -> FileBackend:
        if built_on is not None:
            built_on.append(os.sched_getaffinity(0))
        return guarded(FileBackend(StorageConfig(0, 1, NS.fingerprint(), "page_first",
                                                 GEOM.page_bytes, extra_config=extra)))

    return HiCacheWorker(GEOM, 8, layout="page_first", storage_builder=build,
                         storage_spec=("file", {"path": str(tmp_path)}),
                         group_layer_names=[[LAYER]], helper_cpus=helper_cpus)


def _register_on_a_pinned_forward_thread(w: HiCacheWorker, forward: frozenset[int]) -> None:
    def register() -> None:
        os.sched_setaffinity(0, forward)  # as vLLM's CPU worker pins its forward thread
        w.register_kv_caches({LAYER: torch.zeros(8, 16)})  # CPU tensors: a CPU engine

    in_thread(register)


def _l3_thread_cpus(w: HiCacheWorker) -> set[int]:
    io = w.storage_io
    assert io is not None
    tid = io._thread.native_id
    assert tid is not None
    return os.sched_getaffinity(tid)


def _no_team(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "GOMP_CPU_AFFINITY", "OMP_PLACES",
                 "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to leave one "
                    "to the forward pass")
def test_a_cpu_worker_runs_its_l3_threads_off_the_forward_thread_s_core(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """vLLM pins the forward thread and writes its team into the environment; the L3
    threads and the backend's construction go elsewhere, with the gate where that is
    still the team's."""
    _no_team(monkeypatch)
    cpus = sorted(os.sched_getaffinity(0))
    forward = frozenset(cpus[:1])
    built_on: list[set[int]] = []
    w = _worker(tmp_path, "auto", built_on)  # a team of one: the rest is spare
    try:
        _register_on_a_pinned_forward_thread(w, forward)
        assert w.placement is not None and w.placement.team == forward
        assert _l3_thread_cpus(w) == set(cpus[1:])
        assert built_on == [set(cpus[1:])]  # a client's own threads would run there too
        io = w.storage_io
        assert io is not None and not io.gate.enabled  # nothing to yield: no team there
    finally:
        w.shutdown()
    monkeypatch.setenv("GOMP_CPU_AFFINITY", " ".join(map(str, cpus)))  # a team on all
    w = _worker(tmp_path, "auto")
    try:
        _register_on_a_pinned_forward_thread(w, forward)
        assert _l3_thread_cpus(w) == set(cpus[1:])
        io = w.storage_io
        assert io is not None and io.gate.enabled  # the team's cores: between passes
    finally:
        w.shutdown()
    w = _worker(tmp_path, "inherit")
    try:
        _register_on_a_pinned_forward_thread(w, forward)
        assert _l3_thread_cpus(w) == set(forward)
        io = w.storage_io
        assert io is not None and io.gate.enabled  # it shares the core: backups wait
    finally:
        w.shutdown()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to leave one "
                    "to the forward pass")
def test_the_copy_thread_of_async_stores_runs_off_the_forward_core_too(
        monkeypatch: pytest.MonkeyPatch):
    _no_team(monkeypatch)
    cpus = sorted(os.sched_getaffinity(0))
    (key,) = page_keys(NS.seed(), list(range(9)), 8)
    w = HiCacheWorker(GEOM, 8, layout="page_first", group_layer_names=[[LAYER]],
                      async_stores=True)
    try:
        _register_on_a_pinned_forward_thread(w, frozenset(cpus[:1]))
        # The copy thread starts with the first copy queued on it.
        in_thread(lambda: w.finish_step(StepPlan(stores=[PagePlan(0, key, 0, (2, 3))],
                                                  seq=1)))
        (copy_thread,) = [t for t in threading.enumerate() if t.name.startswith("hicache-copy")]
        assert copy_thread.native_id is not None
        assert os.sched_getaffinity(copy_thread.native_id) == set(cpus[1:])
    finally:
        w.shutdown()
