"""LMCache L3 backend against a real ``lmcache server`` on 127.0.0.1 (no mocks).

The server runs from its own venv (``make lmcache-venv``; ``make test`` builds
it first), with LMCache's fs L2 adapter in a temporary folder. Round trips
through every host layout, consecutive exists, dedup, TP-rank and layout
isolation, a second process reading the first's pages, a restart served from
the fs L2, a corrupted L2 file as a counted miss, a killed and a hung server,
exact deletes and a scoped clear, bad configuration, and no telemetry.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from support.store_contract import (
    GEOM,
    ROUND_TRIP_LAYOUTS,
    check_exists_and_dedup,
    check_round_trip,
    config,
    delta,
    filled_pool,
    keys,
    read_in_another_process,
)

from hicache.integration.bench.lmcache_service import (
    NO_TELEMETRY,
    LMCacheService,
    start_lmcache,
)
from hicache.tiers.l3.base import ReadBatch, StorageConfigError, StorageUnavailable, WriteBatch
from hicache.tiers.l3.factory import create_backend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.l3.lmcache.backend import LMCacheBackend
from hicache.tiers.l3.lmcache.objects import chunk_hash


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    l2 = tmp_path_factory.mktemp("lmcache-l2")
    with start_lmcache(l2, log_dir=tmp_path_factory.mktemp("lmcache-logs")) as svc:
        yield svc


@pytest.fixture(scope="module")
def shared(service):
    """Backends reused across tests, by name."""
    made: dict[tuple[str, int, str], LMCacheBackend] = {}

    def _get(name: str, *, rank: int = 0, layout: str = "page_first") -> LMCacheBackend:
        if (name, rank, layout) not in made:
            backend = guarded(LMCacheBackend(config(service.extra_config(), rank=rank, layout=layout)))
            backend.register_host_pool(filled_pool(layout, seed=len(made) + 1))
            made[(name, rank, layout)] = backend
        return made[(name, rank, layout)]

    yield _get
    for backend in made.values():
        backend.close()


@pytest.fixture
def make(service):
    """Fresh backends, closed after the test."""
    made: list[LMCacheBackend] = []

    def _make(*, rank: int = 0, layout: str = "page_first", **extra) -> LMCacheBackend:
        backend = guarded(LMCacheBackend(config(service.extra_config(**extra), rank=rank, layout=layout)))
        backend.register_host_pool(filled_pool(layout, seed=len(made) + 100))
        made.append(backend)
        return backend

    yield _make
    for backend in made:
        backend.close()


def l2_file(service: LMCacheService, backend: LMCacheBackend, key: str) -> Path:
    """The fs adapter's file of page ``key``, once the server has written it."""
    name = chunk_hash(key, backend.inner.chunk_size).hex()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert service.l2_dir is not None
        found = [p for p in service.l2_dir.iterdir()
                 if p.name.startswith(backend.inner.model_name) and p.name.endswith(f"{name}.data")]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no L2 file for page {key}")


def wait_serving(backend: LMCacheBackend, key: str, timeout_s: float = 60.0) -> None:
    """Until ``key`` is found again after a server restart (the first call may see the
    connection still down and open the breaker; the probe then closes it)."""
    deadline = time.monotonic() + timeout_s
    while backend.exists_prefix([key]) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.reachable, backend.last_error


def wait_reachable(backend: LMCacheBackend, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not backend.reachable and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.reachable, backend.last_error


@pytest.mark.parametrize(("writer_layout", "reader_layout"), ROUND_TRIP_LAYOUTS)
def test_round_trip_bit_exact_through_host_slots(shared, writer_layout, reader_layout):
    a = shared("a", layout=writer_layout)
    b = shared("b" if writer_layout == reader_layout else "a", layout=reader_layout)
    check_round_trip(a, b, seed=1000 + len(writer_layout))


def test_single_pages_and_a_key_twice_in_a_batch(shared):
    backend = shared("a")
    ks = keys(2, seed=2000)
    page = torch.arange(GEOM.page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    backend.pool.write_page(0, page)
    assert backend.write(WriteBatch(ks[:1], [0])) == [True]
    assert backend.exists_prefix(ks) == 1 and backend.read(ReadBatch(ks, [1, 3])) == [True, False]
    assert torch.equal(backend.pool.read_page(1), page)
    before = backend.stats()
    assert backend.write(WriteBatch([ks[1], ks[1]], [2, 2])) == [True, True]
    assert delta(backend, before).set_pages == 1
    assert backend.read(ReadBatch([ks[1], ks[1]], [5, 6])) == [True, True]
    assert torch.equal(backend.pool.canonical[5], backend.pool.canonical[2])
    assert torch.equal(backend.pool.canonical[6], backend.pool.canonical[2])


def test_exists_prefix_counts_consecutive_hits_and_writes_skip_existing(shared):
    check_exists_and_dedup(shared("a"), shared("b"), seed=3000)


def test_other_tp_rank_and_other_layout_do_not_see_the_page(shared):
    rank0, rank1 = shared("a"), shared("a", rank=1)
    layer_first = shared("a", layout="layer_first")  # other L3 byte order than page_first
    ks = keys(2, seed=5000)
    assert rank0.write(WriteBatch(ks, [0, 1])) == [True, True]
    assert rank0.exists_prefix(ks) == 2
    assert rank1.exists_prefix(ks) == 0 and rank1.read(ReadBatch(ks, [0, 1])) == [False, False]
    assert layer_first.exists_prefix(ks) == 0
    assert len({rank0.inner.model_name, rank1.inner.model_name, layer_first.inner.model_name}) == 3


def test_second_process_reads_what_the_first_wrote(shared, service):
    read_in_another_process(shared("a", layout="page_first_direct"), "lmcache",
                            service.extra_config(), timeout_s=120)


def test_delete_is_exact_and_clear_keeps_other_models_pages(make):
    a, b = make(), make(rank=1)
    ks = keys(6, seed=6000)
    assert a.write(WriteBatch(ks, list(range(6)))) == [True] * 6
    assert b.write(WriteBatch(ks[:3], [0, 1, 2])) == [True] * 3
    assert a.delete(ks[4:] + keys(1, seed=77_777)) == 2  # the absent key is not counted
    assert a.exists_prefix(ks) == 4 and a.exists_prefix(ks[4:]) == 0
    assert a.delete([ks[3]]) == 1 and a.delete([ks[3]]) == 0
    a.clear()
    assert a.exists_prefix(ks) == 0
    assert b.exists_prefix(ks[:3]) == 3  # rank 1 is another model name: untouched


def test_deletes_need_the_http_url(make):
    backend = make(http_url=None)
    with pytest.raises(NotImplementedError, match="http_url"):
        backend.delete(keys(1, seed=6500))
    with pytest.raises(NotImplementedError, match="http_url"):
        backend.clear()


@pytest.mark.parametrize(("override", "message"), [
    ({"server_url": "127.0.0.1:5555"}, r"extra_config\.server_url.*tcp://"),
    ({"http_url": "ftp://x"}, r"extra_config\.http_url"),
    ({"transfer_mode": "pickle"}, r"extra_config\.transfer_mode.*'shm'"),
    ({"request_timeout_s": 0.0}, r"extra_config\.request_timeout_s.*> 0"),
    ({"heartbeat_interval_s": 300.0}, r"extra_config\.heartbeat_interval_s.*110"),
    ({"chunk": 16}, r"lmcache backend: \['chunk'\]; allowed keys: \['heartbeat_interval_s'"),
])
def test_bad_config_names_the_key(service, override, message):
    with pytest.raises(StorageConfigError, match=message):
        create_backend("lmcache", config(service.extra_config(**override)))


def test_unreachable_server_at_start_is_storage_unavailable():
    from hicache.integration.bench.mooncake_service import free_port

    with pytest.raises(StorageUnavailable, match="does not answer"):
        guarded(LMCacheBackend(config({"server_url": f"tcp://127.0.0.1:{free_port()}",
                               "request_timeout_s": 1.0})))


def test_server_runs_without_telemetry(service):
    environ = Path(f"/proc/{service.proc.pid}/environ").read_bytes().split(b"\0")
    env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
    for name, value in NO_TELEMETRY.items():
        assert env.get(name) == value


def test_restart_is_served_from_the_fs_l2_and_a_corrupt_file_is_a_counted_miss(make, service):
    """The server restarts with an empty DRAM tier: pages come back from its fs L2;
    a page whose file was damaged is a corrupt miss, deleted, never loaded."""
    backend = make(layout="page_first")
    ks = keys(4, seed=7000)
    assert backend.write(WriteBatch(ks, [0, 1, 2, 3])) == [True] * 4
    damaged = l2_file(service, backend, ks[2])
    for k in ks:
        l2_file(service, backend, k)
    service.stop()
    raw = bytearray(damaged.read_bytes())
    raw[200] ^= 0xFF  # a payload byte (the header is the first 128)
    damaged.write_bytes(bytes(raw))
    service.restart()
    wait_serving(backend, ks[0])  # from the L2; the others stay there until read
    before = backend.stats()
    assert backend.read(ReadBatch(ks, [7, 6, 5, 4])) == [True, True, False, True]
    for s, d in ((0, 7), (1, 6), (3, 4)):
        assert torch.equal(backend.pool.canonical[s], backend.pool.canonical[d])
    st = delta(backend, before)
    assert (st.get_hits, st.get_misses, st.corrupt_pages) == (3, 1, 1)
    assert not damaged.exists()  # deleted through the HTTP API
    assert backend.exists_prefix(ks[2:3]) == 0


def test_killed_server_fails_fast_without_raising_and_recovers(make, service):
    # A timeout this long would hang the test: the drop must be seen, not waited out.
    backend = make(request_timeout_s=600.0)
    ks = keys(3, seed=8000)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    for k in ks:
        l2_file(service, backend, k)
    service.kill()
    try:
        before = backend.stats()
        assert backend.exists_prefix(ks) == 0
        assert not backend.reachable
        assert "Gone" in backend.last_error, backend.last_error  # a drop, not a timeout
        # with the breaker open nothing reaches the wire, nothing raises
        assert backend.read(ReadBatch(ks, [3, 4, 5])) == [False] * 3
        assert backend.write(WriteBatch(keys(1, seed=8100), [6])) == [False]
        assert delta(backend, before).errors == 1
    finally:
        service.restart()
    wait_reachable(backend)
    assert backend.read(ReadBatch(ks, [3, 4, 5])) == [True] * 3
    assert torch.equal(backend.pool.canonical[0], backend.pool.canonical[3])
    assert backend.write(WriteBatch(keys(1, seed=8100), [6])) == [True]


def test_hung_server_is_bounded_by_the_request_timeout_and_recovers(make, service):
    backend = make(request_timeout_s=1.0)
    ks = keys(2, seed=9000)
    assert backend.write(WriteBatch(ks, [0, 1])) == [True, True]
    os.kill(service.proc.pid, signal.SIGSTOP)
    try:
        before = backend.stats()
        assert backend.exists_prefix(ks) == 0
        assert "Timeout" in backend.last_error, backend.last_error
        assert backend.exists_prefix(ks) == 0  # the breaker: no second wait
        assert delta(backend, before).errors == 1
    finally:
        os.kill(service.proc.pid, signal.SIGCONT)
    wait_reachable(backend)
    assert backend.exists_prefix(ks) == 2
    assert backend.read(ReadBatch(ks, [2, 3])) == [True, True]


def test_stop_removes_the_log_folder_start_made_and_restart_makes_it_again():
    svc = start_lmcache()
    try:
        logs = svc.log_path.parent
        assert svc.log_path.exists()
        svc.stop()
        assert not logs.exists()
        svc.restart()
        assert svc.alive() and svc.log_path.exists()
    finally:
        svc.stop()
    assert not logs.exists()
