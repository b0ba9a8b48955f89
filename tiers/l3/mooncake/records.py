"""Mooncake objects as records: where each page lies (its object, its record) and the calls.

Contract: a page object is record 0 of 1; a span object (tiers/index/spans.py)
holds its pages' records back to back. Each record is the 128-byte
``integrity`` header, then the payload. ``group_objects`` groups a batch's places
by object, ``header_rows`` lays every record's header out in one arena,
``chunks`` cuts a batch into calls of at most ``ARENA_PAGES`` records (an
object never split, no place twice in a call). ``is_rpc_failure`` tells
Mooncake's RPC error codes (the master is unreachable) from the others.
"""

from __future__ import annotations

import torch

from hicache.tiers.l3 import integrity

HEADER = integrity.HEADER_BYTES
# Header slots per multi-buffer batch call; larger batches are chunked.
ARENA_PAGES = 256
# Mooncake ErrorCode values this backend distinguishes.
RC_OBJECT_NOT_FOUND = -704
RC_BUFFER_OVERFLOW = -600


def is_rpc_failure(rc: int) -> bool:
    """Mooncake's RPC error codes (RPC_FAIL -900, timeouts, ...): the master is unreachable."""
    return -999 <= rc <= -900


def ptr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


# A page's place in the store: its object's key, its record there and the object's
# number of records (a page object: record 0 of 1; a span object: tiers/index/spans.py).
Place = tuple[str, int, int]


def group_objects(places: list[Place]) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """Object key -> (its record count, [(record, page row)]), in first-seen order."""
    out: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    for i, (okey, record, count) in enumerate(places):
        out.setdefault(okey, (count, []))[1].append((record, i))
    return out


def header_rows(objects: dict[str, tuple[int, list[tuple[int, int]]]]) -> dict[str, int]:
    """Each object's first row in a header arena that holds all records of all objects."""
    rows, at = {}, 0
    for okey, (count, _) in objects.items():
        rows[okey] = at
        at += count
    return rows


def chunks(places: list[Place]) -> list[tuple[int, int]]:
    """Cut a batch into calls: at most ``ARENA_PAGES`` records each (an object larger
    than that is a call of its own), objects never split, no place twice in a call
    (a page asked twice goes in the next call)."""
    out: list[tuple[int, int]] = []
    lo, records = 0, 0
    seen: set[Place] = set()
    objects: set[str] = set()
    for i, place in enumerate(places):
        okey, _, count = place
        new = okey not in objects
        if i > lo and (place in seen or new and records + count > ARENA_PAGES):
            out.append((lo, i))
            lo, records, seen, objects = i, 0, set(), set()
            new = True
        seen.add(place)
        if new:
            objects.add(okey)
            records += count
    if lo < len(places):
        out.append((lo, len(places)))
    return out
