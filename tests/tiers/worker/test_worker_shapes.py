"""Worker half without an engine (real host pool, real file L3): vLLM's null block is
never read, written or reported; with MLA only the writer rank backs pages up."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from hicache.connector.metadata import HiCacheStepMetadata
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, RequestLoad
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3 import integrity
from hicache.tiers.l3.base import ReadBatch, StorageConfig
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.worker.core import HiCacheWorker

GEOM = PoolGeometry(num_slots=4, num_layers=1, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 2)
KEY_A, KEY_B = page_keys(NS.seed(), list(range(16)), 8)
L1_BLOCKS = 8


class PoolSumsFileBackend(FileBackend):
    """The file backend declaring that it takes the pool's checksums, as Mooncake does
    (it still hashes as it writes: only the worker's side is under test)."""

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        self.capabilities = dataclasses.replace(self.capabilities, pool_checksums=True)


def make_worker(tmp_path: Path | None = None, *, writer: bool = True,
                backend: type[FileBackend] = FileBackend) -> HiCacheWorker:
    def build(name: str, extra: dict) -> FileBackend:
        return backend(StorageConfig(1, 2, NS.fingerprint(), "page_first", GEOM.page_bytes,
                                     is_mla=True, extra_config=extra))

    w = HiCacheWorker(GEOM, L1_BLOCKS, layout="page_first", storage_builder=build,
                      storage_spec=("file", {"path": str(tmp_path)}) if tmp_path else None,
                      l3_writer=writer)
    kv = torch.arange(L1_BLOCKS * 16, dtype=torch.float32).view(L1_BLOCKS, 16)  # 64 B blocks
    w.register_kv_caches({"layer.0": kv})
    w.kv = kv
    return w


def test_loads_skip_the_null_block_and_never_report_it():
    w = make_worker()
    w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4))]))
    saved = w.kv[3:5].clone()
    null_before = w.kv[0].clone()
    w.kv[5:7] = -1
    # The window no longer reaches the page's first block: vLLM names block 0 there.
    load = RequestLoad("r", (PagePlan(0, KEY_A, 0, (0, 6)),))
    w.start_load(HiCacheStepMetadata(loads=[load]))
    w.finish_step(HiCacheStepMetadata())
    assert torch.equal(w.kv[0], null_before)  # never written
    assert torch.equal(w.kv[6], saved[1])
    assert w.take_load_errors() == set()
    # A page that fails its key check reports its blocks, never the null block.
    bad = RequestLoad("s", (PagePlan(1, KEY_B, 0, (0, 7)),))
    w.start_load(HiCacheStepMetadata(loads=[bad]))
    w.finish_step(HiCacheStepMetadata())
    assert w.take_load_errors() == {7}


def _backups_settled(w: HiCacheWorker, want: int) -> int:
    deadline = time.monotonic() + 60  # a bound for a loaded machine, not a speed check
    while w.storage_io.stats.backup_pages < want and time.monotonic() < deadline:
        time.sleep(0.05)
    return w.storage_io.stats.backup_pages


def test_mla_pages_are_backed_up_by_the_writer_rank_only(tmp_path):
    reader, writer = make_worker(tmp_path, writer=False), make_worker(tmp_path, writer=True)
    try:
        for w in (reader, writer):
            w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4))]))
        assert _backups_settled(writer, 1) == 1
        assert reader.storage_io.stats.backup_pages == 0
        assert reader.storage.exists_prefix([KEY_A.hex()]) == 1  # the one shared shard
        assert len(list((tmp_path / "pages").rglob("*.page"))) == 1
    finally:
        reader.shutdown()
        writer.shutdown()


def test_stored_pages_carry_their_checksum_for_the_l3_writes(tmp_path):
    """With an L3 writer that takes them (Mooncake) on a CPU, a store checksums its
    slots right after the copy; the pool keeps the checksum with the slot until the
    slot gets new bytes. Without L3, or with the file L3 (it hashes as it writes),
    nothing is computed."""
    w = make_worker(tmp_path, writer=True, backend=PoolSumsFileBackend)
    try:
        w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4)),
                                                  PagePlan(1, KEY_B, 0, (5, 6))]))
        want = [integrity.checksum(w.pool.read_page(s)) for s in (0, 1)]
        assert w.pool.checksums_of([0, 1, 2]) == [*want, None]
        assert _backups_settled(w, 2) == 2
        # The page written to L3 carries that checksum and reads back verified.
        assert w.storage.read(ReadBatch([KEY_A.hex()], [3])) == [True]
        w.pool.set_key(0, None)  # the slot is being reused
        assert w.pool.checksums_of([0]) == [None]
    finally:
        w.shutdown()
    for plain in (make_worker(), make_worker(tmp_path / "f")):  # no L3; the file L3
        try:
            plain.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4))]))
            assert plain.pool.checksums_of([0]) == [None]  # nothing would take them
        finally:
            plain.shutdown()


def test_every_worker_counter_has_its_row_in_the_metrics_table(tmp_path):
    """The worker names its counters as strings; each must be a row of the one metrics
    table (tiers/metrics.py), or it would reach /metrics untyped."""
    from hicache.tiers.metrics import METRICS

    w = make_worker(tmp_path)  # with an L3: its counters too
    try:
        rows = {m.key for m in METRICS if m.section == "worker"}
        assert w.counters() and set(w.counters()) - rows == set()
        assert set(w.stats.take_observations()) <= {m.key for m in METRICS
                                                    if m.section == "latency"}
    finally:
        w.shutdown()


def test_a_page_the_l3_admission_rule_holds_back_stays_in_l2_until_its_backup_is_planned(
        tmp_path):
    """A store planned without L3 keys (``hicache_l3_admission: reused``, a first
    computation) is not backed up; a later plan that only names it in ``backups`` (a
    second request reached it in L2) backs it up, though that plan stores nothing."""
    w = make_worker(tmp_path, writer=True)
    try:
        w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4), l3_keys=()),
                                                  PagePlan(1, KEY_B, 0, (5, 6))]))
        assert _backups_settled(w, 1) == 1
        assert w.storage.exists_prefix([KEY_A.hex()]) == 0
        assert w.storage.exists_prefix([KEY_B.hex()]) == 1
        w.finish_step(HiCacheStepMetadata(backups=[PagePlan(0, KEY_A, 0, (),
                                                            l3_keys=(KEY_A,))]))
        assert _backups_settled(w, 2) == 2
        assert w.storage.exists_prefix([KEY_A.hex()]) == 1
    finally:
        w.shutdown()


def test_backups_that_name_one_span_are_written_as_that_one_object(tmp_path):
    """A span completed across plans (l2_manager.py ``_complete_spans``): its pages,
    stored earlier without L3 keys, are backed up with a later plan as one object."""
    from hicache.tiers.index.spans import SpanRef, span_key

    w = make_worker(tmp_path, writer=True)
    try:
        w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (3, 4), l3_keys=()),
                                                  PagePlan(1, KEY_B, 0, (5, 6), l3_keys=())]))
        span = span_key(KEY_B, 2)
        w.finish_step(HiCacheStepMetadata(backups=[
            PagePlan(0, KEY_A, 0, (), l3_keys=(KEY_A,), span=SpanRef(span, 0, 2)),
            PagePlan(1, KEY_B, 0, (), l3_keys=(KEY_B,), span=SpanRef(span, 1, 2))]))
        assert _backups_settled(w, 2) == 2
        assert w.storage.exists_prefix([span.hex()]) == 1
        assert w.storage.exists_prefix([KEY_A.hex()]) == 0  # no page objects of their own
        refs = [SpanRef(span, 0, 2), SpanRef(span, 1, 2)]
        assert w.storage.read(ReadBatch([KEY_A.hex(), KEY_B.hex()], [2, 3], refs)) == [True, True]
        assert torch.equal(w.pool.read_page(2), w.pool.read_page(0))
    finally:
        w.shutdown()
