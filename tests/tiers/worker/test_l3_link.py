"""tiers/worker/l3_link.py: attaching, detaching and commanding one rank's L3, with
real file backends under tmp_path and a real host pool."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hicache.tiers.index.commands import AttachStore, DetachStore, RetainPages
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.metrics import WorkerGauge as G
from hicache.tiers.metrics import WorkerKey as K
from hicache.tiers.worker.l3_link import L3Link

GEOM = PoolGeometry(num_slots=4, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 1)
KEY_A, KEY_B = page_keys(NS.seed(), list(range(16)), 8)


class ProbedFiles(FileBackend):
    """A file store that can go away: ``answers`` is its guard's breaker probe."""

    up = True

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, probe=True)

    def answers(self) -> bool:
        return self.up

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if not self.up:
            raise ConnectionError("injected: the store went away")
        return super().exists_prefix(keys)


def build(name: str, extra: dict) -> FileBackend:
    if extra.get("unreachable"):
        raise ConnectionError("injected: the store cannot be reached")
    extra = dict(extra)
    kind = ProbedFiles if extra.pop("probed", False) else FileBackend
    return guarded(kind(StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes,
                              extra_config=extra)))


def pool() -> HostPagePool:
    p = HostPagePool(GEOM, layout="page_first", device=torch.device("cpu"))
    p.buffer.view(torch.uint8)[:] = 7
    return p


def no_load(pages):  # these tests fetch nothing into vLLM's blocks
    raise AssertionError("no fetch was submitted")


def backup(link: L3Link, p: HostPagePool, key: bytes, slot: int) -> None:
    """Page ``key`` in L2 slot ``slot``, backed up to L3 (the worker's path after a store)."""
    assert link.io is not None
    p.set_key(slot, key)
    link.io.submit_backup([(key, slot, key)])
    assert link.io.wait_backups(timeout_s=60)


def test_without_a_spec_there_is_no_l3():
    link = L3Link(build, None)
    assert not link.start(pool(), no_load) and link.backend is None and not link.writes
    assert link.counters() == {} and link.take_backed_up() == []
    assert link.gauges() == {G.L3_FETCH_QUEUE: 0, G.L3_BACKUP_QUEUE_PAGES: 0,
                             G.L3_BREAKER_OPEN: 0.0}


def test_an_unreachable_store_leaves_the_rank_without_l3(tmp_path: Path, caplog):
    link = L3Link(build, ("file", {"path": str(tmp_path), "unreachable": True}))
    assert not link.start(pool(), no_load)
    assert link.backend is None and link.io is None
    assert "continuing without L3" in caplog.text


def test_counters_survive_a_detach_and_a_new_attach(tmp_path: Path):
    p = pool()
    link = L3Link(build, ("file", {"path": str(tmp_path / "a")}))
    assert link.start(p, no_load) and link.writes
    backup(link, p, KEY_A, 0)
    assert link.counters()[K.L3_BACKUP_PAGES] == 1
    assert link.take_backed_up() == [KEY_A]
    link.apply(DetachStore())
    assert link.backend is None and link.counters()[K.L3_BACKUP_PAGES] == 1
    link.apply(AttachStore("file", {"path": str(tmp_path / "b")}))
    assert isinstance(link.backend.inner, FileBackend)
    backup(link, p, KEY_B, 1)
    assert link.counters()[K.L3_BACKUP_PAGES] == 2  # never goes back
    assert link.backend.exists_prefix([KEY_B.hex()]) == 1
    assert link.backend.exists_prefix([KEY_A.hex()]) == 0  # another store
    link.shutdown()


def test_an_open_breaker_is_reported_and_the_calls_it_refuses_are_counted(tmp_path: Path):
    link = L3Link(build, ("file", {"path": str(tmp_path), "probed": True}))
    assert link.start(pool(), no_load) and link.backend is not None
    assert link.gauges()[G.L3_BREAKER_OPEN] == 0
    assert link.backend.exists_prefix([KEY_A.hex()]) == 0
    assert link.counters()[K.L3_REFUSED_CALLS] == 0
    link.backend.inner.up = False
    assert link.backend.exists_prefix([KEY_A.hex()]) == 0  # raised: the breaker opens
    assert link.backend.exists_prefix([KEY_A.hex()]) == 0  # refused without a call
    assert link.backend.exists_prefix([KEY_A.hex()]) == 0
    counters = link.counters()
    assert counters[K.L3_REFUSED_CALLS] == 2 and counters[K.L3_ERRORS] == 1
    assert link.gauges()[G.L3_BREAKER_OPEN] == 1
    link.backend.inner.up = True  # its probe answers again: the breaker closes
    give_up = time.monotonic() + 120  # a generous bound on a 0.5 s probe, not a timing
    while link.gauges()[G.L3_BREAKER_OPEN] and time.monotonic() < give_up:
        time.sleep(0.05)
    assert link.gauges()[G.L3_BREAKER_OPEN] == 0
    link.shutdown()


def test_a_failing_attach_is_logged_and_leaves_no_l3(tmp_path: Path, caplog):
    p = pool()
    link = L3Link(build, ("file", {"path": str(tmp_path)}))
    assert link.start(p, no_load)
    link.apply(AttachStore("file", {"path": str(tmp_path), "unreachable": True}))
    assert link.backend is None and not link.writes
    assert "continuing without L3" in caplog.text


def test_a_rank_that_does_not_write_l3_retains_nothing(tmp_path: Path):
    """MLA: rank 0 writes (and pins) the shared shard; the others only read."""
    p = pool()
    reader = L3Link(build, ("file", {"path": str(tmp_path)}), writer=False)
    assert reader.start(p, no_load) and not reader.writes
    reader.apply(RetainPages((KEY_A,), until=1e12))
    assert reader.io is not None and reader.io.wait_backups(timeout_s=60)
    assert reader.counters()[K.L3_RETAINED_PAGES] == 0
    writer = L3Link(build, ("file", {"path": str(tmp_path)}))
    assert writer.start(p, no_load)
    backup(writer, p, KEY_A, 0)
    writer.apply(RetainPages((KEY_A,), until=1e12))
    writer.shutdown()  # drains the queue: the retention ran
    assert writer.counters()[K.L3_RETAINED_PAGES] == 1
    reader.shutdown()
