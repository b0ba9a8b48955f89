"""Helpers shared by the peer scripts and by our side (never imports hicache: peer venvs run it).

Contract: ``main(run)`` parses ``<workload.json> <result.json> [parts]`` from
argv, loads the workload (JSON plus ``.npy`` arrays, numpy and json only),
calls ``run(doc, arrays, workdir, parts)`` and writes ``{"metrics": ...,
"versions": ..., "errors": ...}`` to the result path. A part that raises is
recorded in ``errors`` as ``"<ExceptionType>: <message>"`` (with the
traceback on stderr) and the other parts still run; the process exits 0
whenever the result file was written. ``metric``, ``timed`` and
``file_case`` are also what ``hicache.integration.bench.peers.ours`` measures
with, so both sides of a comparison time exactly the same procedure.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Metric = dict[str, Any]
PartFn = Callable[[dict[str, Any], dict[str, np.ndarray], Path], dict[str, Metric]]


def metric(seconds: list[float], amount: float, unit: str, check: float | None = None,
           verified: bool | None = None) -> Metric:
    return {"seconds": seconds, "amount": amount, "unit": unit, "check": check,
            "verified": verified}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _exists_all(store: Any, keys: list[str]) -> list[bool]:
    return [store.exists(k) for k in keys]


def file_case(case: dict[str, Any], arrays: dict[str, np.ndarray], repeats: int,
              directory: Path, open_store: Callable[[Path, int], Any],
              set_ok: Callable[[Any], bool], get_ok: Callable[[Any], bool]) -> dict[str, Metric]:
    """The file-store measurement both sides run: batch set, exists, batch get (verified).

    ``open_store(directory, page_bytes)`` opens a store on an empty directory;
    ``set_ok`` / ``get_ok`` read its batch results (each store reports differently).
    """
    import os
    import shutil

    import torch

    page_bytes, n, keys = case["page_bytes"], case["pages"], case["keys"]
    data = torch.from_numpy(np.array(arrays["file_pages"][: n * page_bytes])).view(n, -1)
    values = list(data)
    targets = torch.zeros_like(data)
    target_list = list(targets)
    times: dict[str, list[float]] = {"set": [], "exists": [], "get": []}
    verified = True
    for _ in range(repeats):
        shutil.rmtree(directory, ignore_errors=True)
        store = open_store(directory, page_bytes)
        os.sync()  # no earlier writeback pending when the clock starts
        s, ok = timed(functools.partial(store.batch_set, keys, values))
        assert set_ok(ok), f"{type(store).__name__}.batch_set failed"
        times["set"].append(s)
        s, found = timed(functools.partial(_exists_all, store, keys))
        assert all(found), f"{type(store).__name__} lost a page"
        times["exists"].append(s)
        targets.zero_()
        s, got = timed(functools.partial(store.batch_get, keys, target_list))
        verified = verified and get_ok(got) and torch.equal(targets, data)
        times["get"].append(s)
        getattr(store, "close", lambda: None)()
    shutil.rmtree(directory, ignore_errors=True)
    tag = f"file/{page_bytes // 1024}k"
    return {f"{tag}/set": metric(times["set"], n * page_bytes, "B", n),
            f"{tag}/exists": metric(times["exists"], n, "op", n),
            f"{tag}/get": metric(times["get"], n * page_bytes, "B", n, verified)}


def load_workload(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    doc = json.loads(path.read_text())
    arrays = {name: np.load(path.parent / fname, mmap_mode="r")
              for name, fname in doc["files"].items()}
    return doc, arrays


def main(parts: dict[str, PartFn], versions: Callable[[], dict[str, str]]) -> None:
    workload, result = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = sys.argv[3].split(",") if len(sys.argv) > 3 else list(parts)
    doc, arrays = load_workload(workload)
    workdir = result.parent / (result.stem + "-work")
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"metrics": {}, "errors": {}, "versions": {}}
    try:
        out["versions"] = versions()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        out["errors"]["versions"] = f"{type(exc).__name__}: {exc}"
    for name in wanted:
        if name not in parts:
            continue
        t0 = time.perf_counter()
        try:
            out["metrics"].update(parts[name](doc, arrays, workdir))
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the others
            traceback.print_exc()
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
        print(f"[peer] part {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    result.write_text(json.dumps(out, indent=1))
