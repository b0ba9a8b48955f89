"""CPU tests of the GPU bundle builder/unpacker with small fake wheels."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from hicache.integration.bench.gpu import bundle as b

PART = 16 * 1024
RULES = (
    b.TrimRule("fakevllm/_big_C*.so", "test trim"),
    b.TrimRule("fakevllm/third_party/gone", "test trim dir"),
)


def _wheel(path: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for arc, data in files.items():
            zf.writestr(arc, data)
        zf.writestr(f"{dist}/METADATA", f"Name: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture()
def wheels(tmp_path: Path) -> dict[b.WheelSpec, Path]:
    cache = tmp_path / "cache"
    cache.mkdir()
    noise = os.urandom(3 * PART)  # incompressible: forces several parts
    _wheel(
        cache / "fakevllm-1.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "fakevllm",
        "1.0",
        {
            "fakevllm/__init__.py": b"X = 1\n",
            "fakevllm/blob.bin": noise,
            "fakevllm/_big_C.abi3.so": b"\0" * 1000,
            "fakevllm/third_party/gone/a.h": b"int a;\n",
            "fakevllm/third_party/kept.h": b"int k;\n",
            "fakevllm/__pycache__/x.cpython-312.pyc": b"pyc",
        },
    )
    _wheel(
        cache / "fake_dep-2.0-py3-none-any.whl",
        "fake_dep",
        "2.0",
        {
            "fake_dep-2.0.data/purelib/fake_dep/__init__.py": b"Y = 2\n",
            "fake_dep-2.0.data/platlib/fake_dep_ext.so": b"ELF",
            "fake_dep-2.0.data/scripts/fake-dep": b"#!/bin/sh\n",
        },
    )
    specs = [b.WheelSpec("fakevllm", "1.0"), b.WheelSpec("fake-dep", "2.0")]
    return b.ensure_wheels(specs, cache, download=False)


def _lock(tmp_path: Path, wheels: dict[b.WheelSpec, Path]) -> dict[str, tuple[str, str]]:
    lock_path = tmp_path / "wheels.lock"
    b.write_lock(lock_path, wheels)
    return b.read_lock(lock_path)


def _build(tmp_path: Path, wheels: dict[b.WheelSpec, Path]) -> tuple[Path, dict]:
    out = tmp_path / "out"
    manifest = b.build_bundle(
        wheels, _lock(tmp_path, wheels), tmp_path / "work", out, PART, RULES
    )
    return out, manifest


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != b.DONE_MARKER
    }


def test_build_layout_and_round_trip(
    tmp_path: Path, wheels: dict[b.WheelSpec, Path]
) -> None:
    out, manifest = _build(tmp_path, wheels)
    site = tmp_path / "work" / "site"
    assert not (site / "fakevllm/_big_C.abi3.so").exists()
    assert not (site / "fakevllm/third_party/gone").exists()
    assert (site / "fakevllm/third_party/kept.h").exists()
    assert not (site / "fakevllm/__pycache__").exists()
    assert (site / "fake_dep/__init__.py").read_bytes() == b"Y = 2\n"
    assert (site / "fake_dep_ext.so").exists()
    assert not any("scripts" in p.as_posix() or p.name == "fake-dep" for p in site.rglob("*"))
    assert (site / "fake_dep-2.0.dist-info/METADATA").exists()
    trimmed = {t["path"] for t in manifest["trimmed"]}
    assert trimmed == {"fakevllm/_big_C.abi3.so", "fakevllm/third_party/gone/"}

    dirs = sorted(out.iterdir())
    assert [d.name for d in dirs] == [f"p{i}" for i in range(len(dirs))]
    assert len(dirs) >= 3
    parts = []
    for i, d in enumerate(dirs):
        part = d / f"{b.BUNDLE_NAME}.part{i:02d}"
        assert part.stat().st_size <= PART
        assert (d / b.SUMS_NAME).is_file()
        parts.append(part)
    assert (out / "p0" / b.MANIFEST_NAME).is_file()
    whole = tmp_path / "work" / b.BUNDLE_NAME
    assert b"".join(p.read_bytes() for p in parts) == whole.read_bytes()
    sums = b._parse_sums((out / "p1" / b.SUMS_NAME).read_text(), out)
    assert sums[b.BUNDLE_NAME] == b.sha256_file(whole)
    assert all(sums[p.name] == b.sha256_file(p) for p in parts)

    dest = tmp_path / "dest"
    info = b.unpack_bundle(dirs, dest)
    assert not info["skipped"]
    assert _tree(dest) == _tree(site)
    assert b.unpack_bundle(dirs, dest)["skipped"]


def test_build_is_deterministic(tmp_path: Path, wheels: dict[b.WheelSpec, Path]) -> None:
    lock = _lock(tmp_path, wheels)
    b.build_bundle(wheels, lock, tmp_path / "w1", tmp_path / "o1", PART, RULES)
    b.build_bundle(wheels, lock, tmp_path / "w2", tmp_path / "o2", PART, RULES)
    assert (tmp_path / "w1" / b.BUNDLE_NAME).read_bytes() == (
        tmp_path / "w2" / b.BUNDLE_NAME
    ).read_bytes()


def test_corrupt_part_refused(tmp_path: Path, wheels: dict[b.WheelSpec, Path]) -> None:
    out, _ = _build(tmp_path, wheels)
    part = out / "p1" / f"{b.BUNDLE_NAME}.part01"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(b.BundleError, match=r"part01"):
        b.unpack_bundle(sorted(out.iterdir()), tmp_path / "dest")
    assert b.main(["unpack", "--parts", str(out), "--dest", str(tmp_path / "d2")]) == 1


def test_missing_part_refused(tmp_path: Path, wheels: dict[b.WheelSpec, Path]) -> None:
    out, _ = _build(tmp_path, wheels)
    with pytest.raises(b.BundleError, match=r"missing part.*part01"):
        b.unpack_bundle([out / "p0", out / "p2"], tmp_path / "dest")


def test_wheel_hash_mismatch_refused(
    tmp_path: Path, wheels: dict[b.WheelSpec, Path]
) -> None:
    lock = _lock(tmp_path, wheels)
    spec = b.WheelSpec("fake-dep", "2.0")
    with zipfile.ZipFile(wheels[spec], "a") as zf:
        zf.writestr("fake_dep/extra.py", b"")
    with pytest.raises(b.BundleError, match=r"fake_dep-2\.0-py3-none-any\.whl") as err:
        b.build_bundle(wheels, lock, tmp_path / "work", tmp_path / "out", PART, RULES)
    assert lock[spec.key][1] in str(err.value)
    assert b.sha256_file(wheels[spec]) in str(err.value)


def test_unsafe_member_refused(tmp_path: Path) -> None:
    with pytest.raises(b.BundleError, match="unsafe"):
        b._site_target("../evil.py", "w.whl")
    with pytest.raises(b.BundleError, match="unsafe"):
        b._site_target("/abs.py", "w.whl")
