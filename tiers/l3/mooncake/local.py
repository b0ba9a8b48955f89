"""Mooncake objects that live in this process's own segment, read in place.

A worker contributes its share of the Mooncake Store's memory (``global_segment_size``):
the master places some objects there. Mooncake reads those with a memcpy from the
segment into our buffer, and we then hash the copy in a second pass. Where the
replica is ours, ``native_io.copy_records`` copies and hashes in one pass instead.

Contract:
- ``LocalSegment.mount(store, size, protocol, probe)`` calls
  ``allocate_and_mount_segment`` and learns where the segment lies: a probe object
  put with ``preferred_segment`` = this client, its descriptor read back (address
  and the transport endpoint the master names for the segment), then removed. The
  segment is the ``size`` bytes around the probe, inside the readable-writable
  mapping of this process (``/proc/self/maps``) that holds it. It
  returns Mooncake's result and a ``LocalSegment``, or None in its place when any of
  that cannot be learnt (not Linux, the probe landed elsewhere, a call failed): then
  every read goes through Mooncake.
- ``addresses(store, okeys, sizes)``: one ``batch_get_replica_desc`` call; per key the
  address of a complete memory replica of exactly its size in bytes whose endpoint is
  ours and whose bytes lie inside the mapping found at mount, else ``ELSEWHERE``
  (read it through Mooncake). A key without replicas is ``ELSEWHERE`` too: Mooncake
  0.3.13 answers a dead master with no replicas at all, so only its get tells a
  missing object from a failing store. A failing call never raises.
- Only memory this process mapped is read, and every record read is checked
  (header, checksum) by the caller; a record that fails the check after a read in
  place is read again through Mooncake before it counts as corrupt (an object
  evicted and its memory reused during the copy is not a corrupt object).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ELSEWHERE = 0  # a replica exists outside this process (or could not be placed)
PROBE_BYTES = 128


def _rw_mappings() -> list[tuple[int, int]]:
    """This process's readable-writable mappings, as (start, end)."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 2 and fields[1].startswith("rw"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    return out


def _memory_replica(replicas: Any) -> tuple[int, int, str] | None:
    """(address, size, endpoint) of the first complete memory replica, else None."""
    import mooncake.store as ms

    for rep in replicas:
        if rep.is_memory_replica() and rep.status == ms.ReplicaStatus.COMPLETE:
            buf = rep.get_memory_descriptor().buffer_descriptor
            return int(buf.buffer_address), int(buf.size), str(buf.transport_endpoint)
    return None


@dataclass(frozen=True)
class LocalSegment:
    """Where this client's segment lies in the process, and the endpoint naming it."""

    start: int
    end: int
    endpoint: str

    @classmethod
    def mount(cls, store: Any, size: int, protocol: str, probe: tuple[int, str] | None,
              ) -> tuple[Any, LocalSegment | None]:
        """``allocate_and_mount_segment`` (its result, unchanged) and the segment found.
        ``probe``: a registered buffer of ``PROBE_BYTES`` and a key to put a probe
        object under (None: no probe, no local reads)."""
        result = store.allocate_and_mount_segment(size, protocol)
        if not sys.platform.startswith("linux") or probe is None:
            return result, None
        if not isinstance(result, dict) or int(result.get("ret", -1)) != 0:
            return result, None
        try:
            return result, cls._find(store, size, probe)
        except Exception as exc:  # noqa: BLE001 - local reads are an optimisation only
            logger.info("mooncake: own segment not located (%s); reads go through Mooncake",
                        exc)
            return result, None

    @classmethod
    def _find(cls, store: Any, size: int, probe: tuple[int, str]) -> LocalSegment | None:
        import mooncake.store as ms

        ptr, key = probe
        config = ms.ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        if store.batch_put_from([key], [ptr], [PROBE_BYTES], config) != [0]:
            return None
        try:
            found = _memory_replica(store.get_replica_desc(key))
        finally:
            store.remove(key, True)
        if found is None:
            return None
        address, _, endpoint = found
        for start, end in _rw_mappings():
            if start <= address and address + PROBE_BYTES <= end:
                # the segment: size bytes in one piece, the probe somewhere inside
                return cls(max(start, address + PROBE_BYTES - size),
                           min(end, address + size), endpoint)
        return None

    def addresses(self, store: Any, okeys: list[str], sizes: list[int]) -> list[int]:
        """Per key: its replica's address here, or ``ELSEWHERE``."""
        try:
            descs = store.batch_get_replica_desc(okeys)
        except Exception as exc:  # noqa: BLE001 - Mooncake's own read path follows
            logger.debug("mooncake batch_get_replica_desc raised: %s", exc)
            return [ELSEWHERE] * len(okeys)
        out = []
        for okey, size in zip(okeys, sizes, strict=True):
            found = _memory_replica(descs.get(okey) or [])
            if found is None:
                out.append(ELSEWHERE)
                continue
            address, got, endpoint = found
            here = (endpoint == self.endpoint and got == size
                    and self.start <= address and address + size <= self.end)
            out.append(address if here else ELSEWHERE)
        return out
