"""End to end on the CPU vLLM engine: L3 survives restarts, is shared, and never serves wrong KV.

Engine A serves the first turn with L3 on and stops. Later engines are
fresh processes with an empty L2 and vLLM's prefix cache off, so every
cached token they report on a returning turn came from L3. Their greedy
tokens must equal the no-connector baseline whatever happened to L3:
restart (B), damaged pages (C), pages deleted between lookup and read (E),
a slow store under the ``timeout`` policy (D, in-process to read its stats).
"""

from __future__ import annotations

import random
import shutil
from concurrent.futures import wait
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, MAX_MODEL_LEN, SMALL_L1_BLOCKS, WORKLOAD, history_lengths

from hicache.integration.bench.multi_turn import run_turns
from hicache.integration.vllm.engine import (
    EngineSpec,
    close_llm,
    greedy_params,
    open_llm,
    scheduler_connector,
    worker_connector,
)
from hicache.tiers.l3 import integrity
from hicache.tiers.worker.l3_io import BATCH_PAGES

pytestmark = pytest.mark.engine

FAULTY = {"module_path": "support.fault_injection", "class_name": "FaultyFileBackend"}


def engine(tiny_model: str, backend: str, extra: dict, *, in_process: bool = False,
           max_num_seqs: int = 8, **more):
    return open_llm(EngineSpec(
        model=tiny_model, prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=SMALL_L1_BLOCKS, max_model_len=MAX_MODEL_LEN, in_process=in_process,
        max_num_seqs=max_num_seqs,
        hicache={"hicache_size": 0.05, "hicache_storage_backend": backend,
                 "hicache_storage_backend_extra_config": extra, **more},
    ))


def serve_turn(llm, baseline, turn: int):
    want = baseline.turns[turn]
    return run_turns(llm, want.prompts, WORKLOAD.answer_tokens)


def history_pages(baseline, turn: int) -> list[int]:
    """Tokens of each returning history that have KV in full pages (all but the last)."""
    return [(h - 1) // BLOCK_SIZE * BLOCK_SIZE for h in history_lengths(baseline, turn)]


@pytest.fixture(scope="module")
def written(tiny_model, baseline, tmp_path_factory) -> Path:
    """Engine A: turn 1 with the file L3 on; its pages are on disk once it stops."""
    path = tmp_path_factory.mktemp("l3-file")
    llm = engine(tiny_model, "file", {"path": str(path)}, in_process=True)
    try:
        got = serve_turn(llm, baseline, 0)
    finally:
        close_llm(llm)
    assert got.outputs == baseline.turns[0].outputs
    pristine = tmp_path_factory.mktemp("l3-pristine")
    shutil.copytree(path, pristine, dirs_exist_ok=True)
    return pristine


def copy_of(src: Path, tmp_path_factory, name: str) -> Path:
    dst = tmp_path_factory.mktemp(name)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def test_engine_a_backed_up_every_page(written, baseline):
    files = list((written / "pages").rglob("*.page"))
    # Page records (a span object holds several: object_mib, 1 MiB by default).
    pages = sum(f.read_bytes().count(integrity.MAGIC) for f in files)
    assert len(files) < pages, "no span objects were written"
    # Each conversation's prompt and answer pages (the shared prompt once).
    assert pages >= sum(history_pages(baseline, 1)) // BLOCK_SIZE * 0.9
    assert not list((written / "tmp").iterdir()), "temp files left behind"


def test_restarted_engine_serves_returning_turns_from_l3(tiny_model, baseline, written,
                                                         tmp_path_factory):
    path = copy_of(written, tmp_path_factory, "l3-restart")
    llm = engine(tiny_model, "file", {"path": str(path)}, in_process=True,
                 hicache_storage_prefetch_policy="wait_complete")
    try:
        got = serve_turn(llm, baseline, 1)
        third = serve_turn(llm, baseline, 2)
    finally:
        close_llm(llm)
    assert got.outputs == baseline.turns[1].outputs
    assert third.outputs == baseline.turns[2].outputs
    # Empty L2, no vLLM prefix cache: every cached token came from L3, and each
    # response says so.
    assert got.num_cached_tokens == history_pages(baseline, 1)
    assert [p["hicache"]["cached_tokens"] for p in got.kv_transfer_params] == [
        {"l1": 0, "l2": 0, "l3": n} for n in got.num_cached_tokens]
    assert not list((path / "quarantine").iterdir())


def test_corrupt_and_truncated_pages_are_recomputed(tiny_model, baseline, written,
                                                    tmp_path_factory):
    """Two thirds of the stored pages damaged (bytes flipped, files truncated): every
    damaged page that a lookup reaches is read, rejected, quarantined and recomputed.
    (Pages deleted before or during a run: test_pages_deleted_between_lookup_and_read.)"""
    path = copy_of(written, tmp_path_factory, "l3-corrupt")
    pages = sorted((path / "pages").rglob("*.page"))
    rng = random.Random(3)
    rng.shuffle(pages)
    third = len(pages) // 3
    flipped, truncated = pages[:third], pages[third : 2 * third]
    for f in flipped:
        data = bytearray(f.read_bytes())
        data[rng.randrange(128, len(data))] ^= 0xFF
        f.write_bytes(bytes(data))
    for f in truncated:
        f.write_bytes(f.read_bytes()[: rng.randrange(1, f.stat().st_size)])
    llm = engine(tiny_model, "file", {"path": str(path)}, in_process=True,
                 hicache_storage_prefetch_policy="wait_complete")
    try:
        got = serve_turn(llm, baseline, 1)
    finally:
        close_llm(llm)
    assert got.outputs == baseline.turns[1].outputs
    quarantined = list((path / "quarantine").iterdir())
    assert quarantined, "no damaged page was read"
    assert len(quarantined) <= len(flipped) + len(truncated)
    # (num_cached_tokens is not checked: vLLM reports what was promised at
    # admission, and it re-counts only a request whose load failed at its very
    # first block, so whether it drops depends on which pages the shuffle hit.)


def test_pages_deleted_between_lookup_and_read(tiny_model, baseline, written, tmp_path_factory):
    path = copy_of(written, tmp_path_factory, "l3-vanish")
    llm = engine(tiny_model, "dynamic",
                 {**FAULTY, "path": str(path), "fault_delete_after_exists": True},
                 in_process=True)
    try:
        got = run_turns(llm, baseline.turns[1].prompts[:3], WORKLOAD.answer_tokens)
        counters = worker_connector().hicache_worker.counters()
    finally:
        close_llm(llm)
    assert got.outputs == baseline.turns[1].outputs[:3]
    # Every page vanished between the lookup and its read: nothing came from L3,
    # the reads failed and were recomputed. (How many tokens each request then
    # got from L2 depends on the order in which their background lookups
    # answered, so num_cached_tokens is not checked.)
    assert counters["l3_fetched_pages"] == 0
    assert counters["l3_fetch_failed_pages"] > 0
    assert not list((path / "quarantine").iterdir())


class TestSlowStoreUnderTimeout:
    """A store that takes 0.6 s per read batch, a 0.25 s deadline: the wait ends at
    the deadline plus the batch already in flight, the rest is recomputed. This is
    the fetch at admission (prefetch at arrival off; TestPrefetchAtArrival has it on)."""

    DELAY = 0.6
    DEADLINE = 0.25

    @pytest.fixture(scope="class")
    def run(self, tiny_model, baseline, written, tmp_path_factory):
        path = copy_of(written, tmp_path_factory, "l3-slow")
        extra = {**FAULTY, "path": str(path), "fault_get_delay_s": self.DELAY,
                 "prefetch_timeout_base": self.DEADLINE, "prefetch_timeout_per_ki_token": 0}
        llm = engine(tiny_model, "dynamic", extra, in_process=True,
                     hicache_storage_prefetch_policy="timeout",
                     hicache_prefetch_at_arrival=False)
        try:
            got = run_turns(llm, baseline.turns[1].prompts[:3], WORKLOAD.answer_tokens,
                            one_by_one=True)
            yield got, worker_connector().hicache_worker
        finally:
            close_llm(llm)

    def test_tokens_identical(self, run, baseline):
        got, _ = run
        assert got.outputs == baseline.turns[1].outputs[:3]

    def test_deadline_is_honoured(self, run, baseline):
        got, worker = run
        stats = worker.storage_io.stats
        assert stats.fetches == 3 and stats.fetch_deadline_misses == 3
        # The wait ended at the deadline plus at most the one batch in flight
        # (counted, not timed: the suite never asserts on how busy the machine is;
        # a fetch whose thread started past its deadline reads nothing, and the
        # batch-in-flight rule itself is tests/tiers/worker/test_l3_io.py's, on an
        # injected clock). The rest was never read (late pages, not failed ones:
        # the store answered nothing wrong), reported as load errors and
        # recomputed. (vLLM's num_cached_tokens keeps the promised count even when
        # a load fails, so it is not used.)
        assert stats.fetched_pages <= 3 * BATCH_PAGES
        assert stats.fetch_late_pages > 0 and stats.fetch_failed_pages == 0
        assert worker.stats.load_errors > 0

    def test_idle_steps_wait_for_the_fetch_instead_of_spinning(self, run):
        # Each request waited alone: every step meanwhile computed nothing, so
        # the worker blocked on the fetch (GIL released) and saw each one end.
        _, worker = run
        assert worker.stats.idle_fetch_waits == worker.storage_io.stats.fetches == 3


class TestPrefetchAtArrival:
    """A returning conversation whose history only L3 holds arrives while another
    request decodes and every run slot is taken (max_num_seqs=1): it queues, and
    its prefetch reads the history into L2 meanwhile. The test steps the engine by
    hand and lets it go on only once the worker's I/O thread has read the pages
    (a wait on that thread, not on a clock), while the decode has many steps to go.
    Under ``best_effort``, which never waits, the request is then admitted with
    its whole history in L2 and loads it synchronously: no fetch at admission."""

    DECODE_TOKENS = 120

    @pytest.fixture(scope="class")
    def run(self, tiny_model, baseline, written, tmp_path_factory):
        path = copy_of(written, tmp_path_factory, "l3-arrival")
        llm = engine(tiny_model, "file", {"path": str(path)}, in_process=True,
                     max_num_seqs=1, hicache_storage_prefetch_policy="best_effort")
        eng = llm.llm_engine
        sched = scheduler_connector(llm).hicache_scheduler
        worker = worker_connector().hicache_worker
        # Not a history anyone stored: its keys chain from its first token.
        decode = list(reversed(baseline.turns[0].prompts[0]))
        returning = baseline.turns[1].prompts[1]
        finished: dict[str, list[int]] = {}
        cached: dict[str, int] = {}

        def step() -> None:
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
                    cached[out.request_id] = int(out.num_cached_tokens or 0)

        try:
            eng.add_request("decode", {"prompt_token_ids": decode},
                            greedy_params(self.DECODE_TOKENS))
            step()
            eng.add_request("returning", {"prompt_token_ids": returning},
                            greedy_params(WORKLOAD.answer_tokens))
            probes = sched.fetches.probes._probes
            for future in [p.future for rid, p in probes.items() if "returning" in rid]:
                assert wait([future], timeout=60).done  # its arrival lookup answered
            step()
            while sched.stats.prefetches == 0 and not finished:
                step()  # until a plan carried the prefetch to the worker
            io = worker.storage_io
            if io.stats.fetches == 0:  # not read yet: wait for the I/O thread
                assert io.wait_results(60), "the prefetch never finished"
            # Then steps until the scheduler has the worker's report and ended the
            # prefetch (a count of steps, one or two, whatever the machine's speed).
            while sched.fetches.in_flight and not finished:
                step()
            queued_while_prefetched = not finished
            while eng.has_unfinished_requests():
                step()
            yield finished, cached, queued_while_prefetched, sched, worker
        finally:
            close_llm(llm)

    def test_tokens_identical(self, run, baseline):
        finished, _, queued, _, _ = run
        assert queued, "the decode ended before the prefetch: the scenario did not happen"
        (returning,) = [v for k, v in finished.items() if "returning" in k]
        assert returning == baseline.turns[1].outputs[1]

    def test_history_was_in_l2_when_admitted(self, run, baseline):
        _, cached, _, sched, worker = run
        pages = history_pages(baseline, 1)[1] // BLOCK_SIZE
        (tokens,) = [v for k, v in cached.items() if "returning" in k]
        st = sched.stats
        assert tokens == pages * BLOCK_SIZE, (vars(st), vars(worker.storage_io.stats))
        assert st.prefetches == 1 and st.prefetch_pages == pages
        # It never waited and never needed a fetch at admission: the one L3 read
        # was the prefetch, and its pages were loaded from L2 synchronously.
        assert st.prefetch_waits == 0 and st.prefetch_late == 0
        assert worker.storage_io.stats.fetches == 1
        assert worker.storage_io.stats.fetched_pages == pages
        assert st.loaded_pages == pages and not sched.fetches.in_flight
        assert st.l3_hit_pages == pages and st.l2_hit_pages == 0  # where it was on arrival


class TestSlowStorePrefetchUnderTimeout:
    """Prefetch at arrival with the 0.6 s-per-batch store and a 0.25 s deadline:
    each request waits for its prefetch (vLLM told None) and goes on without it at
    the deadline; the worker stops the prefetch after the batch in flight, whose
    pages stay in L2. Tokens identical."""

    @pytest.fixture(scope="class")
    def run(self, tiny_model, baseline, written, tmp_path_factory):
        path = copy_of(written, tmp_path_factory, "l3-slow-prefetch")
        extra = {**FAULTY, "path": str(path), "fault_get_delay_s": 0.6,
                 "prefetch_timeout_base": 0.25, "prefetch_timeout_per_ki_token": 0}
        llm = engine(tiny_model, "dynamic", extra, in_process=True,
                     hicache_storage_prefetch_policy="timeout")
        try:
            got = run_turns(llm, baseline.turns[1].prompts[:3], WORKLOAD.answer_tokens,
                            one_by_one=True)
            connector = worker_connector()
            # A request that went on without its prefetch can finish before the
            # fetch ends (a fetch counts when it ends): wait for them all.
            assert connector.hicache_worker.storage_io.wait_fetches(60)
            yield got, scheduler_connector(llm).hicache_scheduler, connector
        finally:
            close_llm(llm)

    def test_tokens_identical(self, run, baseline):
        got, _, _ = run
        assert got.outputs == baseline.turns[1].outputs[:3]

    def test_requests_waited_and_the_worker_stopped_at_the_deadline(self, run):
        _, sched, connector = run
        io = connector.hicache_worker.storage_io.stats
        assert sched.stats.prefetches == 3 and sched.stats.prefetch_waits > 0
        # Every prefetch handed to the worker ended at its deadline (none was
        # cancelled before it: its request waited for it first).
        assert sched.stats.prefetch_cancelled == 0
        assert io.fetches == 3 and io.fetch_deadline_misses == 3
        # Each read at most its batch in flight; one queued behind the one before
        # past its own deadline read nothing.
        assert io.fetched_pages <= io.fetches * BATCH_PAGES


class TestSlowLookups:
    """A store whose ``exists_prefix`` takes 1 s. vLLM's scheduling thread never
    asks it: every lookup runs on a probe thread while vLLM is told "not known
    yet" and keeps stepping, and requests submitted together are looked up side
    by side, once each (counted, not timed)."""

    DELAY = 1.0
    REQUESTS = 4

    @pytest.fixture(scope="class")
    def run(self, tiny_model, baseline, written, tmp_path_factory):
        path = copy_of(written, tmp_path_factory, "l3-slow-lookup")
        extra = {**FAULTY, "path": str(path), "fault_exists_delay_s": self.DELAY}
        llm = engine(tiny_model, "dynamic", extra, in_process=True,
                     hicache_storage_prefetch_policy="wait_complete")
        try:
            got = run_turns(llm, baseline.turns[1].prompts[: self.REQUESTS],
                            WORKLOAD.answer_tokens)
            sched = scheduler_connector(llm).hicache_scheduler
            shards = getattr(sched.storage, "shards", [sched.storage])
            yield got, sched, [name for shard in shards for name in shard.inner.exists_threads]
        finally:
            close_llm(llm)

    def test_tokens_identical(self, run, baseline):
        got, _, _ = run
        assert got.outputs == baseline.turns[1].outputs[: self.REQUESTS]

    def test_lookups_run_off_the_scheduling_thread_once_per_request(self, run):
        _, sched, threads = run
        assert threads and all(t.startswith("hicache-probe") for t in threads), threads
        # One lookup each (two if its L2 match moved); a lookup asks the store once per
        # run of span objects and once per span stored page by page (spans.py).
        assert sched.stats.l3_lookups <= 2 * self.REQUESTS
        assert sched.stats.l3_lookups_pending > 0  # vLLM was told "not known yet"
        assert sched.stats.l3_fetched_pages > 0  # and the hits were still served


def restart_round_trip(tiny_model, baseline, backend: str, extra: dict, conversations: int = 3):
    """Engine A serves turn 1 of a few conversations and stops; engine B (empty L2)
    serves their turn 2. Returns B's turn."""
    want0, want1 = baseline.turns[0], baseline.turns[1]
    # In-process engines (a third of a separate process's start): each is a new
    # connector with an empty L2, so B's hits can only come from L3.
    llm = engine(tiny_model, backend, extra, in_process=True)
    try:
        first = run_turns(llm, want0.prompts[:conversations], WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    assert first.outputs == want0.outputs[:conversations]
    llm = engine(tiny_model, backend, extra, in_process=True,
                 hicache_storage_prefetch_policy="wait_complete")
    try:
        second = run_turns(llm, want1.prompts[:conversations], WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    assert second.outputs == want1.outputs[:conversations]
    return second


def test_nixl_restart_serves_from_l3(tiny_model, baseline, tmp_path):
    got = restart_round_trip(tiny_model, baseline, "nixl", {"path": str(tmp_path)})
    assert got.num_cached_tokens == history_pages(baseline, 1)[:3]
    assert not list((tmp_path / "quarantine").glob("*"))


def test_a_store_written_to_sglangs_interface_serves_l3_hits(tiny_model, baseline, tmp_path):
    """A class with SGLang's HiCacheStorage methods (get / set / exists on tensors), loaded
    through ``dynamic`` as SGLang loads one, behind tiers/l3/sglang_compat.py."""
    extra = {"module_path": "support.sglang_style_store", "class_name": "SGLangStyleFileStore",
             "path": str(tmp_path)}
    got = restart_round_trip(tiny_model, baseline, "dynamic", extra)
    assert got.num_cached_tokens == history_pages(baseline, 1)[:3]
    # Empty L2 and L1 at start: all from L3 (a prefix the first fetch brought into L2
    # is an L2 hit for the others).
    tiers = [p["hicache"]["cached_tokens"] for p in got.kv_transfer_params]
    assert [t["l2"] + t["l3"] for t in tiers] == got.num_cached_tokens
    assert tiers[0] == {"l1": 0, "l2": 0, "l3": got.num_cached_tokens[0]}
    assert list(tmp_path.glob("*.bin")), "the store holds no page of its own"


@pytest.fixture(scope="module")
def mooncake():
    from hicache.integration.bench.mooncake_service import start_mooncake

    with start_mooncake() as service:
        service.start_segment_holder(512 << 20)
        yield service


def test_mooncake_restart_serves_from_l3(tiny_model, baseline, mooncake):
    # Engines contribute no store memory: pages live in the holder, like a
    # standalone Mooncake store, and survive engine A.
    got = restart_round_trip(tiny_model, baseline, "mooncake",
                             mooncake.extra_config(global_segment_size=0))
    assert got.num_cached_tokens == history_pages(baseline, 1)[:3]


def test_mooncake_master_killed_mid_run(tiny_model, baseline, mooncake):
    """The store goes down between turns: lookups and backups fail fast, vLLM
    recomputes, tokens stay identical and the engine keeps serving."""
    want0, want1 = baseline.turns[0], baseline.turns[1]
    llm = engine(tiny_model, "mooncake", mooncake.extra_config(global_segment_size=0),
                 hicache_storage_prefetch_policy="wait_complete")
    try:
        first = run_turns(llm, want0.prompts[3:6], WORKLOAD.answer_tokens)
        mooncake.kill_master()
        second = run_turns(llm, want1.prompts[3:6], WORKLOAD.answer_tokens)
        again = run_turns(llm, want1.prompts[6:7], WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
        if not mooncake.master_alive():
            mooncake.restart_master()  # an empty store for whatever runs next
    assert first.outputs == want0.outputs[3:6]
    assert second.outputs == want1.outputs[3:6]
    assert again.outputs == want1.outputs[6:7]
    # That the breaker stops further calls from waiting on the dead master is
    # checked call by call in tests/tiers/l3/mooncake/test_mooncake_backend.py.


def test_mooncake_reads_from_the_engines_own_segment_in_place(tiny_model, baseline):
    """An engine that contributes store memory, alone on its master: every page it backs
    up lies in its own segment, so with L2 flushed the returning turn is read in place
    (one copy-and-check pass), and tokens equal the baseline. (Pages in another
    process's segment go through Mooncake's transfer: the restart test above, and
    tests/tiers/l3/mooncake/test_mooncake_spans.py with both kinds in one batch.)"""
    from hicache.integration.bench.mooncake_service import start_mooncake

    want0, want1 = baseline.turns[0], baseline.turns[1]
    with start_mooncake() as own:
        llm = engine(tiny_model, "mooncake", own.extra_config(global_segment_size=256 << 20),
                     in_process=True, hicache_storage_prefetch_policy="wait_complete")
        try:
            first = run_turns(llm, want0.prompts[6:9], WORKLOAD.answer_tokens)
            worker = worker_connector().hicache_worker
            assert worker.storage_io is not None
            # Every backup handed over (a gate on the queue, not a timer; the bound only
            # turns a hang into a failure).
            assert worker.storage_io.wait_backups(timeout_s=120)
            scheduler_connector(llm)._admin.flush(["l2"], None, None)
            second = run_turns(llm, want1.prompts[6:9], WORKLOAD.answer_tokens)
            counters = worker.counters()
        finally:
            close_llm(llm)
    assert first.outputs == want0.outputs[6:9]
    assert second.outputs == want1.outputs[6:9]
    assert sum(p["hicache"]["cached_tokens"]["l3"] for p in second.kv_transfer_params) > 0
    assert counters["l3_fetched_pages"] > 0
    assert counters["l3_pages_in_place"] == counters["l3_fetched_pages"]
    assert counters["l3_corrupt_pages"] == 0


@pytest.fixture(scope="module")
def lmcache(tmp_path_factory):
    """A stock ``lmcache server`` (its own venv) with an fs L2, on 127.0.0.1."""
    from hicache.integration.bench.lmcache_service import start_lmcache

    with start_lmcache(tmp_path_factory.mktemp("lmcache-l2"),
                       log_dir=tmp_path_factory.mktemp("lmcache-logs")) as service:
        yield service


def test_lmcache_restart_and_a_killed_server(tiny_model, baseline, lmcache):
    """Engine A writes turn 1 through a stock LMCache server and stops; engine B
    (empty L2) serves the returning turns from it. Then the server dies between
    turns: calls fail fast, vLLM recomputes; it comes back and B stores and
    serves from it again. Tokens equal the oracle throughout."""
    want0, want1 = baseline.turns[0], baseline.turns[1]
    llm = engine(tiny_model, "lmcache", lmcache.extra_config(), in_process=True)
    try:
        first = run_turns(llm, want0.prompts[:3], WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
    assert first.outputs == want0.outputs[:3]
    llm = engine(tiny_model, "lmcache", lmcache.extra_config(), in_process=True,
                 hicache_storage_prefetch_policy="wait_complete")
    try:
        returning = run_turns(llm, want1.prompts[:3], WORKLOAD.answer_tokens)
        stored = run_turns(llm, want0.prompts[3:6], WORKLOAD.answer_tokens)
        lmcache.kill()
        down = run_turns(llm, want1.prompts[3:6], WORKLOAD.answer_tokens)
        lmcache.restart()
        back = run_turns(llm, want1.prompts[6:7], WORKLOAD.answer_tokens)
    finally:
        close_llm(llm)
        if not lmcache.alive():
            lmcache.restart()
    assert returning.outputs == want1.outputs[:3]
    assert returning.num_cached_tokens == history_pages(baseline, 1)[:3]  # all from LMCache
    assert stored.outputs == want0.outputs[3:6]
    assert down.outputs == want1.outputs[3:6]
    assert back.outputs == want1.outputs[6:7]
    # Call by call (breaker, recovery, re-registration):
    # tests/tiers/l3/lmcache/test_lmcache_backend.py.
