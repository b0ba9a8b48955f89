"""L3 objects that hold runs of pages (spans), while the tree and lookups stay per page.

See DESIGN.md "L3 objects". Contract:

- A request's pages are cut into spans of ``SpanLayout.pages`` pages at fixed
  positions: span ``m`` is pages ``[m * pages, (m + 1) * pages)`` of the
  request's page keys, counted from its first token. Only a span whose every
  page has a key (the request reaches its end) is ever an object.
- The object's key is ``span_key(last page key, pages)``: the last page's key
  already names every page before it (page keys are a hash chain), so two
  requests share a span object exactly when they share all its pages, and
  the key is a 32-byte digest like a page key (every backend stores it under
  its own ``object_key`` as it does a page).
- A span object holds its pages' records in order, each verified on its own
  (integrity.py): a bad record is a miss for that page only.
- Per-page objects still exist: a span not stored in one plan (chunked
  prefill cuts it, a sliding window, a fault) is stored page by page, and
  ``run_in_store`` finds a run through both kinds, span by span.
- ``pages == 1`` turns spans off: every page is its own object.
- No torch, no vLLM: the scheduler and the simulator use this as is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_TAG = b"hicache-l3-span-v1"
MIB = 1 << 20


def span_key(last: bytes, pages: int) -> bytes:
    """Key of the span object of ``pages`` pages ending with page key ``last``."""
    return hashlib.sha256(_TAG + pages.to_bytes(4, "little") + last).digest()


def pages_per_object(object_mib: float, page_bytes: int) -> int:
    """Pages per span for objects of at most ``object_mib`` MiB (at least 1 page;
    ``object_mib`` 0 = one page per object)."""
    if object_mib <= 0 or page_bytes <= 0:
        return 1
    return max(1, int(object_mib * MIB) // page_bytes)


@dataclass(frozen=True)
class SpanRef:
    """Where a page lives in a span object."""

    # The span object's key (``span_key``).
    key: bytes
    # The page's place in the object, and the object's number of pages.
    index: int
    count: int


@dataclass(frozen=True)
class SpanLayout:
    """How a request's pages are cut into L3 objects (see the module docstring)."""

    pages: int = 1

    @property
    def enabled(self) -> bool:
        return self.pages > 1

    def ref(self, keys: Sequence[bytes], position: int) -> SpanRef | None:
        """The span object of page ``position`` of ``keys`` (a request's page keys from
        its first page), or None when spans are off or ``keys`` end inside the span."""
        return self.refs(keys, position, position + 1)[0]

    def refs(self, keys: Sequence[bytes], start: int, end: int, whole: bool = False,
             ) -> list[SpanRef | None]:
        """``ref`` of every position in ``[start, end)`` (each span's key hashed once);
        ``whole``: only for spans all of whose pages lie in ``[start, end)`` (a store
        that writes the whole object at once), None elsewhere."""
        out: list[SpanRef | None] = []
        known: dict[int, bytes] = {}  # first page of a span -> its key
        for p in range(start, end):
            first = p - p % self.pages
            last = first + self.pages - 1
            if (not self.has_span(keys, p)
                    or whole and (first < start or last >= end)):
                out.append(None)
                continue
            if first not in known:
                known[first] = span_key(keys[last], self.pages)
            out.append(SpanRef(known[first], p - first, self.pages))
        return out

    def has_span(self, keys: Sequence[bytes], position: int) -> bool:
        """Whether page ``position`` lies in a span ``keys`` reach the end of."""
        return self.pages > 1 and position - position % self.pages + self.pages <= len(keys)

    def object_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """Keys of every span object ``keys`` (from the first page) could be stored in."""
        if self.pages <= 1:
            return []
        return [span_key(keys[last], self.pages)
                for last in range(self.pages - 1, len(keys), self.pages)]

    def object_key(self, last: bytes) -> bytes:
        """Key of the span object whose last page has key ``last``."""
        return span_key(last, self.pages)

    def ends_span(self, position: int) -> bool:
        """Whether page ``position`` is the last page of its span."""
        return self.pages > 1 and (position + 1) % self.pages == 0

    def run_in_store(self, exists_prefix: Callable[[list[str]], int], keys: Sequence[bytes],
                     start: int, end: int) -> int:
        """How many pages of ``keys[start:end]`` the store holds consecutively, in span
        objects or page objects. ``exists_prefix`` answers for hex keys (how many lead).
        Asks span objects for the spans from ``start`` on, then page objects where a
        span object is missing, and so on: two questions per span stored page by page,
        one for a run of span objects."""
        pos, missing_span = start, -1
        objects: list[bytes] | None = None
        while pos < end:
            span = pos // self.pages
            if span != missing_span and self.has_span(keys, pos):
                objects = objects if objects is not None else self.object_keys(keys)
                spans = objects[span:(end - 1) // self.pages + 1]
                found = exists_prefix([k.hex() for k in spans])
                if found:
                    pos = (span + found) * self.pages
                if found < len(spans):
                    missing_span = span + found
                continue
            # Page objects up to the next span boundary (or the end).
            stop = end if self.pages <= 1 else min(end, pos - pos % self.pages + self.pages)
            found = exists_prefix([bytes(k).hex() for k in keys[pos:stop]])
            pos += found
            if pos < stop:
                break
        return max(0, min(pos, end) - start)


def whole_spans(spans: Sequence[SpanRef | None]) -> list[bool]:
    """Per row of a store batch: whether its span's rows are all there, in order
    (index 0 .. count - 1), so the span can be written as one object."""
    ok = [False] * len(spans)
    i = 0
    while i < len(spans):
        span = spans[i]
        if span is None:
            i += 1
            continue
        j = i + span.count
        if (span.index == 0 and j <= len(spans)
                and all((r := spans[i + k]) is not None and r.key == span.key and r.index == k
                        for k in range(span.count))):
            ok[i:j] = [True] * span.count
            i = j
        else:
            i += 1
    return ok
