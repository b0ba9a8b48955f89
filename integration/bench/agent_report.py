"""Agent sessions across runs of ``hicache bench compare agent``: returning-turn TTFT of
each system, per run and pooled, and one plot.

Contract: ``report(dirs, plot)`` reads each run directory's ``<system>.json`` (written
by ``bench compare``), returns ``{system: {"runs": [{"p50_ms", "p99_ms", "n"}],
"pooled": {...}, "ratio_to_first": {...}}}`` (the first system of the first run is the
baseline of the ratios) and draws the returning turns' TTFT CDF of every system,
pooled over the runs, into ``plot``.

    python -m hicache.integration.bench.agent_report RUN_DIR [RUN_DIR ...] --plot out.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hicache.integration.bench.compare import returning_ttfts


def _quantiles(vals: list[float]) -> dict[str, Any]:
    vals = sorted(vals)
    if not vals:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    pick = lambda q: round(1e3 * vals[min(len(vals) - 1, int(q * len(vals)))], 1)  # noqa: E731
    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "n": len(vals)}


def report(dirs: list[Path], plot: Path | None = None) -> dict[str, Any]:
    per: dict[str, list[list[float]]] = {}
    for d in dirs:
        rows = json.loads((d / "compare.json").read_text())["rows"]
        for row in rows:
            path = d / f"{row['system']}.json"
            if row.get("status") == "not run" or not path.exists():
                continue
            per.setdefault(row["system"], []).append(
                returning_ttfts(json.loads(path.read_text())["requests"]))
    out: dict[str, Any] = {}
    for system, runs in per.items():
        out[system] = {"runs": [_quantiles(r) for r in runs],
                       "pooled": _quantiles([v for r in runs for v in r])}
    if out:
        base = next(iter(out.values()))["pooled"]
        for entry in out.values():
            entry["ratio_to_first"] = {
                k: round(entry["pooled"][k] / base[k], 3) if base[k] else None
                for k in ("p50_ms", "p99_ms")}
    if plot is not None and per:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for system, runs in per.items():
            vals = sorted(1e3 * v for r in runs for v in r)
            ax.step(vals, [(i + 1) / len(vals) for i in range(len(vals))], where="post",
                    label=f"{system} (p50 {out[system]['pooled']['p50_ms']} ms)")
        ax.set_xlabel("returning-turn TTFT, ms")
        ax.set_ylabel("share of returning turns")
        ax.set_title(f"Agent sessions, {len(dirs)} runs pooled")
        ax.legend(loc="lower right")
        fig.tight_layout()
        plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    print(json.dumps(report(args.dirs, args.plot), indent=2))


if __name__ == "__main__":
    main()
