"""Page header and checksum shared by every L3 backend: nothing wrong is ever loaded.

Contract:
- A stored page is ``HEADER_BYTES`` of header followed by ``payload_len``
  bytes of payload (the page as the host pool holds it). Backends may keep
  header and payload in one object (file, NIXL) or side by side (Mooncake),
  but they write the header this module packs and check it on every read.
- The header holds a magic and version, the payload length, the 32-byte page
  key, the 16-byte storage fingerprint (namespace, host byte order, page
  bytes, TP rank or MLA: ``StorageConfig.fingerprint``) and an xxh3-64 checksum of
  the payload.
- The version field is ``VERSION`` in its low 16 bits and the backend's
  container ``layout`` in its high 16 bits: 0 for a header directly followed
  by the payload (Mooncake, NIXL), others for
  containers that place the payload elsewhere (file: 1, header padded to
  4 KiB). A page written under another version or layout fails ``verify``
  ("bad magic/version"): it is refused, never misread.
- ``verify`` returns None when everything matches, else a short reason; the
  caller counts the page as a corrupt miss and never copies it into a slot
  that is then used.
- Batches (native_io.py checksums and checks them without the GIL):
  ``header_rows(keys, fingerprint, length, layout, width)`` packs one header per
  page into a zeroed ``(n, width)`` uint8 array with the checksum field (the 8
  little-endian bytes at ``CHECKSUM_AT``) left zero: with ``width=HEADER_BYTES`` or
  more, headers for a writer to complete; with ``width=CHECKSUM_AT``, what a page
  read back must start with.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import xxhash

MAGIC = b"HICACHE\x01"
# 2: page keys derive from vLLM block hashes; v1 pages are refused, never misread.
VERSION = 2
HEADER_BYTES = 128
LAYOUT_SHIFT = 16  # the version field's high 16 bits: the container layout
_LAYOUT = struct.Struct("<8sIIQ32s16sQ")  # magic, version, reserved, len, key, fingerprint, xxh3
_PREFIX = struct.Struct("<8sIIQ32s16s")  # everything before the checksum
CHECKSUM_AT = _PREFIX.size  # byte offset of the little-endian xxh3 in the header


def _bytes_of(payload: Any) -> memoryview:
    """A flat byte view of a numpy array, torch CPU tensor, bytes or memoryview."""
    if isinstance(payload, memoryview) and payload.format == "B" and payload.ndim == 1:
        return payload
    if isinstance(payload, (bytes, bytearray)):
        return memoryview(payload)
    if hasattr(payload, "numpy") and hasattr(payload, "untyped_storage"):  # torch tensor
        payload = payload.contiguous().view(-1).numpy()
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).view(np.uint8).reshape(-1).data
    return memoryview(payload).cast("B")


def checksum(payload: Any) -> int:
    return xxhash.xxh3_64_intdigest(_bytes_of(payload))


def version_of(layout: int = 0) -> int:
    """The header's version field for pages in container ``layout``."""
    return VERSION | layout << LAYOUT_SHIFT


def pack_header(page_key: bytes, fingerprint: bytes, payload: Any, *, layout: int = 0,
                digest: int | None = None) -> bytes:
    """The header for ``payload`` stored under ``page_key`` (32 bytes) in container
    ``layout``; ``digest``: the payload's checksum when the caller knows it (the host
    pool's), else computed here."""
    data = _bytes_of(payload)
    if len(page_key) != 32 or len(fingerprint) != 16:
        raise ValueError("page_key must be 32 bytes and fingerprint 16 bytes")
    head = _LAYOUT.pack(MAGIC, version_of(layout), 0, len(data), page_key, fingerprint,
                        checksum(data) if digest is None else digest)
    return head.ljust(HEADER_BYTES, b"\x00")


def verify(header: Any, page_key: bytes, fingerprint: bytes, payload: Any, *,
           layout: int = 0) -> str | None:
    """None when ``header`` + ``payload`` are the page ``page_key`` in container ``layout``;
    else why not."""
    head = bytes(_bytes_of(header)[:HEADER_BYTES])
    if len(head) < _LAYOUT.size:
        return "truncated header"
    magic, version, _, length, key, fp, digest = _LAYOUT.unpack_from(head)
    if magic != MAGIC or version != version_of(layout):
        return "bad magic/version"
    if key != page_key:
        return "page key mismatch"
    if fp != fingerprint:
        return "fingerprint mismatch (other model, dtype, layout, page size or rank)"
    data = _bytes_of(payload)
    if length != len(data):
        return f"payload length {len(data)} != {length}"
    if checksum(data) != digest:
        return "checksum mismatch"
    return None


def header_rows(keys: list[bytes], fingerprint: bytes, length: int, *, layout: int = 0,
                width: int = HEADER_BYTES) -> np.ndarray:
    """One header per key, zero-padded to ``width`` bytes, checksum field zero."""
    if len(fingerprint) != 16 or any(len(k) != 32 for k in keys):
        raise ValueError("page keys must be 32 bytes and the fingerprint 16 bytes")
    rows = np.zeros((len(keys), width), np.uint8)
    if keys:
        version = version_of(layout)
        packed = b"".join(_PREFIX.pack(MAGIC, version, 0, length, k, fingerprint) for k in keys)
        rows[:, :CHECKSUM_AT] = np.frombuffer(packed, np.uint8).reshape(len(keys), CHECKSUM_AT)
    return rows


def checksums_at(addresses: list[int], payloads: list[Any], length: int,
                 known: list[int | None] | None = None) -> list[int]:
    """``checksum`` of each payload (``length`` bytes at ``addresses[i]``, the same
    memory as ``payloads[i]``): one GIL-free call for the batch where native_io runs,
    else one xxhash call per page. ``known[i]``, where not None, is taken as page i's
    checksum without reading it (the host pool's, computed when the page was stored)."""
    from hicache.tiers.l3 import native_io

    todo = [i for i in range(len(addresses)) if known is None or known[i] is None]
    out: list[int] = [0] * len(addresses) if known is None else [k or 0 for k in known]
    if todo and native_io.available():
        sums = native_io.checksums_at([addresses[i] for i in todo], length).tolist()
    else:
        sums = [checksum(payloads[i]) for i in todo]
    for i, value in zip(todo, sums, strict=True):
        out[i] = int(value)
    return out


def check_headers(headers: Any, keys: list[bytes], fingerprint: bytes, length: int,
                  digests: list[int], *, layout: int = 0) -> list[str | None]:
    """``verify`` for a batch: ``headers`` holds one ``HEADER_BYTES`` header per page
    (flat or as rows), ``digests`` the checksum of each payload as read."""
    rows = np.asarray(headers, np.uint8).reshape(len(keys), -1)[:, :HEADER_BYTES]
    want = header_rows(keys, fingerprint, length, layout=layout, width=CHECKSUM_AT)
    stored = np.ascontiguousarray(rows[:, CHECKSUM_AT:CHECKSUM_AT + 8]).view("<u8")[:, 0]
    out: list[str | None] = []
    for i, (same, got) in enumerate(zip((rows[:, :CHECKSUM_AT] == want).all(axis=1).tolist(),
                                        stored.tolist(), strict=True)):
        if not same:
            out.append(verify(bytes(rows[i]), keys[i], fingerprint, b"", layout=layout)
                       or "header mismatch")
        elif got != digests[i]:
            out.append("checksum mismatch")
        else:
            out.append(None)
    return out
