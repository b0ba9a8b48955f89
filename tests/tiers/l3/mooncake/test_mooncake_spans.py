"""Mooncake span objects and reads in place, against a real mooncake_master on 127.0.0.1.

A span is one Mooncake object holding its pages' records; any subset of them reads back
bit-exact, from the writer's own segment (copied and checked in one pass, no transfer)
and through Mooncake from a client that holds no segment. A damaged record is a miss for
its page only; a truncated object a miss for all its pages; bytes flipped in the
segment's memory itself are caught as well. No mocks.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("mooncake.store")

from hicache.integration.bench.mooncake_service import (  # noqa: E402
    apply_client_env,
    start_mooncake,
)
from hicache.tiers.index.page_keys import KeyNamespace, page_keys  # noqa: E402
from hicache.tiers.index.spans import SpanLayout, SpanRef  # noqa: E402
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry  # noqa: E402
from hicache.tiers.l3 import integrity, native_io  # noqa: E402
from hicache.tiers.l3.base import ReadBatch, StorageConfig, StorageStats, WriteBatch  # noqa: E402
from hicache.tiers.l3.guard import guarded
from hicache.tiers.l3.mooncake.backend import MooncakeBackend  # noqa: E402

GEOM = PoolGeometry(num_slots=16, num_layers=3, blocks_per_page=2, block_bytes=256)
NS = KeyNamespace("tiny", "float32", "cpu:NHD", 64, 1)
RECORD = integrity.HEADER_BYTES + GEOM.page_bytes
LAYOUT = SpanLayout(4)
SEGMENT = 32 << 20

needs_native = pytest.mark.skipif(not native_io.available(),
                                  reason="reads in place copy through native_io")


def config(extra: dict, layout: str = "page_first") -> StorageConfig:
    return StorageConfig(tp_rank=0, tp_size=1, namespace=NS.fingerprint(), mem_layout=layout,
                         page_bytes=GEOM.page_bytes, extra_config=extra)


def pool(seed: int, layout: str = "page_first") -> HostPagePool:
    p = HostPagePool(GEOM, layout=layout, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    p.buffer.copy_(torch.randint(0, 256, p.buffer.shape, dtype=torch.uint8, generator=gen))
    return p


def spans_of(seed: int) -> tuple[list[str], list[SpanRef]]:
    """Eight pages of one request: two spans of four."""
    keys = page_keys(NS.seed(), list(range(seed, seed + 64 * 8)), 64)
    refs = [LAYOUT.ref(keys, i) for i in range(8)]
    assert all(r is not None for r in refs)
    return [k.hex() for k in keys], refs  # type: ignore[return-value]


def delta(backend: MooncakeBackend, before: StorageStats) -> StorageStats:
    now = backend.stats().as_dict()
    return StorageStats(**{k: v - before.as_dict()[k] for k, v in now.items()})


@pytest.fixture(scope="module")
def store():
    """One master; the writer is the only client holding a segment, so every object
    lies in the writer's memory; the reader holds none and reads through Mooncake."""
    apply_client_env()
    with start_mooncake() as svc:
        writer = guarded(MooncakeBackend(config(svc.extra_config(SEGMENT))))
        writer.register_host_pool(pool(1))
        reader = guarded(MooncakeBackend(config({**svc.extra_config(SEGMENT),
                                         "global_segment_size": 0})))
        reader.register_host_pool(pool(2))
        raw = writer.inner._store  # the same client, for damage done from outside the backend
        yield writer, reader, raw, svc
        reader.close()
        writer.close()


@needs_native
def test_the_writer_finds_its_own_segment(store):
    writer, reader, *_ = store
    segment = writer.inner._segment
    assert segment is not None and segment.end > segment.start
    assert reader.inner._segment is None  # no segment of its own: every read is a transfer


@pytest.mark.parametrize("who", ["writer", "reader"])
def test_a_span_is_one_object_and_any_subset_reads_back(store, who):
    writer, reader, *_ = store
    backend = writer if who == "writer" else reader
    hexes, spans = spans_of(1000 if who == "writer" else 2000)
    before = writer.stats()
    assert writer.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
    assert delta(writer, before).set_pages == 8
    assert not any((backend.exists_prefix([k]) == 1) for k in hexes)  # no page objects
    assert backend.exists_prefix([spans[0].key.hex(), spans[4].key.hex()]) == 2
    size = writer.inner._store.get_size(writer.object_key(spans[0].key.hex()))
    assert size == 4 * RECORD
    # Any subset, any slots: the middle of the second span, then the whole first one.
    before = backend.stats()
    slots = [9, 8, 15, 14, 13, 12]
    got = backend.read(ReadBatch(hexes[5:7] + hexes[:4], slots, spans[5:7] + spans[:4]))
    assert got == [True] * 6
    src, dst = writer.pool, backend.pool
    assert src is not None and dst is not None
    for s, d in zip([5, 6, 0, 1, 2, 3], slots, strict=True):
        assert torch.equal(src.buffer[s], dst.buffer[d])
    st = delta(backend, before)
    assert st.get_hits == 6 and st.corrupt_pages == 0
    # In place exactly where the object lies in this process's memory.
    assert st.pages_in_place == (6 if who == "writer" and native_io.available() else 0)
    # Stored again: the objects are kept (skipped), nothing written.
    before = writer.stats()
    assert writer.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
    assert delta(writer, before).set_skipped_existing == 8
    assert delta(writer, before).set_pages == 0


def test_only_whole_spans_are_stored(store):
    writer, *_ = store
    hexes, spans = spans_of(3000)
    # the first span whole, the second cut after two pages: those are not stored
    assert writer.write(WriteBatch(hexes[:6], list(range(6)), spans[:6])) == [True] * 4 + \
        [False] * 2
    assert writer.exists_prefix([spans[0].key.hex(), spans[4].key.hex()]) == 1


def flip(raw, okey: str, at: int) -> None:
    data = bytearray(raw.get(okey))
    data[at] ^= 0xFF
    assert raw.upsert(okey, bytes(data)) == 0


def written(store, who: str, seed: int):
    """Two spans the writer stored; the backend that reads them (``who``)."""
    writer, reader, raw, _ = store
    hexes, spans = spans_of(seed)
    assert writer.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
    return writer, writer if who == "writer" else reader, raw, hexes, spans


@pytest.mark.parametrize("who", ["writer", "reader"])
def test_a_damaged_record_is_a_miss_for_its_page_only(store, who):
    writer, backend, raw, hexes, spans = written(store, who, 4000 if who == "writer" else 5000)
    okey = writer.object_key(spans[0].key.hex())
    flip(raw, okey, 2 * RECORD + integrity.HEADER_BYTES + 5)  # record 2's payload
    before = backend.stats()
    got = backend.read(ReadBatch(hexes[:4], [8, 9, 10, 11], spans[:4]))
    assert got == [True, True, False, True]
    src, dst = writer.pool, backend.pool
    assert src is not None and dst is not None
    for s, d in ((0, 8), (1, 9), (3, 11)):
        assert torch.equal(src.buffer[s], dst.buffer[d])
    st = delta(backend, before)
    assert st.corrupt_pages == 1 and st.get_hits == 3 and st.get_misses == 1
    # The object is removed once its good records were served: the next store rewrites it.
    assert backend.exists_prefix([spans[0].key.hex()]) == 0
    assert writer.write(WriteBatch(hexes[:4], list(range(4)), spans[:4])) == [True] * 4
    assert backend.read(ReadBatch(hexes[:4], [8, 9, 10, 11], spans[:4])) == [True] * 4


@pytest.mark.parametrize("who", ["writer", "reader"])
def test_a_truncated_or_foreign_object_is_a_miss_for_all_its_pages(store, who):
    writer, backend, raw, hexes, spans = written(store, who, 6000 if who == "writer" else 7000)
    first, second = (writer.object_key(spans[i].key.hex()) for i in (0, 4))
    data = raw.get(first)
    assert raw.upsert(first, data[:-100]) == 0  # truncated
    assert raw.upsert(second, data) == 0  # another span's records: right size, wrong keys
    before = backend.stats()
    assert backend.read(ReadBatch(hexes, list(range(8, 16)), spans)) == [False] * 8
    st = delta(backend, before)
    assert st.corrupt_pages == 8 and st.get_hits == 0
    assert backend.exists_prefix([spans[0].key.hex()]) == 0
    assert backend.exists_prefix([spans[4].key.hex()]) == 0


@needs_native
def test_bytes_flipped_in_the_segment_itself_are_caught_in_place(store):
    """What a read in place sees is what it checks: a bit flipped in the segment's
    memory (not through Mooncake) is a miss for that page, the rest is served."""
    writer, _, raw, _ = store
    hexes, spans = spans_of(8000)
    assert writer.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
    okey = writer.object_key(spans[4].key.hex())
    desc = raw.get_replica_desc(okey)[0].get_memory_descriptor().buffer_descriptor
    at = int(desc.buffer_address) + RECORD + integrity.HEADER_BYTES + 100  # record 1
    byte = ctypes.c_uint8.from_address(at)
    byte.value ^= 0x10
    before = writer.stats()
    got = writer.read(ReadBatch(hexes[4:], [8, 9, 10, 11], spans[4:]))
    assert got == [True, False, True, True]
    st = delta(writer, before)
    assert st.corrupt_pages == 1 and st.pages_in_place >= 4


def test_page_objects_still_read_in_place_and_through_mooncake(store):
    writer, reader, *_ = store
    hexes, _ = spans_of(9000)
    assert writer.write(WriteBatch(hexes[:3], [0, 1, 2])) == [True] * 3
    for backend in (writer, reader):
        before = backend.stats()
        assert backend.read(ReadBatch(hexes[:3], [12, 13, 14])) == [True] * 3
        assert delta(backend, before).get_hits == 3
        src, dst = writer.pool, backend.pool
        assert src is not None and dst is not None
        for s in range(3):
            assert torch.equal(src.buffer[s], dst.buffer[12 + s])
    assert reader.stats().pages_in_place == 0


def test_layer_first_pools_keep_page_objects(store):
    *_, svc = store
    backend = guarded(MooncakeBackend(config({**svc.extra_config(SEGMENT), "global_segment_size": 0},
                                     layout="layer_first")))
    try:
        assert not backend.capabilities.spans
    finally:
        backend.close()


@needs_native
def test_reads_in_place_hash_on_a_helper_thread_when_asked():
    """verify = helper: a helper thread hashes each record right behind its copy; same
    bytes, same checks (a flipped record is still a miss for its page only)."""
    with start_mooncake() as svc:
        backend = guarded(MooncakeBackend(config({**svc.extra_config(SEGMENT), "verify": "helper"})))
        try:
            backend.register_host_pool(pool(3))
            assert backend.inner._verify_helper is not None and backend.inner._segment is not None
            hexes, spans = spans_of(10_000)
            assert backend.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
            flip(backend.inner._store, backend.object_key(spans[0].key.hex()),
                 3 * RECORD + integrity.HEADER_BYTES)  # record 3's first payload byte
            before = backend.stats()
            got = backend.read(ReadBatch(hexes, list(range(8, 16)), spans))
            assert got == [True] * 3 + [False] + [True] * 4
            src = backend.pool
            assert src is not None
            for s in (0, 1, 2, 4, 5, 6, 7):
                assert torch.equal(src.buffer[s], src.buffer[8 + s])
            st = delta(backend, before)
            assert st.pages_in_place == 8 and st.corrupt_pages == 1
        finally:
            backend.close()


def test_batches_are_cut_into_calls_without_splitting_an_object():
    from hicache.tiers.l3.mooncake.records import ARENA_PAGES
    from hicache.tiers.l3.mooncake.records import chunks as _chunks

    span = [("s", r, 4) for r in range(4)]
    pages = [(f"p{i}", 0, 1) for i in range(ARENA_PAGES)]
    # a batch that overflows the arena is cut before the object that does not fit
    assert _chunks(pages[:-2] + span) == [(0, ARENA_PAGES - 2), (ARENA_PAGES - 2,
                                                                 ARENA_PAGES + 2)]
    # a page asked twice goes in the next call
    assert _chunks([("a", 0, 1), ("b", 0, 1), ("a", 0, 1)]) == [(0, 2), (2, 3)]
    # an object larger than the arena is a call of its own
    big = [("big", r, ARENA_PAGES + 8) for r in range(ARENA_PAGES + 8)]
    assert _chunks([("a", 0, 1), *big, ("b", 0, 1)]) == [
        (0, 1), (1, ARENA_PAGES + 9), (ARENA_PAGES + 9, ARENA_PAGES + 10)]


@needs_native
def test_only_replicas_inside_the_segment_found_at_mount_are_read_in_place(store):
    """A replica is read in place only when the master names this client's endpoint, its
    bytes lie inside the segment found at mount and its size is the object's: anything
    else (another endpoint, an address outside, another size) goes through Mooncake."""
    from dataclasses import replace

    from hicache.tiers.l3.mooncake.local import ELSEWHERE

    writer, *_ = store
    segment = writer.inner._segment
    assert segment is not None
    hexes, spans = spans_of(13_000)
    assert writer.write(WriteBatch(hexes, list(range(8)), spans)) == [True] * 8
    okeys = [writer.object_key(spans[i].key.hex()) for i in (0, 4)] + ["no-such-object"]
    sizes = [4 * RECORD, 4 * RECORD, 4 * RECORD]
    here = segment.addresses(writer.inner._store, okeys, sizes)
    assert all(segment.start <= a < segment.end for a in here[:2]) and here[2] == ELSEWHERE
    assert segment.addresses(writer.inner._store, okeys[:2], [RECORD, 4 * RECORD])[0] == ELSEWHERE
    for other in (replace(segment, endpoint="127.0.0.1:1"),
                  replace(segment, end=min(here[:2])),
                  replace(segment, start=max(here[:2]) + 1)):
        assert other.addresses(writer.inner._store, okeys[:2], sizes[:2]).count(ELSEWHERE) >= 1
    assert replace(segment, endpoint="127.0.0.1:1").addresses(
        writer.inner._store, okeys[:2], sizes[:2]) == [ELSEWHERE, ELSEWHERE]
