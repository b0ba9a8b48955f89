"""Plain data of the L3 I/O thread: how a queued backup is cut into parts, and which of
its pages make whole span objects."""

from hicache.tiers.index.spans import SpanRef
from hicache.tiers.worker.l3_jobs import split_backup, whole_spans


def page(n: int, span: bytes | None = None, index: int = 0, count: int = 4):
    ref = SpanRef(span, index, count) if span is not None else None
    return (bytes([n]) * 32, n, bytes([n]) * 32, ref)


def test_a_short_backup_is_one_part():
    batch = [page(i) for i in range(3)]
    assert split_backup(batch, 8) == (batch, [])


def test_pages_without_spans_are_cut_at_the_limit():
    batch = [page(i) for i in range(10)]
    head, rest = split_backup(batch, 4)
    assert [p[1] for p in head] == [0, 1, 2, 3]
    assert [p[1] for p in rest] == list(range(4, 10))


def test_a_span_the_head_starts_stays_whole_in_it():
    a = [page(i, b"A" * 32, i) for i in range(4)]
    b = [page(4 + i, b"B" * 32, i) for i in range(4)]
    loose = [page(8), page(9)]
    head, rest = split_backup(a[:2] + loose + a[2:] + b, 3)
    # The head takes A's first pages and one loose page; A's late pages follow it;
    # the second loose page and all of B wait.
    assert [p[1] for p in head] == [0, 1, 8, 2, 3]
    assert [p[1] for p in rest] == [9, 4, 5, 6, 7]
    assert {p[3].key for p in rest if p[3]} == {b"B" * 32}


def test_only_spans_with_every_page_here_are_whole_each_in_order():
    a = [page(i, b"A" * 32, i) for i in range(4)]
    b = [page(4 + i, b"B" * 32, i) for i in range(4)]
    got = whole_spans([a[2], page(9), a[0], b[0], a[3], a[1], b[1]])
    assert [p[1] for p in got] == [0, 1, 2, 3]  # B lacks two pages; loose pages never
