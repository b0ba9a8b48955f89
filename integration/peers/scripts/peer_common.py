"""Helpers shared by the peer scripts (run by a peer venv's python; never imports hicache).

Contract: ``main(run)`` parses ``<workload.json> <result.json> [parts]`` from
argv, loads the workload (JSON plus ``.npy`` arrays, numpy and json only),
calls ``run(doc, arrays, workdir, parts)`` and writes ``{"metrics": ...,
"versions": ..., "errors": ...}`` to the result path. A part that raises is
recorded in ``errors`` as ``"<ExceptionType>: <message>"`` (with the
traceback on stderr) and the other parts still run; the process exits 0
whenever the result file was written. Metrics use the format of
``hicache.integration.peers.ours.metric``.
"""

from __future__ import annotations

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
