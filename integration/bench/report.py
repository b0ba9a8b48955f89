"""Aggregates, tables and plots of ``hicache bench run`` results.

Contract
========

* :func:`summarize` turns request records (``RequestRecord`` objects or their
  JSON dicts) into one JSON-safe dict: every statistic over no data is
  ``None``, never NaN. Latencies are in milliseconds, throughputs per second
  of ``duration_s``. Only completed requests (``error is None``) count
  towards latencies, tokens and throughput; ``n_errors`` counts the rest.
  ``cached_tokens`` / ``cached_share`` are ``None`` unless every completed
  request reported ``cached_tokens`` (a server without prompt-token details).
  Percentiles interpolate linearly between samples (numpy's default).
* :func:`write_plots` draws one PNG per view into ``out_dir`` (TTFT CDF,
  cached-token share per turn, throughput bars) for one or several systems,
  labelled by the keys of ``results``; values may be ``BenchResult``
  objects or their ``to_dict()`` JSON, so saved results can be re-plotted.
* :func:`format_table` is the same comparison as a ``rich`` table.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rich.table import Table

    from hicache.integration.bench.records import BenchResult, RequestRecord


def _get(r: Any, key: str) -> Any:
    return r.get(key) if isinstance(r, Mapping) else getattr(r, key)


def _num(x: float | None, ndigits: int = 3) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), ndigits)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99),
                scale: float = 1.0) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` of ``values`` times ``scale``; all None when empty."""
    if not len(values):
        return {f"p{q:g}": None for q in qs}
    arr = np.asarray(values, dtype=float) * scale
    return {f"p{q:g}": _num(float(np.percentile(arr, q))) for q in qs}


def summarize(requests: Sequence[RequestRecord | Mapping[str, Any]],
              duration_s: float) -> dict[str, Any]:
    """Aggregate statistics of one run (see the module docstring)."""
    ok = [r for r in requests if _get(r, "error") is None]
    ttfts = [_get(r, "ttft") for r in ok if _get(r, "ttft") is not None]
    itls = [gap for r in ok for gap in (_get(r, "itl") or [])]
    prompt = sum(int(_get(r, "prompt_tokens") or 0) for r in ok)
    output = sum(int(_get(r, "output_tokens") or 0) for r in ok)
    cached = _cached_sum(ok)
    per_sec = (lambda x: _num(x / duration_s)) if duration_s > 0 else (lambda x: None)
    ttft_ms = percentiles(ttfts, scale=1e3)
    ttft_ms["mean"] = _num(float(np.mean(ttfts)) * 1e3) if ttfts else None
    per_turn = []
    for turn in sorted({int(_get(r, "turn")) for r in ok}):
        rs = [r for r in ok if int(_get(r, "turn")) == turn]
        t_ttft = [_get(r, "ttft") for r in rs if _get(r, "ttft") is not None]
        t_prompt = sum(int(_get(r, "prompt_tokens") or 0) for r in rs)
        t_cached = _cached_sum(rs)
        per_turn.append({
            "turn": turn, "n": len(rs),
            "ttft_ms_p50": percentiles(t_ttft, (50,), 1e3)["p50"],
            "cached_share": _num(t_cached / t_prompt, 4) if t_cached is not None and t_prompt
            else None,
        })
    return {
        "n_requests": len(requests),
        "n_errors": len(requests) - len(ok),
        "duration_s": _num(duration_s),
        "ttft_ms": ttft_ms,
        "itl_ms": percentiles(itls, scale=1e3),
        "request_throughput": per_sec(len(ok)),
        "output_throughput": per_sec(output),
        "total_token_throughput": per_sec(prompt + output),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "cached_share": _num(cached / prompt, 4) if cached is not None and prompt else None,
        "per_turn": per_turn,
    }


def _cached_sum(records: Sequence[Any]) -> int | None:
    values = [_get(r, "cached_tokens") for r in records]
    if not values or any(v is None for v in values):
        return None
    return int(sum(values))


# ---- several systems ------------------------------------------------------------


def _as_dict(result: BenchResult | Mapping[str, Any]) -> dict[str, Any]:
    d = dict(result) if isinstance(result, Mapping) else result.to_dict()
    if not d.get("summary"):
        d["summary"] = summarize(d.get("requests", []), float(d.get("duration_s") or 0))
    return d


def _ensure_mpl_config_dir() -> None:
    """matplotlib needs a writable config dir; use a temporary one when HOME's is not."""
    if os.environ.get("MPLCONFIGDIR"):
        return
    home = Path.home() / ".config" / "matplotlib"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / f"hicache-mpl-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["MPLCONFIGDIR"] = str(path)


def write_plots(results: Mapping[str, BenchResult | Mapping[str, Any]],
                out_dir: str | Path) -> list[Path]:
    """TTFT CDF, cached share per turn and throughput PNGs of every system; their paths."""
    _ensure_mpl_config_dir()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {name: _as_dict(r) for name, r in results.items()}
    paths: list[Path] = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, d) in enumerate(data.items()):
        ttft = sorted(r["ttft"] * 1e3 for r in d.get("requests", [])
                      if r.get("error") is None and r.get("ttft") is not None)
        if ttft:
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", color=f"C{i}",
                    label=f"{name} (p50 {np.percentile(ttft, 50):.0f} ms)")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, d) in enumerate(data.items()):
        turns = [(t["turn"], t["cached_share"]) for t in d["summary"].get("per_turn", [])
                 if t.get("cached_share") is not None]
        if turns:
            ax.plot([t for t, _ in turns], [s * 100 for _, s in turns], marker="o",
                    color=f"C{i}", label=name)
        else:
            ax.plot([], [], color=f"C{i}", label=f"{name} (cached tokens not reported)")
    ax.set_xlabel("turn")
    ax.set_ylabel("cached prompt tokens (%)")
    ax.set_ylim(0, 102)
    ax.set_title("Prompt tokens served from cache, per turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "cached_share_per_turn.png"))

    names = list(data)
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.8))
    for ax, key, label in ((axes[0], "request_throughput", "requests/s"),
                           (axes[1], "output_throughput", "output tokens/s")):
        values = [data[n]["summary"].get(key) or 0.0 for n in names]
        bars = ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 3 else 0)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Throughput")
    paths.append(_save(fig, out / "throughput.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_table(results: Mapping[str, BenchResult | Mapping[str, Any]]) -> Table:
    """One row per system: requests, errors, TTFT/ITL percentiles, throughput, cache hits."""
    from rich.table import Table

    table = Table(title="hicache bench")
    for col in ("system", "requests", "errors", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                "ITL p50 ms", "req/s", "out tok/s", "cached %", "L2 hit %"):
        table.add_column(col, justify="left" if col == "system" else "right")

    def fmt(x: float | None, pct: bool = False) -> str:
        if x is None:
            return "-"
        return f"{x * 100:.1f}" if pct else f"{x:.2f}"

    for name, r in results.items():
        d = _as_dict(r)
        s = d["summary"]
        l2 = (d.get("tiers") or {}).get("l2") or {}
        table.add_row(
            name, str(s["n_requests"]), str(s["n_errors"]), fmt(s["ttft_ms"]["p50"]),
            fmt(s["ttft_ms"]["p90"]), fmt(s["ttft_ms"]["p99"]), fmt(s["itl_ms"]["p50"]),
            fmt(s["request_throughput"]), fmt(s["output_throughput"]),
            fmt(s["cached_share"], pct=True), fmt(l2.get("hit_rate"), pct=True),
        )
    return table
