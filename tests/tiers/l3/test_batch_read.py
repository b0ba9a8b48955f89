"""The GIL-free batch read of page files (tiers/l3/batch_read.py): exact bytes into
the header rows and the slot addresses, -1 for a file that cannot be opened, and
byte counts that tell short and long files apart. The file backend's batch reads
go through it wherever slots are contiguous."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hicache.tiers.l3 import batch_read

pytestmark = pytest.mark.skipif(not batch_read.available(), reason="needs numba (a dependency)")

HEAD, PAYLOAD = 16, 4096


def write(path: Path, n: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def test_reads_each_file_into_its_header_row_and_slot(tmp_path):
    files = [tmp_path / f"p{i}" for i in range(3)]
    want = [write(f, HEAD + PAYLOAD, i) for i, f in enumerate(files)]
    headers = np.zeros((3, HEAD), dtype=np.uint8)
    slots = np.zeros((3, PAYLOAD), dtype=np.uint8)
    got = batch_read.read_pages(files, headers, [slots[i].ctypes.data for i in range(3)],
                                PAYLOAD)
    assert got.tolist() == [HEAD + PAYLOAD] * 3
    for i in range(3):
        assert headers[i].tobytes() == want[i][:HEAD]
        assert slots[i].tobytes() == want[i][HEAD:]


def test_missing_short_and_long_files_are_told_apart(tmp_path):
    short, long_, missing = tmp_path / "short", tmp_path / "long", tmp_path / "missing"
    write(short, HEAD + PAYLOAD - 7, 1)
    write(long_, HEAD + PAYLOAD + 5, 2)
    headers = np.zeros((3, HEAD), dtype=np.uint8)
    slots = np.zeros((3, PAYLOAD), dtype=np.uint8)
    got = batch_read.read_pages([short, long_, missing], headers,
                                [slots[i].ctypes.data for i in range(3)], PAYLOAD)
    # Short: what was there; long: one byte past the page; missing: -1.
    assert got.tolist() == [HEAD + PAYLOAD - 7, HEAD + PAYLOAD + 1, -1]


def test_an_empty_batch_reads_nothing():
    assert batch_read.read_pages([], np.zeros((0, HEAD), dtype=np.uint8), [], PAYLOAD).size == 0
