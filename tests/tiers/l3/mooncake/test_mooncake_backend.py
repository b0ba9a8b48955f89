"""Mooncake L3 backend against a real mooncake_master on 127.0.0.1 (no mocks).

Round trips, consecutive exists, dedup, sharing with a second process,
corruption as counted misses, TP-rank isolation, a killed / hung / restarted
master, close after the master is gone, and bad configuration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from support.store_contract import (
    GEOM,
    NS,
    ROUND_TRIP_LAYOUTS,
    check_exists_and_dedup,
    check_round_trip,
    config,
    delta,
    filled_pool,
    keys,
    read_in_another_process,
)

pytest.importorskip("mooncake.store")

from hicache.integration.bench.mooncake_service import (  # noqa: E402
    MooncakeService,
    apply_client_env,
    start_mooncake,
)
from hicache.tiers.l3 import integrity  # noqa: E402
from hicache.tiers.l3.base import (  # noqa: E402
    ReadBatch,
    StorageConfig,
    StorageConfigError,
    StorageUnavailable,
    WriteBatch,
)
from hicache.tiers.l3.factory import create_backend  # noqa: E402
from hicache.tiers.l3.guard import guarded  # noqa: E402
from hicache.tiers.l3.mooncake.backend import MooncakeBackend  # noqa: E402
from hicache.tiers.l3.mooncake.config import (  # noqa: E402
    ENV_VARS,
    MooncakeSettings,
    parse_size,
)

SEGMENT = 64 << 20  # two ranks -> 32 MiB each


@pytest.fixture(scope="module")
def service():
    apply_client_env()
    with start_mooncake() as svc:
        yield svc


class CallCounter:
    """Wraps the real Mooncake client and counts the calls this thread makes
    through it (the breaker's prober thread is not counted)."""

    def __init__(self, store: object) -> None:
        self._store = store
        self._thread = threading.get_ident()
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._store, name)
        if callable(attr) and threading.get_ident() == self._thread and name not in LOCAL:
            self.calls.append(name)
        return attr


# Registers memory with the local transfer engine (the staging buffer, made on
# first use): no call to the master.
LOCAL = {"register_buffer"}


def extra_for(svc: MooncakeService, **overrides) -> dict:
    return {**svc.extra_config(SEGMENT), **overrides}


@pytest.fixture(scope="module")
def shared(service):
    """Backends reused across tests (a Mooncake client's close takes ~1 s): by name."""
    made: dict[tuple[str, int, str], MooncakeBackend] = {}

    def _get(name: str, *, rank: int = 0, layout: str = "page_first") -> MooncakeBackend:
        if (name, rank, layout) not in made:
            backend = guarded(MooncakeBackend(config(extra_for(service), rank=rank, layout=layout)))
            backend.register_host_pool(filled_pool(layout, seed=len(made) + 1))
            made[(name, rank, layout)] = backend
        return made[(name, rank, layout)]

    yield _get
    for backend in made.values():
        backend.close()


@pytest.fixture
def make(service):
    """Fresh backends, closed after the test."""
    made: list[MooncakeBackend] = []

    def _make(*, rank: int = 0, layout: str = "page_first", svc: MooncakeService | None = None,
              **extra) -> MooncakeBackend:
        backend = guarded(MooncakeBackend(config(extra_for(svc or service, **extra), rank=rank,
                                         layout=layout)))
        made.append(backend)
        return backend

    yield _make
    for backend in made:
        backend.close()


def raw_client(service: MooncakeService):
    """A plain Mooncake client (no segment) for poking at objects behind the backend."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "",
                       service.master_address) == 0
    return store


@pytest.mark.parametrize(("writer_layout", "reader_layout"), ROUND_TRIP_LAYOUTS)
def test_round_trip_bit_exact_through_host_slots(shared, writer_layout, reader_layout):
    a = shared("a", layout=writer_layout)
    b = shared("b" if writer_layout == reader_layout else "a", layout=reader_layout)
    assert check_round_trip(a, b, seed=1000 + len(writer_layout)).exists_queries == 5


def test_exists_prefix_counts_consecutive_hits_and_writes_skip_existing(shared):
    other = shared("b")
    ks = check_exists_and_dedup(shared("a"), other, seed=3000)
    # a key twice in one batch is written once
    before = other.stats()
    assert other.write(WriteBatch([ks[4], ks[4]], [4, 4])) == [True, True]
    assert delta(other, before).set_pages == 1 and delta(other, before).set_failures == 0


def test_second_process_reads_what_the_first_wrote(shared, service):
    read_in_another_process(shared("a", layout="page_first_direct"), "mooncake",
                            extra_for(service), env={**os.environ, **service.client_env()},
                            timeout_s=60)


def test_corrupt_object_is_a_counted_miss_and_removed(shared, service):
    backend = shared("a")
    pool = backend.pool
    ks = keys(3, seed=5000)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    before = backend.stats()
    raw = raw_client(service)
    try:
        # 1: one payload byte flipped under an intact header
        obj = bytearray(raw.get(backend.object_key(ks[0])))
        assert len(obj) == integrity.HEADER_BYTES + GEOM.page_bytes
        obj[integrity.HEADER_BYTES + 17] ^= 0xFF
        assert raw.upsert(backend.object_key(ks[0]), bytes(obj)) == 0
        # 2: a valid object of another page stored under this key
        other = raw.get(backend.object_key(ks[2]))
        assert raw.upsert(backend.object_key(ks[1]), other) == 0
        # 3: a truncated object
        assert raw.upsert(backend.object_key(ks[2]), other[:-100]) == 0

        assert backend.read(ReadBatch(ks, [5, 6, 7])) == [False, False, False]
        st = delta(backend, before)
        assert st.corrupt_pages == 3 and st.get_hits == 0 and st.get_misses == 3
        assert list(raw.batch_is_exist([backend.object_key(k) for k in ks])) == [0, 0, 0]
        # a page read alone is verified too
        assert backend.write(WriteBatch(ks[:1], [0])) == [True]
        obj = bytearray(raw.get(backend.object_key(ks[0])))
        obj[-1] ^= 0x01
        assert raw.upsert(backend.object_key(ks[0]), bytes(obj)) == 0
        assert backend.read(ReadBatch(ks[:1], [5])) == [False]
        assert delta(backend, before).corrupt_pages == 4
        # the page can be written again and then reads fine
        assert backend.write(WriteBatch(ks[:1], [0])) == [True]
        assert backend.read(ReadBatch(ks[:1], [5])) == [True]
        assert torch.equal(pool.canonical[0], pool.canonical[5])
    finally:
        raw.close()


def test_writes_take_the_pools_checksums_and_reads_still_check_them(shared):
    """A write takes the checksum the store path left with the slot instead of reading
    the page again. Even a wrong one cannot load wrong KV: the read checks the bytes."""
    backend = shared("a")
    pool = backend.pool
    ks = keys(2, seed=5500)
    pool.set_key(0, b"a")
    pool.set_key(1, b"b")
    pool.set_checksums([0, 1], [integrity.checksum(pool.read_page(0)),
                                integrity.checksum(pool.read_page(1)) ^ 1])  # slot 1: wrong
    before = backend.stats()
    assert backend.write(WriteBatch(ks, [0, 1])) == [True, True]
    assert backend.read(ReadBatch(ks, [5, 6])) == [True, False]
    assert torch.equal(pool.canonical[0], pool.canonical[5])
    assert delta(backend, before).corrupt_pages == 1


def test_other_tp_rank_does_not_see_the_page(shared):
    r0, r1 = shared("a", rank=0), shared("a", rank=1)
    ks = keys(2, seed=6000)
    assert r0.write(WriteBatch(ks, [0, 1])) == [True, True]
    assert r0.object_key(ks[0]) != r1.object_key(ks[0])
    before = r1.stats()
    assert r1.exists_prefix(ks) == 0
    assert r1.read(ReadBatch(ks, [0, 1])) == [False, False]
    assert delta(r1, before).corrupt_pages == 0 and delta(r1, before).get_misses == 2


def test_scheduler_instance_looks_up_and_clears(make, shared):
    scheduler = make()  # no host pool, as the scheduler's instance
    ks = keys(3, seed=7000)
    assert scheduler.exists_prefix(ks) == 0
    assert not scheduler.inner._mounted  # only asked exists: it gave no memory to the store
    worker = shared("a")
    assert worker.write(WriteBatch(ks[:2], [0, 1])) == [True, True]
    assert scheduler.exists_prefix(ks) == 2
    assert worker.write(WriteBatch(ks[2:], [2])) == [True]
    assert scheduler.exists_prefix(ks) == 3 and not scheduler.inner._mounted
    scheduler.clear()
    assert scheduler.exists_prefix(ks) == 0


def test_killed_master_fails_fast_without_raising_and_recovers(make):
    with start_mooncake() as svc:
        backend = make(svc=svc)
        pool = filled_pool("page_first", 10)
        backend.register_host_pool(pool)
        ks = keys(3, seed=8000)
        assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
        svc.kill_master()
        first = backend.read(ReadBatch(ks, [3, 4, 5]))
        assert first == [False] * 3
        assert not backend.reachable  # the first RPC failure tripped the breaker
        counter = backend.inner._store = CallCounter(backend.inner._store)
        for _ in range(3):
            assert backend.exists_prefix(ks) == 0
            assert backend.read(ReadBatch(ks, [3, 4, 5])) == [False] * 3
            assert backend.write(WriteBatch(keys(2, seed=8100), [6, 7])) == [False, False]
            assert (backend.exists_prefix([ks[0]]) == 1) is False
            assert backend.read(ReadBatch(ks[:1], [3])) == [False]
            assert backend.write(WriteBatch(ks[:1], [0])) == [False]
            backend.clear()
        assert counter.calls == []  # breaker open: no call reaches (and waits on) the dead master
        assert not backend.reachable
        st = backend.stats()
        # 21 calls refused by the breaker, none of them a failure of their own
        assert st.refused_calls == 21 and st.get_hits == 0 and st.set_failures >= 6
        # an empty master comes back on the same port: the prober notices, writes work again
        svc.restart_master()
        deadline = time.monotonic() + 15
        while not backend.reachable and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.reachable
        ks2 = keys(2, seed=8200)
        deadline = time.monotonic() + 10
        while (backend.write(WriteBatch(ks2, [6, 7])) != [True, True]
               and time.monotonic() < deadline):
            time.sleep(0.2)
        assert backend.read(ReadBatch(ks2, [3, 4])) == [True, True]
        assert torch.equal(pool.canonical[3], pool.canonical[6])
        backend.close()


def wait_stopped(pid: int) -> None:
    """Until the kernel reports every thread of ``pid`` stopped: SIGSTOP is delivered
    asynchronously, and a request sent before the master actually stops is answered."""

    def states() -> set[str]:
        return {stat.read_text().rsplit(")", 1)[1].split()[0]
                for stat in Path(f"/proc/{pid}/task").glob("*/stat")}

    deadline = time.monotonic() + 10
    while states() != {"T"}:
        assert time.monotonic() < deadline, f"master {pid} did not stop: {states()}"
        time.sleep(0.01)


def test_hung_master_is_bounded_by_the_rpc_timeout(make, monkeypatch):
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "1500")  # read at client setup
    with start_mooncake() as svc:
        backend = make(svc=svc)
        backend.register_host_pool(filled_pool("page_first", 11))
        ks = keys(2, seed=9000)
        assert backend.write(WriteBatch(ks, [0, 1])) == [True, True]
        os.kill(svc.master.pid, signal.SIGSTOP)
        wait_stopped(svc.master.pid)
        try:
            assert backend.exists_prefix(ks) == 0  # the RPC timed out: a miss, breaker open
            assert not backend.reachable
            real, counter = backend.inner._store, CallCounter(backend.inner._store)
            backend.inner._store = counter
            assert backend.read(ReadBatch(ks, [2, 3])) == [False, False]
            assert backend.write(WriteBatch(keys(1, seed=9100), [4])) == [False]
            assert counter.calls == []  # no call waits on the hung master
            backend.inner._store = real
        finally:
            os.kill(svc.master.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while not backend.reachable and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.read(ReadBatch(ks, [2, 3])) == [True, True]
        backend.close()


_CLOSE_AFTER_MASTER_DIED = textwrap.dedent("""
    import json, os, sys, time
    from hicache.integration.bench.mooncake_service import start_mooncake
    from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
    from hicache.tiers.l3.base import StorageConfig, WriteBatch
    from hicache.tiers.l3.guard import guarded
    from hicache.tiers.l3.mooncake.backend import MooncakeBackend
    with start_mooncake() as svc:
        b = guarded(MooncakeBackend(StorageConfig(0, 1, "ns", "page_first", 4096,
                                          extra_config=svc.extra_config(16 << 20))))
        b.register_host_pool(HostPagePool(PoolGeometry(1, 1, 1, 4096), layout="page_first",
                                          pin_memory=False))
        ok = b.write(WriteBatch(["ab" * 32], [0]))[0]
    from hicache.tiers.l3.mooncake import backend as mooncake_backend
    # master stopped; the breaker never tripped: close() must see the closed port
    # and abandon the client rather than call Mooncake's close, which blocks 10-20 s
    b.close()
    abandoned = any(store is b.inner._store for store, _ in mooncake_backend._ABANDONED)
    print(json.dumps({"set": ok, "abandoned": abandoned}), flush=True)
    # Mooncake's exit handler would join the client's heartbeat thread, stuck
    # pinging the dead master (~10 s); this test only checks close().
    os._exit(0)
""")


def test_close_after_the_master_is_gone_abandons_the_client(service):
    env = {**os.environ, **service.client_env()}
    proc = subprocess.run([sys.executable, "-c", _CLOSE_AFTER_MASTER_DIED], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"set": True, "abandoned": True}


def test_unreachable_master_at_start_is_storage_unavailable(service):
    from hicache.integration.bench.mooncake_service import free_port

    extra = extra_for(service, master_server_address=f"127.0.0.1:{free_port()}")
    # "is not reachable" is the TCP pre-check's message: the client setup, which
    # retries against a dead master for a long time, never ran.
    with pytest.raises(StorageUnavailable, match="is not reachable.*master_server_address"):
        guarded(MooncakeBackend(config(extra)))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ({"bogus_key": 1}, "bogus_key"),
        ({"protocol": "carrier-pigeon"}, "protocol"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"global_segment_size": -5}, "global_segment_size"),
        ({"local_buffer_size": "12xb"}, "local_buffer_size"),
        ({"master_server_address": "no-port"}, "master_server_address"),
        ({"device_name": "{not json"}, "device_name"),
        ({"local_hostname": ""}, "local_hostname"),
        ({"protocol": 6}, "protocol"),
    ],
)
def test_bad_config_names_the_key(service, override, named):
    with pytest.raises(StorageConfigError, match=named) as err:
        guarded(MooncakeBackend(config(extra_for(service, **override))))
    if named == "protocol":
        assert "tcp" in str(err.value)
    if named == "bogus_key":
        assert "master_server_address" in str(err.value)  # lists the allowed keys


def test_missing_master_and_env_fallbacks(service, monkeypatch):
    for var in ("MOONCAKE_MASTER", "MOONCAKE_PROTOCOL", "MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(StorageConfigError, match="master_server_address"):
        guarded(MooncakeBackend(config({})))
    monkeypatch.setenv("MOONCAKE_MASTER", service.master_address)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "32mb")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "smoke-signals")
    with pytest.raises(StorageConfigError, match="protocol"):
        guarded(MooncakeBackend(config({})))
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    backend = create_backend("mooncake", config({}))
    try:
        assert isinstance(backend.inner, MooncakeBackend)
        assert backend.inner.settings.global_segment_size == (32 << 20) // 2  # per TP rank
        assert backend.inner.settings.master_server_address == service.master_address
        assert backend.inner.settings.metadata_server == "P2PHANDSHAKE"
    finally:
        backend.close()


def test_settings_resolve_env_devices_and_the_rank_share(monkeypatch):
    """Extra config over environment over default; no master needed to resolve them."""
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1gb")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    devices = json.dumps({"0": "mlx5_0", "1": "mlx5_1"})
    rank1 = StorageConfig(1, 2, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "device_name": devices, "local_buffer_size": 4096, "protocol": None})
    assert MooncakeSettings.from_config(rank1) == MooncakeSettings(
        "10.0.0.1:50051", "localhost", "P2PHANDSHAKE", (1 << 30) // 2, 4096, "rdma", "mlx5_1")
    rank0 = StorageConfig(0, 2, NS.fingerprint(), "page_first", GEOM.page_bytes, extra_config={
        "master_server_address": "master:1", "protocol": "tcp", "device_name": "{}"})
    settings = MooncakeSettings.from_config(rank0)
    assert (settings.master_server_address, settings.protocol) == ("master:1", "tcp")
    assert settings.device_name == "" and settings.local_buffer_size == 16 << 20
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "a lot")
    with pytest.raises(StorageConfigError) as err:
        MooncakeSettings.from_config(rank0)
    assert "hicache_storage_backend_extra_config.global_segment_size='a lot': not a size" \
        in str(err.value) and "MOONCAKE_GLOBAL_SEGMENT_SIZE" in str(err.value)


def test_parse_size():
    assert parse_size("k", 123) == 123
    assert parse_size("k", "4gb") == 4 << 30
    assert parse_size("k", "512MB") == 512 << 20
    assert parse_size("k", "64k") == 64 << 10
    assert parse_size("k", "1024") == 1024
    for bad in ("", "1.5gb", "gb", True, None, -1):
        with pytest.raises(StorageConfigError):
            parse_size("k", bad)


def test_delete_removes_one_page(shared):
    backend = shared("a")
    ks = keys(3, seed=9100)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    assert backend.delete([ks[1], ks[1]]) == 1
    assert [(backend.exists_prefix([k]) == 1) for k in ks] == [True, False, True]
