"""Span objects: how a request's pages are cut into L3 objects and found again."""

from __future__ import annotations

import pytest

from hicache.tiers.index.page_keys import page_keys
from hicache.tiers.index.spans import SpanLayout, SpanRef, pages_per_object, span_key

SEED = b"s" * 32
KEYS = page_keys(SEED, list(range(16 * 23)), 16)  # 23 pages


def test_pages_per_object_rounds_down_and_never_below_one() -> None:
    assert pages_per_object(1.0, 64 << 10) == 16
    assert pages_per_object(1.0, 300 << 10) == 3
    assert pages_per_object(1.0, 2 << 20) == 1
    assert pages_per_object(0, 64 << 10) == 1


def test_refs_cover_only_spans_the_keys_reach_the_end_of() -> None:
    layout = SpanLayout(8)
    ref = layout.ref(KEYS, 9)
    assert ref == SpanRef(span_key(KEYS[15], 8), 1, 8)
    assert layout.ref(KEYS, 16) is None  # pages 16..23: the keys end at 22
    assert layout.ref(KEYS[:16], 15) == SpanRef(span_key(KEYS[15], 8), 7, 8)
    assert SpanLayout(1).ref(KEYS, 3) is None


def test_a_span_key_names_the_pages_before_it() -> None:
    other = page_keys(SEED, [1, *range(1, 16 * 23)], 16)
    layout = SpanLayout(8)
    assert layout.object_keys(KEYS)[1:] != layout.object_keys(other)[1:]
    assert span_key(KEYS[7], 8) != span_key(KEYS[7], 4)


def test_whole_refs_need_every_page_of_the_span_in_the_range() -> None:
    layout = SpanLayout(4)
    refs = layout.refs(KEYS, 2, 13, whole=True)
    # Pages 2..12: span [4, 8) and [8, 12) are whole; 2, 3 and 12 are not.
    assert [r is not None for r in refs] == [False, False] + [True] * 8 + [False]
    assert {r.key for r in refs if r is not None} == set(layout.object_keys(KEYS)[1:3])


class Store:
    """A store holding some span objects and some page objects."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = {k.hex() for k in keys}
        self.asked: list[int] = []

    def exists_prefix(self, hex_keys: list[str]) -> int:
        self.asked.append(len(hex_keys))
        n = 0
        while n < len(hex_keys) and hex_keys[n] in self.keys:
            n += 1
        return n


@pytest.mark.parametrize("end", [23, 20, 16, 5])
def test_a_run_of_span_objects_is_one_question(end: int) -> None:
    layout = SpanLayout(4)
    spans = layout.object_keys(KEYS)  # 5 spans: pages 0..19
    store = Store(set(spans) | set(KEYS[20:22]))
    found = layout.run_in_store(store.exists_prefix, KEYS, 0, end)
    assert found == min(end, 22)
    assert store.asked[0] == min(5, -(-end // 4))


def test_a_run_goes_through_page_objects_where_a_span_was_stored_page_by_page() -> None:
    layout = SpanLayout(4)
    spans = layout.object_keys(KEYS)
    # Spans 0, 1 as objects, span 2 page by page (a chunk boundary), 3 and 4 as objects.
    store = Store({spans[0], spans[1], *KEYS[8:12], spans[3], spans[4]})
    assert layout.run_in_store(store.exists_prefix, KEYS, 0, 23) == 20
    assert layout.run_in_store(store.exists_prefix, KEYS, 6, 23) == 14
    # A page object missing inside a span stored page by page ends the run there.
    store = Store({spans[0], *KEYS[4:6], *KEYS[7:8]})
    assert layout.run_in_store(store.exists_prefix, KEYS, 0, 23) == 6


def test_pages_only_layout_asks_page_objects_once() -> None:
    store = Store(set(KEYS[:10]))
    assert SpanLayout(1).run_in_store(store.exists_prefix, KEYS, 2, 23) == 8
    assert store.asked == [21]
