"""File L3 span objects: runs of pages in one file, each page's record checked on its own.

A damaged record (flipped bit, truncated file, another rank's or model's file) is a miss
for its pages only, never wrong KV; the file is quarantined once its good records were
read. Runs where the GIL-free batch path runs (numba); without it the backend stores
page objects only (the last test)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.spans import SpanLayout, SpanRef
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.file.backend import FILE_HEADER_BYTES, FileBackend
from hicache.tiers.l3.guard import guarded

GEOM = PoolGeometry(num_slots=16, num_layers=3, blocks_per_page=2, block_bytes=256)
NS = KeyNamespace("tiny", "float32", "cpu:NHD", 64, 1)
RECORD = FILE_HEADER_BYTES + GEOM.page_bytes
LAYOUT = SpanLayout(4)

needs_native = pytest.mark.skipif(not native_io.available(),
                                  reason="span files go through the GIL-free batch path")


def config(path: Path, rank: int = 0) -> StorageConfig:
    return StorageConfig(tp_rank=rank, tp_size=2, namespace=NS.fingerprint(),
                         mem_layout="page_first", page_bytes=GEOM.page_bytes,
                         extra_config={"path": str(path)})


def pool(seed: int) -> HostPagePool:
    p = HostPagePool(GEOM, layout="page_first", pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    p.buffer.copy_(torch.randint(0, 256, p.buffer.shape, dtype=torch.uint8, generator=gen))
    return p


KEYS = page_keys(NS.seed(), list(range(64 * 8)), 64)  # 8 pages: two spans of 4
HEX = [k.hex() for k in KEYS]
SPANS: list[SpanRef] = [LAYOUT.ref(KEYS, i) for i in range(8)]  # type: ignore[misc]


def backends(tmp_path: Path, rank: int = 0) -> tuple[FileBackend, FileBackend, HostPagePool,
                                                     HostPagePool]:
    src, dst = pool(1), pool(2)
    a, b = guarded(FileBackend(config(tmp_path, rank))), guarded(FileBackend(config(tmp_path, rank)))
    a.register_host_pool(src)
    b.register_host_pool(dst)
    assert a.capabilities.spans and b.capabilities.spans
    assert a.write(WriteBatch(HEX, list(range(8)), SPANS)) == [True] * 8
    return a, b, src, dst


def span_file(backend: FileBackend, span: SpanRef) -> Path:
    return backend.inner.page_path(span.key.hex())


@needs_native
def test_a_span_is_one_file_of_its_records_and_reads_back(tmp_path):
    a, b, src, dst = backends(tmp_path)
    files = sorted(p for p in (tmp_path / "pages").rglob("*.page"))
    assert len(files) == 2 and all(p.stat().st_size == 4 * RECORD for p in files)
    assert not any((b.exists_prefix([k]) == 1) for k in HEX)  # no page objects
    assert b.exists_prefix([s.key.hex() for s in (SPANS[0], SPANS[4])]) == 2
    # Any subset, any slots: the middle of the second span, then the first span.
    got = b.read(ReadBatch(HEX[5:7] + HEX[:4], [9, 8, 15, 14, 13, 12], SPANS[5:7] + SPANS[:4]))
    assert got == [True] * 6
    for s, d in zip([5, 6, 0, 1, 2, 3], [9, 8, 15, 14, 13, 12], strict=True):
        assert torch.equal(src.buffer[s], dst.buffer[d])
    assert b.stats().get_hits == 6 and b.stats().bytes_read == 6 * GEOM.page_bytes
    # Stored again: the file is kept (a second writer skips it).
    assert a.write(WriteBatch(HEX, list(range(8)), SPANS)) == [True] * 8
    assert a.stats().set_skipped_existing == 8


@needs_native
def test_a_flipped_byte_inside_a_span_is_a_miss_for_that_page_only(tmp_path):
    a, b, src, dst = backends(tmp_path)
    path = span_file(b, SPANS[0])
    with open(path, "r+b") as f:  # page 2's payload, somewhere in the middle
        f.seek(2 * RECORD + FILE_HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    got = b.read(ReadBatch(HEX[:4], [12, 13, 14, 15], SPANS[:4]))
    assert got == [True, True, False, True]
    for s, d in zip([0, 1, 3], [12, 13, 15], strict=True):
        assert torch.equal(src.buffer[s], dst.buffer[d])
    assert b.stats().corrupt_pages == 1
    # Quarantined after its good records were served: the next store writes it anew.
    assert not path.exists() and len(list((tmp_path / "quarantine").iterdir())) == 1
    assert a.write(WriteBatch(HEX[:4], [0, 1, 2, 3], SPANS[:4])) == [True] * 4
    assert b.read(ReadBatch(HEX[:4], [12, 13, 14, 15], SPANS[:4])) == [True] * 4


@needs_native
@pytest.mark.parametrize("cut", [1, RECORD + 7, 3 * RECORD - 1])
def test_a_truncated_span_file_serves_the_records_before_the_cut(tmp_path, cut):
    _, b, src, dst = backends(tmp_path)
    path = span_file(b, SPANS[4])
    size = path.stat().st_size
    os.truncate(path, size - cut)
    whole = (size - cut) // RECORD  # records still complete
    got = b.read(ReadBatch(HEX[4:], [8, 9, 10, 11], SPANS[4:]))
    assert got == [i < whole for i in range(4)]
    for i in range(whole):
        assert torch.equal(src.buffer[4 + i], dst.buffer[8 + i])


@needs_native
def test_a_longer_span_file_is_refused(tmp_path):
    _, b, _, _ = backends(tmp_path)
    with open(span_file(b, SPANS[0]), "ab") as f:
        f.write(b"\0")
    assert b.read(ReadBatch(HEX[:4], [8, 9, 10, 11], SPANS[:4])) == [False] * 4


@needs_native
def test_another_ranks_span_file_under_this_name_is_a_miss(tmp_path):
    # Rank 1's files, renamed to rank 0's names: foreign records (their fingerprint).
    other, mine = tmp_path / "other", tmp_path / "mine"
    a1, _, _, _ = backends(other, rank=1)
    b0 = guarded(FileBackend(config(mine, 0)))
    dst = pool(3)
    b0.register_host_pool(dst)
    before = dst.buffer.clone()
    for span in (SPANS[0], SPANS[4]):
        target = b0.inner.page_path(span.key.hex())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(a1.inner.page_path(span.key.hex()), target)
    assert b0.exists_prefix([SPANS[0].key.hex()]) == 1  # exists is a hint; reads decide
    assert b0.read(ReadBatch(HEX, list(range(8, 16)), SPANS)) == [False] * 8
    assert b0.stats().corrupt_pages == 8
    assert torch.equal(dst.buffer[:8], before[:8])


@needs_native
def test_missing_spans_are_plain_misses_and_a_past_deadline_reads_nothing(tmp_path):
    _, b, _, _ = backends(tmp_path)
    other = page_keys(NS.seed(), list(range(7, 7 + 64 * 4)), 64)
    refs = [LAYOUT.ref(other, i) for i in range(4)]
    assert b.read(ReadBatch([k.hex() for k in other], [8, 9, 10, 11],
                            refs)) == [False] * 4  # type: ignore[arg-type]
    assert b.stats().get_misses == 4 and b.stats().corrupt_pages == 0
    before = b.stats().get_pages
    late = time.monotonic() - 1
    assert b.read(ReadBatch(HEX[:4], [8, 9, 10, 11], SPANS[:4], late)) == [False] * 4
    assert b.stats().get_pages == before  # not read: neither hit nor miss


@needs_native
def test_incomplete_spans_are_not_stored_and_delete_and_retain_take_span_keys(tmp_path):
    src = pool(1)
    a = guarded(FileBackend(config(tmp_path)))
    a.register_host_pool(src)
    # The first span lacks its page 2: not stored (the caller stores page objects).
    rows = [0, 1, 3, 4, 5, 6, 7]
    got = a.write(WriteBatch([HEX[i] for i in rows], rows, [SPANS[i] for i in rows]))
    assert got == [False, False, False, True, True, True, True]
    assert not span_file(a, SPANS[0]).exists() and span_file(a, SPANS[4]).exists()
    assert a.retain([SPANS[4].key.hex()], time.time() + 60) == 1
    assert a.delete([SPANS[4].key.hex()]) == 1 and not span_file(a, SPANS[4]).exists()


def test_without_the_batch_path_the_backend_keeps_page_objects(tmp_path, monkeypatch):
    monkeypatch.setattr(native_io, "available", lambda: False)
    assert not guarded(FileBackend(config(tmp_path))).capabilities.spans
