"""The page directory the file and NIXL backends share (tiers/l3/page_dir.py): real files."""

from __future__ import annotations

import os

import pytest

from hicache.tiers.l3.base import StorageConfigError
from hicache.tiers.l3.page_dir import PageDirectory

KEY = "ab" * 32
SUFFIX = "0123456789abcdef"


def put(d: PageDirectory, key: str, data: bytes) -> str:
    name = d.name(key)
    d.make_dir(name)
    tmp = d.temp_path(name)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, d.path(name))
    return name


def test_layout_names_and_formats_kept_apart(tmp_path):
    pages = PageDirectory(tmp_path, ".page", SUFFIX, "path")
    nixl = PageDirectory(tmp_path, ".nixl", SUFFIX, "path")
    name = put(pages, KEY, b"x")
    assert name == f"ab/{KEY}_{SUFFIX}.page"
    assert (tmp_path / "pages" / name).read_bytes() == b"x"
    put(nixl, KEY, b"y")
    assert [n for n, _ in pages.page_files()] == [name]  # one format does not see the other
    assert [n for n, _ in nixl.page_files()] == [f"ab/{KEY}_{SUFFIX}.nixl"]
    assert not list((tmp_path / "tmp").iterdir())


def test_quarantine_leaves_a_fresh_copy_in_place(tmp_path):
    d = PageDirectory(tmp_path, ".page", SUFFIX, "path")
    name = put(d, KEY, b"bad")
    fd = os.open(d.path(name), os.O_RDONLY)
    try:
        put(d, KEY, b"good")  # another writer replaced it after our read opened it
        assert not d.quarantine(name, "checksum", fd)
        assert open(d.path(name), "rb").read() == b"good"
    finally:
        os.close(fd)
    assert d.quarantine(name, "checksum")  # no read to compare: moved
    assert not os.path.exists(d.path(name))
    assert [p.name.rpartition(".")[0] for p in d.quarantine_dir.iterdir()] == [
        name.rpartition("/")[2]]
    assert not d.quarantine(name, "gone")  # nothing left to move
    d.clear()
    assert not list(d.quarantine_dir.iterdir())


def test_temps_of_dead_writers_go_at_start(tmp_path):
    d = PageDirectory(tmp_path, ".page", SUFFIX, "path")
    dead = d.tmp_dir / f"x.page.{2**22 + 12345}.7.tmp"  # above pid_max: never alive
    mine = d.tmp_dir / f"y.page{d.temp_suffix()}"
    dead.write_bytes(b"")
    mine.write_bytes(b"")
    PageDirectory(tmp_path, ".page", SUFFIX, "path")
    assert not dead.exists() and mine.exists()


def test_a_bad_root_names_its_key(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StorageConfigError, match="extra_config.path='"):
        PageDirectory(tmp_path / "file", ".page", SUFFIX, "extra_config.path")
