"""Seeded workload shared by our side and the peer scripts of the peer benchmarks.

Contract:
- ``make_spec(seed, quick)`` returns the parameters (plain JSON types) of all
  three comparisons: radix trees (a), file L3 stores (b) and KV store /
  retrieve paths (c). ``--quick`` gives a workload small enough for tests.
- ``write_workload(spec, directory)`` turns the spec into files in
  ``directory``: ``workload.json`` (the spec plus the data file names) and
  ``.npy`` arrays holding every token and byte either side uses. It is
  deterministic: the same spec gives byte-identical arrays (and the same
  ``digests`` recorded in ``workload.json``), whatever process writes them.
  Both sides read the arrays from these files, so they never depend on two
  numpy versions generating the same random stream.
- ``workload.json`` also lists the file-store cases of (b) with their page
  keys, so both sides name pages identically.
- Arrays: ``radix_hit.npy`` (requests: a shared prefix plus a unique suffix,
  int32 tokens), ``radix_miss.npy`` (sequences sharing no first page with
  any request), ``file_pages.npy`` (uint8, enough bytes for the largest page
  count of (b)), ``kv.npy`` (bf16 KV as uint16 bits, shape [2, L, T, H*D],
  LMCache's KV_2LTD order) and ``kv_tokens.npy`` (int64, the T tokens).
- Peer scripts must read this format with numpy and json alone (they never
  import hicache): keep it plain.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 32_000
FORMAT = 1


def make_spec(seed: int = 0, quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """All workload parameters; ``quick`` is a tiny variant for tests and smoke runs."""
    if quick:
        spec: dict[str, Any] = {
            "radix": {"page_sizes": [16], "prefixes": 4, "prefix_len": 256, "suffix_len": 128,
                      "requests": 24, "misses": 8},
            "file": {"page_kib": [64], "total_mib": 2},
            "kv": {"layers": 2, "kv_heads": 2, "head_dim": 64, "tokens": 1024,
                   "chunk": 256, "block_size": 16},
            "repeats": 2,
        }
    else:
        spec = {
            # feasibility.md's SGLang radix workload: 64 shared 1024-token
            # prefixes, 2000 requests of prefix + 512 unique tokens.
            "radix": {"page_sizes": [16, 64], "prefixes": 64, "prefix_len": 1024,
                      "suffix_len": 512, "requests": 2000, "misses": 500},
            "file": {"page_kib": [64, 1024, 4096], "total_mib": 128},
            # 8 layers x 8 KV heads x 128 dims, bf16: 32 KiB per token, 128 MiB in all.
            "kv": {"layers": 8, "kv_heads": 8, "head_dim": 128, "tokens": 4096,
                   "chunk": 256, "block_size": 16},
            "repeats": 7,
        }
    if repeats is not None:
        spec["repeats"] = repeats
    spec["seed"] = seed
    spec["quick"] = quick
    spec["format"] = FORMAT
    return spec


def _radix_arrays(spec: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    r = spec["radix"]
    prefixes = rng.integers(0, VOCAB, (r["prefixes"], r["prefix_len"]), dtype=np.int32)
    owner = rng.integers(0, r["prefixes"], r["requests"])
    suffixes = rng.integers(0, VOCAB, (r["requests"], r["suffix_len"]), dtype=np.int32)
    hit = np.concatenate([prefixes[owner], suffixes], axis=1)
    miss = rng.integers(0, VOCAB, (r["misses"], r["prefix_len"] + r["suffix_len"]),
                        dtype=np.int32)
    # A miss must differ from every request within its first token, so it
    # misses at the root on both trees; token VOCAB is never generated above.
    miss[:, 0] = VOCAB
    return {"radix_hit": hit, "radix_miss": miss}


def _kv_arrays(spec: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    k = spec["kv"]
    shape = (2, k["layers"], k["tokens"], k["kv_heads"] * k["head_dim"])
    # Random finite bf16 values: sign, exponent in a normal range, random mantissa.
    sign = rng.integers(0, 2, shape, dtype=np.uint16) << 15
    exponent = rng.integers(112, 136, shape, dtype=np.uint16) << 7
    mantissa = rng.integers(0, 128, shape, dtype=np.uint16)
    kv = sign | exponent | mantissa
    tokens = rng.integers(0, VOCAB, k["tokens"], dtype=np.int64)
    return {"kv": kv, "kv_tokens": tokens}


def _file_arrays(spec: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    total = int(spec["file"]["total_mib"] * 2**20)
    return {"file_pages": rng.integers(0, 256, total, dtype=np.uint8)}


def file_cases(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Each file-store case of (b): page bytes, page count and the page keys (64-char hex)."""
    total = int(spec["file"]["total_mib"] * 2**20)
    cases = []
    for kib in spec["file"]["page_kib"]:
        page_bytes = kib * 1024
        pages = max(1, total // page_bytes)
        keys = [hashlib.sha256(f"peers:{spec['seed']}:{page_bytes}:{i}".encode()).hexdigest()
                for i in range(pages)]
        cases.append({"page_bytes": page_bytes, "pages": pages, "keys": keys})
    return cases


def write_workload(spec: dict[str, Any], directory: Path) -> Path:
    """Write the arrays and ``workload.json`` into ``directory``; returns the JSON's path."""
    directory.mkdir(parents=True, exist_ok=True)
    seed = int(spec["seed"])
    # One independent stream per part, so changing one part's size leaves the others alone.
    arrays: dict[str, np.ndarray] = {}
    for part, make in (("radix", _radix_arrays), ("file", _file_arrays), ("kv", _kv_arrays)):
        rng = np.random.default_rng([seed, FORMAT, int.from_bytes(part.encode(), "little")])
        arrays.update(make(spec, rng))
    files: dict[str, str] = {}
    digests: dict[str, str] = {}
    for name, array in arrays.items():
        path = directory / f"{name}.npy"
        np.save(path, np.ascontiguousarray(array))
        files[name] = path.name
        digests[name] = hashlib.sha256(array.tobytes()).hexdigest()[:16]
    doc = dict(spec, files=files, digests=digests, file_cases=file_cases(spec))
    out = directory / "workload.json"
    out.write_text(json.dumps(doc, indent=1))
    return out


def load_workload(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read ``workload.json`` and its arrays (memory-mapped where large)."""
    doc = json.loads(path.read_text())
    arrays = {name: np.load(path.parent / fname, mmap_mode="r")
              for name, fname in doc["files"].items()}
    return doc, arrays
