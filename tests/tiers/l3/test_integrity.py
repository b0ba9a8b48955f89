"""Page headers in batches (tiers/l3/integrity.py): header rows, batch checksums (GIL-free
where native_io runs, else per page) and batch checks that answer as ``verify`` does."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from hicache.tiers.l3 import integrity, native_io

FP = bytes(range(16))
KEYS = [bytes([i]) * 32 for i in range(1, 4)]
LENGTH = 1000


@pytest.fixture(params=["native", "python"])
def path(request, monkeypatch):
    if request.param == "native" and not native_io.available():
        pytest.skip("the GIL-free batch path does not run here")
    if request.param == "python":
        monkeypatch.setattr(native_io, "available", lambda: False)
    return request.param


def test_batch_headers_are_the_headers_pack_header_writes(path):
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, LENGTH, dtype=np.uint8) for _ in KEYS]
    sums = integrity.checksums_at([p.ctypes.data for p in payloads], payloads, LENGTH)
    assert sums == [xxhash.xxh3_64_intdigest(p.tobytes()) for p in payloads]
    rows = integrity.header_rows(KEYS, FP, LENGTH)
    at = integrity.CHECKSUM_AT
    rows[:, at:at + 8] = np.asarray(sums, "<u8").view(np.uint8).reshape(-1, 8)
    for row, key, payload in zip(rows, KEYS, payloads, strict=True):
        assert bytes(row) == integrity.pack_header(key, FP, payload)
    assert integrity.check_headers(rows, KEYS, FP, LENGTH, sums) == [None] * 3
    # Each failure in verify's words: another page's key, a wrong checksum.
    assert integrity.check_headers(rows, [KEYS[1], KEYS[1], KEYS[2]], FP, LENGTH,
                                   sums) == ["page key mismatch", None, None]
    bad = [sums[0], sums[1] ^ 1, sums[2]]
    assert integrity.check_headers(rows, KEYS, FP, LENGTH, bad) == [
        None, "checksum mismatch", None]
    other_fp = bytes(16)
    assert integrity.check_headers(rows[:1], KEYS[:1], other_fp, LENGTH, sums[:1])[0] \
        .startswith("fingerprint mismatch")


def test_checksums_at_takes_known_values_and_computes_the_rest():
    data = np.arange(3 * 64, dtype=np.uint8).reshape(3, 64)
    addresses = [data[i].ctypes.data for i in range(3)]
    real = [integrity.checksum(data[i]) for i in range(3)]
    assert integrity.checksums_at(addresses, list(data), 64) == real
    # A known value is taken as given (the pool's, computed when the page was stored).
    assert integrity.checksums_at(addresses, list(data), 64, [None, 7, None]) == [
        real[0], 7, real[2]]
