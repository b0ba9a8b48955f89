"""Build (here) and unpack (on a lent GPU machine) a trimmed vLLM site bundle.

Contract
========

The lent GPU machine has Python 3.12, torch, triton, transformers and a few
other packages but no vLLM and no network. This module builds, on a machine
with network access, a directory of pure site-packages content for vLLM and
the runtime dependencies the GPU machine lacks, packs it, and splits it into
parts small enough to travel one per device call.

``build`` (here, Python >= 3.11, may use tqdm lazily):

* ``--profile`` picks the bundle (:data:`PROFILES`): ``vllm`` (vLLM 0.32.0) or
  ``sglang`` (SGLang 0.5.17, for the side-by-side run), each with its wheels,
  lock file, wheel cache, trims and output folder.
* The wheel set is :data:`DEFAULT_WHEELS` (``name``, ``version``) for cp312 /
  manylinux x86_64. Every wheel is pinned by version and sha256 in
  ``wheels.lock`` next to this file, one ``name==version sha256`` a line.
  Missing wheels are copied from ``--seed`` files or fetched with
  ``python3 -m pip download --no-deps --only-binary=:all: ...`` into the
  wheel cache (default ``.cache/gpu-wheels``). ``--update-lock`` (or the
  ``lock`` sub-command) writes the lock from the cached wheels; otherwise a
  wheel whose sha256 differs from the lock, or that the lock lacks, is
  refused with a :class:`BundleError` naming the wheel (and both hashes).
* Every wheel is unzipped into ``WORK/site``: plain entries and the content
  of ``*.data/purelib`` / ``*.data/platlib`` land at the site root,
  ``*.data/scripts`` / ``*.data/headers`` / ``*.data/data`` are dropped,
  dist-info folders are kept. A zip entry with an absolute path or ``..`` is
  refused. Executable bits recorded in the zip are kept (0o755 / 0o644).
* :data:`TRIM_RULES` (``fnmatch`` patterns over site-relative POSIX paths,
  where ``*`` also crosses ``/``; a matching folder goes as a whole) remove
  what a dense bf16 Llama on an H100 never loads. ``__pycache__`` folders
  go too. ``--trim-moe`` adds :data:`OPTIONAL_TRIM_RULES`.
* The site is packed as a deterministic tar (sorted names, mtime 0, uid/gid
  0, empty owner names, PAX format) compressed with ``xz -9 -T2`` through a
  pipe when the binary exists, else with :mod:`lzma` preset 9; the same
  inputs give the same bytes with the same compressor.
* The ``.tar.xz`` is split into as few parts of at most ``--part-mib`` MiB
  as possible, balanced to (nearly) equal sizes, named
  ``hicache-gpu-bundle.tar.xz.partNN``; part ``i`` goes to ``OUT/p<i>/``
  with a copy of ``SHA256SUMS`` (sha256sum format: every part and the whole
  ``hicache-gpu-bundle.tar.xz``); ``OUT/p0/`` also holds ``manifest.json``
  (wheels, trimmed paths, unpacked size, part sizes). Stale ``OUT/p<i>``
  folders of an earlier build are removed first.

``unpack`` (on the device; stdlib only, Python >= 3.11, also runnable as
``python3 integration/bench/gpu/bundle.py unpack --parts DIR... --dest D``):

* Gathers part files and one ``SHA256SUMS`` from the given folders (searched
  recursively), checks that every part listed in ``SHA256SUMS`` is present
  and has its listed sha256 (a :class:`BundleError` names a missing or
  mismatching part), concatenates them, checks the whole sha256, and
  extracts into ``--dest``, refusing absolute member names, ``..`` and links
  that leave ``--dest``. On success it writes ``DEST/.hicache-bundle.sha256``;
  a later unpack of the same bundle into the same ``DEST`` is a no-op unless
  ``--force``. Prints what it did and the elapsed seconds.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

BUNDLE_NAME = "hicache-gpu-bundle.tar.xz"
SUMS_NAME = "SHA256SUMS"
MANIFEST_NAME = "manifest.json"
DONE_MARKER = ".hicache-bundle.sha256"
DEFAULT_PART_MIB = 58
MIB = 1024 * 1024
LOCK_PATH = Path(__file__).resolve().with_name("wheels.lock")
PART_RE = re.compile(re.escape(BUNDLE_NAME) + r"\.part(\d{2,})$")
_CHUNK = 4 * MIB

T = TypeVar("T")


class BundleError(RuntimeError):
    """A wheel, lock, part or archive failed a check; the message says which."""


@dataclass(frozen=True)
class WheelSpec:
    """One pinned distribution: its PyPI name and exact version."""

    name: str
    version: str

    @property
    def key(self) -> str:
        """PEP 503 normalised name, used to match lock lines."""
        return normalize_name(self.name)

    @property
    def file_prefix(self) -> str:
        """How a wheel file name of this pin starts (``name_version-``)."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class TrimRule:
    """Remove site paths matching ``pattern`` (fnmatch, ``*`` crosses ``/``)."""

    pattern: str
    reason: str


# vllm plus what the GPU machine lacks of its runtime imports. The vLLM 0.32.0
# METADATA asks for "oss-harmony>=0.0.11" (openai-harmony stops at 0.0.8).
DEFAULT_WHEELS: tuple[WheelSpec, ...] = (
    WheelSpec("vllm", "0.32.0"),
    WheelSpec("msgspec", "0.22.0"),
    WheelSpec("pydantic", "2.14.3"),
    WheelSpec("pydantic_core", "2.50.4"),
    WheelSpec("annotated_types", "0.8.0"),
    WheelSpec("typing_inspection", "0.4.5"),
    WheelSpec("pyzmq", "27.3.0"),
    WheelSpec("cbor2", "6.3.0"),
    WheelSpec("oss-harmony", "0.0.11"),
    WheelSpec("pybase64", "1.5.1"),
    WheelSpec("openai", "3.54.0"),
    WheelSpec("jiter", "0.19.0"),
    WheelSpec("sniffio", "1.3.1"),
    WheelSpec("httpx2", "2.16.2"),
    WheelSpec("httpcore2", "2.16.2"),
    WheelSpec("cachetools", "8.0.1"),
    WheelSpec("xgrammar", "0.2.8"),
    WheelSpec("apache_tvm_ffi", "0.1.11"),
    WheelSpec("fastapi", "0.136.3"),
    WheelSpec("starlette", "1.10.0"),
    WheelSpec("partial_json_parser", "0.2.1.1.post7"),
    WheelSpec("llguidance", "1.7.6"),
    WheelSpec("uvicorn", "0.54.0"),
    WheelSpec("truststore", "0.10.5"),
    WheelSpec("setproctitle", "1.3.8"),
    # Found missing on the first GPU run: the model loader imports vLLM's
    # compressed-tensors helpers for every model (vLLM pins 0.17.0).
    WheelSpec("compressed_tensors", "0.17.0"),
    WheelSpec("loguru", "0.7.3"),
)

TRIM_RULES: tuple[TrimRule, ...] = (
    TrimRule(
        "vllm/vllm_flash_attn/_vllm_fa2_C*.so",
        "FlashAttention-2 kernels; an H100 runs the FA3 build",
    ),
    TrimRule("vllm/vllm-rs", "Rust frontend binary; the Python server is used"),
    TrimRule("vllm/vllm_rs*", "Rust frontend support files"),
    TrimRule("vllm/third_party/deep_gemm", "DeepGEMM: FP8 block GEMM / MoE only"),
    TrimRule("vllm/third_party/fmha_sm100", "Blackwell (sm100) attention only"),
    TrimRule("vllm/_deepselect_C*.so", "DeepSeek sparse-attention top-k only"),
    TrimRule("vllm/_flashmla_C*.so", "FlashMLA: MLA models (DeepSeek) only"),
    TrimRule(
        "vllm/_flashmla_extension_C*.so",
        "FlashMLA FP8 extension: MLA models only (import is guarded)",
    ),
    TrimRule("vllm/_flashkda_C*.so", "Kimi delta-attention kernels only"),
    TrimRule("vllm/_qutlass_C*.so", "QuTLASS FP4 quantised GEMM only"),
    TrimRule("vllm/entrypoints/*/static/swagger-ui*", "Swagger UI assets of /docs"),
)

OPTIONAL_TRIM_RULES: tuple[TrimRule, ...] = (
    TrimRule(
        "vllm/_moe_C_stable_libtorch*.so",
        "MoE kernels; a dense Llama never loads them",
    ),
)

# SGLang 0.5.17 for the side-by-side run (../shared/reference/sglang_gpu.md): the
# newest release pinning the device's torch 2.11.0 exactly (sglang-kernel 0.4.5
# links torch's regular ABI, and 0.4.6+ needs symbols torch 2.11 lacks), plus
# what the device lacks of its import path (found by an import probe of 30
# modules); transformers 5.12.1 and tokenizers 0.22.2 replace the device's
# (5.17.0 clashes with SGLang's own qwen3_asr config).
SGLANG_WHEELS: tuple[WheelSpec, ...] = tuple(WheelSpec(n, v) for n, v in (
    ("sglang", "0.5.17"), ("sglang-kernel", "0.4.5"), ("transformers", "5.12.1"),
    ("tokenizers", "0.22.2"), ("xgrammar", "0.2.1"), ("apache-tvm-ffi", "0.1.11"),
    ("pydantic-core", "2.50.5"), ("pyzmq", "27.3.0"), ("msgspec", "0.22.0"),
    ("orjson", "3.13.0"), ("pybase64", "1.5.1"), ("setproctitle", "1.3.8"),
    ("rpds-py", "2026.9.1"), ("cffi", "2.1.1"), ("flashinfer-python", "0.6.15.post1"),
    ("openai", "2.6.1"), ("pydantic", "2.14.4"), ("fastapi", "0.165.0"),
    ("opentelemetry-api", "1.45.2"), ("starlette", "1.10.0"), ("uvicorn", "0.54.0"),
    ("python-multipart", "0.0.34"), ("ipython", "9.18.1"), ("traitlets", "5.16.1"),
    ("soundfile", "0.13.1"), ("pycparser", "3.12"), ("jsonschema", "4.26.0"),
    ("referencing", "0.37.0"), ("jsonschema-specifications", "2025.9.1"),
    ("partial-json-parser", "0.2.1.1.post7"), ("compressed-tensors", "0.20.0"),
    ("gguf", "0.19.0"), ("dill", "0.4.1"), ("loguru", "0.7.3"), ("distro", "1.9.0"),
    ("sniffio", "1.3.1"), ("annotated-types", "0.8.0"), ("typing-inspection", "0.4.5"),
))

SGLANG_TRIM_RULES: tuple[TrimRule, ...] = (
    TrimRule("sgl_kernel/flash_ops*.so", "FA3 attention (~1 GiB of fatbin): the run uses "
             "--attention-backend triton"),
    TrimRule("sgl_kernel/sm100", "Blackwell (sm100) kernels only"),
    TrimRule("sgl_kernel/*infllm_ops*.so", "InfLLM sparse attention only"),
    TrimRule("sgl_kernel/*flashmla_ops*.so", "FlashMLA: MLA models only"),
    TrimRule("xgrammar/lib/libxgrammar.a", "static library, never loaded"),
    TrimRule("flashinfer/data/cccl", "JIT sources: the run samples with pytorch"),
    TrimRule("flashinfer/data/cutlass", "JIT sources: the run samples with pytorch"),
    TrimRule("flashinfer/data/csrc", "JIT sources: the run samples with pytorch"),
    TrimRule("flashinfer/data/include", "JIT sources: the run samples with pytorch"),
    TrimRule("flashinfer/data/spdlog", "JIT sources: the run samples with pytorch"),
    TrimRule("sglang/srt/*_core*.so", "optional Rust server / gRPC / multimodal cores"),
    TrimRule("sglang/multimodal_gen", "diffusion serving, not used"),
    TrimRule("sglang/test", "SGLang's own test helpers"),
)


@dataclass(frozen=True)
class Profile:
    """What one bundle holds: its wheels, their lock file, and what is trimmed."""

    wheels: tuple[WheelSpec, ...]
    lock: Path
    rules: tuple[TrimRule, ...]
    wheel_cache: str
    work: str
    out: str


PROFILES: dict[str, Profile] = {
    "vllm": Profile(DEFAULT_WHEELS, LOCK_PATH, TRIM_RULES, ".cache/gpu-wheels",
                    ".cache/gpu-build", ".gpu"),
    "sglang": Profile(SGLANG_WHEELS, LOCK_PATH.with_name("wheels-sglang.lock"),
                      SGLANG_TRIM_RULES, ".cache/gpu-wheels-sglang", ".cache/gpu-build-sglang",
                      ".gpu-sglang"),
}

PIP_PLATFORMS: tuple[str, ...] = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: lower case, runs of ``-_.`` become ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """Wrap ``items`` in a tqdm bar when tqdm is importable (build side)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, total=total, unit="it", leave=False)


def _fmt_mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------- lock


def read_lock(path: Path) -> dict[str, tuple[str, str]]:
    """Parse ``name==version sha256`` lines into ``{key: (version, sha256)}``."""
    lock: dict[str, tuple[str, str]] = {}
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)\s+([0-9a-f]{64})", line)
        if m is None:
            raise BundleError(f"{path}:{n}: expected 'name==version sha256', got {raw!r}")
        lock[normalize_name(m.group(1))] = (m.group(2), m.group(3))
    return lock


def write_lock(path: Path, wheels: Mapping[WheelSpec, Path]) -> None:
    """Write one ``name==version sha256`` line per wheel, in the given order."""
    lines = [f"{spec} {sha256_file(p)}" for spec, p in wheels.items()]
    header = "# cp312 manylinux x86_64 wheels of the GPU bundle; see bundle.py\n"
    path.write_text(header + "\n".join(lines) + "\n")


def verify_wheels(
    wheels: Mapping[WheelSpec, Path], lock: Mapping[str, tuple[str, str]]
) -> dict[WheelSpec, str]:
    """Check every wheel against the lock; returns ``{spec: sha256}``.

    Raises :class:`BundleError` for a pin the lock lacks or pins to another
    version, and for a sha256 mismatch (naming the wheel and both hashes).
    """
    hashes: dict[WheelSpec, str] = {}
    for spec, path in wheels.items():
        entry = lock.get(spec.key)
        if entry is None:
            raise BundleError(f"{spec} is not in the lock; run with --update-lock")
        version, expected = entry
        if version != spec.version:
            raise BundleError(f"{spec}: the lock pins version {version}")
        actual = sha256_file(path)
        if actual != expected:
            raise BundleError(
                f"sha256 mismatch for wheel {path.name}: lock has {expected}, "
                f"file has {actual}"
            )
        hashes[spec] = actual
    return hashes


# ------------------------------------------------------------------ wheels


def find_wheel(cache: Path, spec: WheelSpec) -> Path | None:
    """The cached wheel of ``spec`` (file name match), or None."""
    prefix = spec.file_prefix
    hits = sorted(
        p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix)
    )
    if len(hits) > 1:
        raise BundleError(f"several cached wheels for {spec}: {[p.name for p in hits]}")
    return hits[0] if hits else None


def ensure_wheels(
    specs: Sequence[WheelSpec],
    cache: Path,
    seeds: Sequence[Path] = (),
    python: str = "python3",
    download: bool = True,
) -> dict[WheelSpec, Path]:
    """Return ``{spec: wheel path}``, copying seeds and downloading the rest."""
    cache.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        target = cache / seed.name
        if not target.exists():
            print(f"copy {seed} -> {target} ({_fmt_mib(seed.stat().st_size)})")
            shutil.copyfile(seed, target)
    found: dict[WheelSpec, Path] = {}
    missing = []
    for spec in specs:
        path = find_wheel(cache, spec)
        if path is None:
            missing.append(spec)
        else:
            found[spec] = path
    if missing and not download:
        raise BundleError(f"wheels missing from {cache}: {', '.join(map(str, missing))}")
    for spec in _progress(missing, "download", total=len(missing)):
        cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp"]
        for plat in PIP_PLATFORMS:
            cmd += ["--platform", plat]
        cmd += ["-d", str(cache), str(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise BundleError(f"pip download {spec} failed:\n{proc.stderr[-2000:]}")
        path = find_wheel(cache, spec)
        if path is None:
            raise BundleError(f"pip download {spec} left no matching wheel in {cache}")
        found[spec] = path
    return {spec: found[spec] for spec in specs}


def _safe_rel(name: str, what: str) -> PurePosixPath:
    """A relative POSIX path without ``..``, or BundleError."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or name.startswith("/") or ".." in rel.parts or re.match(
        r"^[A-Za-z]:", name
    ):
        raise BundleError(f"{what}: unsafe path {name!r}")
    return rel


def _site_target(name: str, wheel: str) -> PurePosixPath | None:
    """Where a wheel entry goes under the site root, or None to drop it."""
    rel = _safe_rel(name, wheel)
    parts = rel.parts
    if parts and parts[0].endswith(".data"):
        if len(parts) >= 3 and parts[1] in ("purelib", "platlib"):
            return PurePosixPath(*parts[2:])
        return None  # scripts, headers, data
    return rel


def unpack_wheels(wheels: Iterable[Path], site: Path) -> int:
    """Unzip wheels into ``site`` (see the contract); returns bytes written."""
    site.mkdir(parents=True, exist_ok=True)
    total = 0
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            infos = zf.infolist()
            for info in _progress(infos, wheel.name[:40], total=len(infos)):
                if info.is_dir():
                    continue
                rel = _site_target(info.filename, wheel.name)
                if rel is None:
                    continue
                dest = site.joinpath(*rel.parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, dest.open("wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
                mode = (info.external_attr >> 16) & 0o777
                dest.chmod(0o755 if mode & 0o111 else 0o644)
                total += info.file_size
    return total


def trim_site(site: Path, rules: Sequence[TrimRule]) -> list[dict[str, Any]]:
    """Delete matching paths and ``__pycache__``; returns what went and why."""
    removed: list[dict[str, Any]] = []
    for root, dirs, files in os.walk(site, topdown=True):
        rootp = Path(root)
        for d in sorted(dirs):
            full = rootp / d
            rel = full.relative_to(site).as_posix()
            reason = "bytecode cache" if d == "__pycache__" else _match(rel, rules)
            if reason is not None:
                size = sum(p.stat().st_size for p in full.rglob("*") if p.is_file())
                shutil.rmtree(full)
                dirs.remove(d)
                if d != "__pycache__":
                    removed.append({"path": rel + "/", "reason": reason, "bytes": size})
        for f in sorted(files):
            full = rootp / f
            rel = full.relative_to(site).as_posix()
            reason = _match(rel, rules)
            if reason is not None:
                size = full.stat().st_size
                full.unlink()
                removed.append({"path": rel, "reason": reason, "bytes": size})
    return sorted(removed, key=lambda r: r["path"])


def _match(rel: str, rules: Sequence[TrimRule]) -> str | None:
    for rule in rules:
        if fnmatch.fnmatchcase(rel, rule.pattern):
            return rule.reason
    return None


def site_size(site: Path) -> tuple[int, int]:
    """(bytes, files) under ``site``."""
    n = size = 0
    for p in site.rglob("*"):
        if p.is_file() and not p.is_symlink():
            n += 1
            size += p.stat().st_size
    return size, n


# -------------------------------------------------------------------- pack


def _sorted_entries(site: Path) -> Iterator[Path]:
    """Every path under ``site`` in a stable order (parents first)."""
    for root, dirs, files in os.walk(site):
        dirs.sort()
        rootp = Path(root)
        if rootp != site:
            yield rootp
        for f in sorted(files):
            yield rootp / f


def _write_tar(site: Path, fileobj: Any) -> None:
    entries = list(_sorted_entries(site))
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for path in _progress(entries, "tar", total=len(entries)):
            rel = path.relative_to(site).as_posix()
            st = path.lstat()
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                info.mode = 0o777
                tar.addfile(info)
            else:
                info.size = st.st_size
                info.mode = 0o755 if st.st_mode & 0o111 else 0o644
                with path.open("rb") as f:
                    tar.addfile(info, f)


def pack_site(site: Path, out: Path, use_xz_binary: bool = True) -> str:
    """Deterministic tar of ``site`` compressed xz -9 into ``out``; returns tool."""
    out.parent.mkdir(parents=True, exist_ok=True)
    xz = shutil.which("xz") if use_xz_binary else None
    if xz is not None:
        with out.open("wb") as dst:
            proc = subprocess.Popen([xz, "-9", "-T2", "-c"], stdin=subprocess.PIPE, stdout=dst)
            assert proc.stdin is not None
            try:
                _write_tar(site, proc.stdin)
            finally:
                proc.stdin.close()
                rc = proc.wait()
        if rc != 0:
            raise BundleError(f"xz exited with {rc}")
        return "xz -9 -T2"
    with lzma.open(out, "wb", preset=9) as dst:
        _write_tar(site, dst)
    return "lzma preset 9"


def split_file(path: Path, out: Path, part_bytes: int) -> list[Path]:
    """Split ``path`` into ``out/p<i>/<name>.partNN`` of at most ``part_bytes``.

    The parts are balanced: as few as the limit allows, of (nearly) equal
    size, so each folder keeps headroom for ``SHA256SUMS`` and the manifest.
    """
    if part_bytes <= 0:
        raise BundleError("part size must be positive")
    size = path.stat().st_size
    n_parts = max(1, -(-size // part_bytes))
    part_bytes = max(1, -(-size // n_parts))
    parts: list[Path] = []
    with path.open("rb") as src:
        i = 0
        while True:
            first = src.read(min(_CHUNK, part_bytes))
            if not first and i > 0:
                break
            target = out / f"p{i}" / f"{path.name}.part{i:02d}"
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as dst:
                dst.write(first)
                left = part_bytes - len(first)
                while left > 0 and (chunk := src.read(min(_CHUNK, left))):
                    dst.write(chunk)
                    left -= len(chunk)
            parts.append(target)
            i += 1
            if not first:
                break
    return parts


def write_sums(parts: Sequence[Path], whole: Path) -> str:
    """``SHA256SUMS`` text (sha256sum format) of the parts and the whole."""
    lines = [f"{sha256_file(p)}  {p.name}" for p in parts]
    lines.append(f"{sha256_file(whole)}  {whole.name}")
    return "\n".join(lines) + "\n"


def build_bundle(
    wheels: Mapping[WheelSpec, Path],
    lock: Mapping[str, tuple[str, str]],
    work: Path,
    out: Path,
    part_bytes: int = DEFAULT_PART_MIB * MIB,
    rules: Sequence[TrimRule] = TRIM_RULES,
    use_xz_binary: bool = True,
) -> dict[str, Any]:
    """Verify, unpack, trim, pack and split; returns the manifest it wrote."""
    t0 = time.monotonic()
    hashes = verify_wheels(wheels, lock)
    site = work / "site"
    if site.exists():
        shutil.rmtree(site)
    raw = unpack_wheels(wheels.values(), site)
    print(f"unpacked {len(wheels)} wheels: {_fmt_mib(raw)}")
    trimmed = trim_site(site, rules)
    for t in trimmed:
        print(f"  trimmed {t['path']} ({_fmt_mib(t['bytes'])}): {t['reason']}")
    unpacked, n_files = site_size(site)
    print(f"site after trim: {_fmt_mib(unpacked)} in {n_files} files")
    whole = work / BUNDLE_NAME
    tool = pack_site(site, whole, use_xz_binary=use_xz_binary)
    print(f"packed with {tool}: {_fmt_mib(whole.stat().st_size)}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_dir() and re.fullmatch(r"p\d+", stale.name):
            shutil.rmtree(stale)
    parts = split_file(whole, out, part_bytes)
    sums = write_sums(parts, whole)
    for part in parts:
        (part.parent / SUMS_NAME).write_text(sums)
    manifest: dict[str, Any] = {
        "bundle": BUNDLE_NAME,
        "bundle_bytes": whole.stat().st_size,
        "bundle_sha256": sha256_file(whole),
        "compressor": tool,
        "part_limit_bytes": part_bytes,
        "parts": [
            {
                "name": p.name,
                "dir": p.parent.name,
                "bytes": p.stat().st_size,
                "sha256": sha256_file(p),
            }
            for p in parts
        ],
        "unpacked_bytes": unpacked,
        "unpacked_files": n_files,
        "wheels": [
            {"name": s.name, "version": s.version, "file": p.name, "sha256": hashes[s]}
            for s, p in wheels.items()
        ],
        "trimmed": trimmed,
        "trim_rules": [{"pattern": r.pattern, "reason": r.reason} for r in rules],
    }
    (out / "p0" / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    for p in manifest["parts"]:
        folder = out / p["dir"]
        folder_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        note = "" if folder_bytes <= part_bytes else "  WARNING: folder over the part limit"
        print(f"  {p['dir']}/{p['name']}: {_fmt_mib(p['bytes'])}"
              f" (folder {_fmt_mib(folder_bytes)}){note}")
    print(f"build done in {time.monotonic() - t0:.0f} s")
    return manifest


# ------------------------------------------------------------------ unpack


def _parse_sums(text: str, where: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for raw in text.splitlines():
        if not raw.strip():
            continue
        m = re.fullmatch(r"([0-9a-f]{64})\s+\*?(\S+)", raw.strip())
        if m is None:
            raise BundleError(f"{where}: bad line {raw!r}")
        sums[m.group(2)] = m.group(1)
    return sums


def gather_parts(dirs: Sequence[Path]) -> tuple[dict[str, str], list[Path]]:
    """Find SHA256SUMS and the part files; check presence and part hashes."""
    sums: dict[str, str] | None = None
    sums_at: Path | None = None
    found: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            raise BundleError(f"parts folder {d} does not exist")
        for p in sorted(d.rglob("*")):
            if p.name == SUMS_NAME and p.is_file():
                parsed = _parse_sums(p.read_text(), p)
                if sums is None:
                    sums, sums_at = parsed, p
                elif parsed != sums:
                    raise BundleError(f"{p} differs from {sums_at}")
            elif PART_RE.fullmatch(p.name) and p.is_file():
                found.setdefault(p.name, p)
    if sums is None:
        raise BundleError(f"no {SUMS_NAME} in {', '.join(map(str, dirs))}")
    if BUNDLE_NAME not in sums:
        raise BundleError(f"{sums_at} lists no sha256 for {BUNDLE_NAME}")
    listed = sorted((n for n in sums if PART_RE.fullmatch(n)), key=_part_index)
    if not listed:
        raise BundleError(f"{sums_at} lists no parts")
    missing = [n for n in listed if n not in found]
    if missing:
        raise BundleError(f"missing part(s) {', '.join(missing)} (listed in {sums_at})")
    extra = sorted(set(found) - set(listed))
    if extra:
        raise BundleError(f"part(s) {', '.join(extra)} not listed in {sums_at}")
    parts = [found[n] for n in listed]
    for p in parts:
        actual = sha256_file(p)
        if actual != sums[p.name]:
            raise BundleError(
                f"part {p.name} ({p}) is corrupt: sha256 {actual}, "
                f"{SUMS_NAME} says {sums[p.name]}"
            )
    return sums, parts


def _part_index(name: str) -> int:
    m = PART_RE.fullmatch(name)
    assert m is not None
    return int(m.group(1))


def _check_member(member: tarfile.TarInfo, dest: Path) -> None:
    _safe_rel(member.name, "archive member")
    if member.issym() or member.islnk():
        link = member.linkname
        base = PurePosixPath(member.name).parent if member.issym() else PurePosixPath()
        target = PurePosixPath(link) if link.startswith("/") else base / link
        resolved = os.path.normpath(dest.joinpath(*target.parts))
        if link.startswith("/") or not resolved.startswith(str(dest.resolve())):
            raise BundleError(f"archive member {member.name!r} links outside: {link!r}")
    elif not (member.isfile() or member.isdir()):
        raise BundleError(f"archive member {member.name!r} has unsupported type")


def unpack_bundle(part_dirs: Sequence[Path], dest: Path, force: bool = False) -> dict[str, Any]:
    """Check, join and extract the parts into ``dest`` (see the contract)."""
    t0 = time.monotonic()
    sums, parts = gather_parts(part_dirs)
    want = sums[BUNDLE_NAME]
    marker = dest / DONE_MARKER
    if not force and marker.is_file() and marker.read_text().strip() == want:
        print(f"{dest} already holds bundle {want[:12]}; nothing to do")
        return {"dest": str(dest), "skipped": True, "seconds": time.monotonic() - t0}
    dest.mkdir(parents=True, exist_ok=True)
    dest = dest.resolve()
    fd, tmp_name = tempfile.mkstemp(prefix=".bundle-", suffix=".tar.xz", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        total = 0
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with p.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        total += len(chunk)
        if h.hexdigest() != want:
            raise BundleError(
                f"joined {BUNDLE_NAME} sha256 {h.hexdigest()} != {SUMS_NAME} {want}"
            )
        print(f"joined {len(parts)} part(s): {total / MIB:.1f} MiB, sha256 ok")
        n = size = 0
        with tarfile.open(tmp, mode="r:xz") as tar:
            members = tar.getmembers()
            for m in members:
                _check_member(m, dest)
            kwargs: dict[str, Any] = {}
            if hasattr(tarfile, "data_filter"):
                kwargs["filter"] = "data"
            tar.extractall(dest, members=members, **kwargs)
            for m in members:
                if m.isfile():
                    n += 1
                    size += m.size
        marker.write_text(want + "\n")
    finally:
        tmp.unlink(missing_ok=True)
    secs = time.monotonic() - t0
    print(f"extracted {n} files ({size / MIB:.1f} MiB) into {dest} in {secs:.1f} s")
    return {"dest": str(dest), "skipped": False, "files": n, "bytes": size, "seconds": secs}


# --------------------------------------------------------------------- CLI


def _specs_and_wheels(args: argparse.Namespace) -> dict[WheelSpec, Path]:
    profile = PROFILES[args.profile]
    return ensure_wheels(profile.wheels, Path(args.wheel_cache or profile.wheel_cache),
                         [Path(s) for s in args.seed], args.python)


def _add_fetch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=sorted(PROFILES), default="vllm",
                   help="vllm (two parts) or sglang (one part): which bundle")
    p.add_argument("--wheel-cache", default=None,
                   help="wheel cache folder (default: the profile's)")
    p.add_argument(
        "--seed",
        action="append",
        default=[],
        help="wheel file to copy into the cache instead of downloading (repeatable)",
    )
    p.add_argument("--python", default="python3", help="interpreter whose pip downloads")
    p.add_argument("--lock-file", default=None, help="lock file (default: the profile's)")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``lock``, ``build`` and ``unpack`` sub-commands."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_lock = sub.add_parser("lock", help="fetch the wheels and (re)write wheels.lock")
    _add_fetch_args(p_lock)
    p_build = sub.add_parser("build", help="fetch, verify, unpack, trim, pack, split")
    _add_fetch_args(p_build)
    p_build.add_argument("--out", default=None,
                         help="output folder (gets p0/, p1/, ...; default: the profile's)")
    p_build.add_argument("--work", default=None, help="staging folder (default: the profile's)")
    p_build.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB)
    p_build.add_argument("--update-lock", action="store_true", help="write the lock first")
    p_build.add_argument("--trim-moe", action="store_true", help="also drop _moe_C")
    p_build.add_argument("--no-xz-binary", action="store_true", help="use Python's lzma")
    p_unpack = sub.add_parser("unpack", help="check, join and extract parts (stdlib only)")
    p_unpack.add_argument("--parts", nargs="+", required=True, help="folders with parts")
    p_unpack.add_argument("--dest", required=True, help="site folder to extract into")
    p_unpack.add_argument("--force", action="store_true", help="extract even if done")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "unpack":
            unpack_bundle([Path(d) for d in args.parts], Path(args.dest), force=args.force)
            return 0
        wheels = _specs_and_wheels(args)
        profile = PROFILES[args.profile]
        lock_path = Path(args.lock_file or profile.lock)
        if args.cmd == "lock" or args.update_lock:
            write_lock(lock_path, wheels)
            print(f"wrote {lock_path} ({len(wheels)} wheels)")
            if args.cmd == "lock":
                return 0
        if not lock_path.is_file():
            raise BundleError(f"{lock_path} missing; run with --update-lock")
        rules = profile.rules + (OPTIONAL_TRIM_RULES if args.trim_moe else ())
        build_bundle(
            wheels,
            read_lock(lock_path),
            Path(args.work or profile.work),
            Path(args.out or profile.out),
            part_bytes=int(args.part_mib * MIB),
            rules=rules,
            use_xz_binary=not args.no_xz_binary,
        )
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
