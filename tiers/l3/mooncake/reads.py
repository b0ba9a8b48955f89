"""The Mooncake backend's read path: records into pool slots, checked, in place where local.

Contract: ``RecordReads._read(keys, ptrs, payloads, places)`` reads each
page's record (``places``: its object and record; default its page object)
into registered payload memory, in calls of ``records.chunks``; objects in
this instance's own mounted segment are copied and hashed in one pass
(local.py, native_io ``copy_records``), the others (and any that fail the
check in place) go through Mooncake's multi-buffer get. Every page is
checked (size, header, checksum); a bad record is a miss for its page only,
counted corrupt, and its object is removed. A mixin of ``MooncakeBackend``
(tiers/l3/mooncake/backend.py), whose state it reads.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hicache.tiers.l3 import integrity, native_io
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.mooncake import local as mooncake_local
from hicache.tiers.l3.mooncake.records import (
    HEADER,
    RC_BUFFER_OVERFLOW,
    RC_OBJECT_NOT_FOUND,
    Place,
    chunks,
    group_objects,
    header_rows,
    is_rpc_failure,
    ptr,
)
from hicache.tiers.l3.report import Report

logger = logging.getLogger(__name__)


class RecordReads:
    """The read path; see the module docstring."""

    config: StorageConfig
    report: Report
    _store: Any
    _fp: bytes
    _segment: mooncake_local.LocalSegment | None
    _verify_helper: ThreadPoolExecutor | None

    if TYPE_CHECKING:  # what it uses of StorageBackend and MooncakeBackend
        def object_key(self, key: str) -> str: ...
        def page_key_bytes(self, key: str) -> bytes: ...
        def _available(self) -> bool: ...
        def _failed(self, rc: int) -> None: ...
        def _arena(self, rows: int) -> tuple[torch.Tensor, np.ndarray] | None: ...
        def _scratch(self) -> int | None: ...
        def _remove_corrupt(self, okeys: list[str]) -> None: ...

    def _read(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
              places: list[Place] | None = None) -> list[bool]:
        """Read pages into registered payload buffers (``ptrs``, same memory as
        ``payloads``), verifying each; ``places[i]``: page i's object and record there
        (default: its page object)."""
        places = places or [(self.object_key(k), 0, 1) for k in keys]
        results: list[bool] = []
        for lo, hi in chunks(places):
            results += self._read_chunk(keys[lo:hi], ptrs[lo:hi], payloads[lo:hi],
                                        places[lo:hi])
        return results

    def _read_chunk(self, keys: list[str], ptrs: list[int], payloads: list[memoryview],
                    places: list[Place]) -> list[bool]:
        n = len(keys)
        objects = group_objects(places)  # object key -> its record count and pages there
        first = header_rows(objects)  # object key -> its first header row
        arena = self._arena(sum(c for c, _ in objects.values())) if self._available() else None
        partial = any(count > len(pages) for count, pages in objects.values())
        scratch = self._scratch() if arena is not None and partial else 0
        if arena is None or scratch is None:
            return [False] * n
        base, headers = ptr(arena[0]), arena[1]
        remote = list(objects)
        why_bad: dict[int, str | None] = {}  # page read whole -> why it is bad (None: good)
        if self._segment is not None:
            here: dict[int, int] = {}  # page -> checksum of its payload as copied
            remote = self._read_in_place(objects, first, base, ptrs, here)
            why_bad = self._checked(keys, here, headers, first, places)
            # An object with a page that failed its check in place is read again
            # through Mooncake, all of it: none of its pages counts from the copy in
            # place (that read may overwrite the slots, e.g. cut short).
            again = {places[i][0] for i, why in why_bad.items() if why is not None}
            for okey in again:
                for _, i in objects[okey][1]:
                    why_bad.pop(i, None)
            remote = [*remote, *sorted(again - set(remote))]
        failed_objects: dict[str, str] = {}
        if remote:
            arrived: dict[int, int] = {}  # page -> checksum of its payload as read
            self._read_through_mooncake(remote, objects, first, base, scratch, ptrs,
                                        payloads, arrived, failed_objects)
            why_bad.update(self._checked(keys, arrived, headers, first, places))
        results = [False] * n
        corrupt = dict(failed_objects)  # object -> why (its pages: misses)
        bad_pages = sum(1 for p in places if p[0] in failed_objects)
        for i, why in why_bad.items():
            if why is None:
                results[i] = True
            else:  # a miss for this page only; the object goes, the next store rewrites it
                logger.warning("mooncake page %s in object %s is corrupt (%s)", keys[i],
                               places[i][0], why)
                corrupt.setdefault(places[i][0], why)
                bad_pages += 1
        if corrupt:
            self.report.corrupt(bad_pages)
            self._remove_corrupt(list(corrupt))
        return results

    def _read_in_place(self, objects: dict[str, tuple[int, list[tuple[int, int]]]],
                       first: dict[str, int], base: int, ptrs: list[int],
                       arrived: dict[int, int]) -> list[str]:
        """Objects in this process's own segment: copied and hashed in one pass
        (local.py). Returns the objects to read through Mooncake."""
        assert self._segment is not None
        rec = HEADER + self.config.page_bytes
        okeys = list(objects)
        where = self._segment.addresses(self._store, okeys,
                                        [objects[o][0] * rec for o in okeys])
        remote = [o for o, at in zip(okeys, where, strict=True) if at == mooncake_local.ELSEWHERE]
        sources, hdrs, dests, pages = [], [], [], []
        for okey, at in zip(okeys, where, strict=True):
            if at > 0:
                for r, i in objects[okey][1]:
                    sources.append(at + r * rec)
                    hdrs.append(base + (first[okey] + r) * HEADER)
                    dests.append(ptrs[i])
                    pages.append(i)
        if pages:
            sums = native_io.copy_records(sources, hdrs, dests, HEADER, self.config.page_bytes,
                                          self._verify_helper)
            arrived.update(zip(pages, (int(x) for x in sums.tolist()), strict=True))
            self.report.in_place(len(pages))
        return remote

    def _read_through_mooncake(self, okeys: list[str],
                               objects: dict[str, tuple[int, list[tuple[int, int]]]],
                               first: dict[str, int], base: int, scratch: int,
                               ptrs: list[int], payloads: list[memoryview],
                               arrived: dict[int, int], failed: dict[str, str]) -> None:
        """Mooncake's multi-buffer get of whole objects: each record's header into the
        arena, its payload into the page's buffer (records not asked for: scratch)."""
        pb = self.config.page_bytes
        rec = HEADER + pb
        buffers, sizes = [], []
        for okey in okeys:
            count, pages = objects[okey]
            dest = dict(pages)
            row = base + first[okey] * HEADER
            buffers.append([a for r in range(count)
                            for a in (row + r * HEADER, ptrs[dest[r]] if r in dest else scratch)])
            sizes.append([HEADER, pb] * count)
        try:
            rcs = list(self._store.batch_get_into_multi_buffers(okeys, buffers, sizes))
        except Exception as exc:
            logger.warning("mooncake batch_get_into_multi_buffers raised: %s", exc)
            rcs = [-1] * len(okeys)
        whole: list[int] = []
        for okey, rc in zip(okeys, rcs, strict=True):
            size = objects[okey][0] * rec
            if rc == size:
                whole += [i for _, i in objects[okey][1]]
            elif (rc == RC_BUFFER_OVERFLOW or 0 <= rc < size
                  or self._wrong_size(okey, rc, size)):
                logger.warning("mooncake object %s has the wrong size (rc=%d)", okey, rc)
                failed[okey] = "wrong size"
            elif rc != RC_OBJECT_NOT_FOUND:
                self._failed(rc)
        if whole:  # every page read whole, hashed in one call without the GIL
            sums = integrity.checksums_at([ptrs[i] for i in whole],
                                          [payloads[i] for i in whole], pb)
            arrived.update(zip(whole, sums, strict=True))

    def _checked(self, keys: list[str], arrived: dict[int, int], headers: np.ndarray,
                 first: dict[str, int], places: list[Place]) -> dict[int, str | None]:
        """Header and checksum check of every page in ``arrived``: None when good, else
        why not."""
        if not arrived:
            return {}
        pages = list(arrived)
        rows = [first[places[i][0]] + places[i][1] for i in pages]
        why = integrity.check_headers(
            headers[:(max(rows) + 1) * HEADER].reshape(-1, HEADER)[rows],
            [self.page_key_bytes(keys[i]) for i in pages], self._fp, self.config.page_bytes,
            [arrived[i] for i in pages])
        return dict(zip(pages, why, strict=True))

    def _wrong_size(self, okey: str, rc: int, size: int) -> bool:
        """After a failed read (e.g. TRANSFER_FAIL for an object shorter than the
        buffers): whether the object exists with a size other than ``size``."""
        if rc == RC_OBJECT_NOT_FOUND or is_rpc_failure(rc):
            return False
        try:
            found = int(self._store.get_size(okey))
        except Exception:
            return False
        return found >= 0 and found != size
