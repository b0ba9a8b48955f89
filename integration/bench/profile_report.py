"""Read step profiles (``HICACHE_PROFILE``) and say where the time went: ``hicache profile``.

Contract
========

:func:`load` reads one profile file (tiers/profile.py writes it; the records'
fields are listed in connector/profile.py) into scheduler and worker records.
:func:`summarize` reduces one profile to per-step means, in milliseconds:

- ``forward_ms``: the model's forward pass (the worker's layer hooks inside it);
- ``worker_hooks_ms`` / ``layer_hooks_ms``: the connector's worker hooks
  outside / inside the forward pass;
- ``gap_ms``: from one worker step's end to the next one's start (the
  engine core scheduling, the step's output going back, the worker's idle loop);
- ``forward_thread_waited_ms``: the forward thread's time runnable but off
  a CPU (another thread had it);
- ``helper_cpu_ms``: CPU of HiCache's own threads (copy, L3 I/O, ...) during
  the step, and ``helper_cpu_between_ms`` between steps; ``helper_cpu_by_thread_ms``
  the same two per thread family (``{"hicache-l3": [in, between], ...}``; empty
  for profiles written before the records carried ``hicache_by_thread``);
- ``scheduler_hooks_ms``: the connector's scheduler hooks per step, and
  ``scheduler_thread_cpu_ms`` the engine core's scheduling thread's CPU per step
  (vLLM's own work included);
- ``scheduler_gc_ms`` / ``worker_gc_ms``: Python's garbage collection in the
  engine core / the first worker per step, and ``full_collections`` the
  generation-2 collections of both, each process's first record (the
  engine's start) left out (None for profiles written before the records
  carried ``gc``);
  ``deferred_per_step``: lookups answered "not yet";

and per request (admitted in the profile): ``queued_ms`` (arrival to the
step that admitted it), ``to_first_token_ms`` (that step to the end of the
worker step that computed its last prompt token) and ``ttft_ms`` (their
sum), as mean and p50 / p99. :func:`compare_table` prints profiles side by
side with ratios to the first; :func:`plot` draws the steps over time and the
per-step split, the figure a person reads before the table.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Profile:
    """One profile file: its scheduler records and its worker records (every rank)."""

    name: str
    scheduler: list[dict[str, Any]] = field(default_factory=list)
    worker: list[dict[str, Any]] = field(default_factory=list)


logger = logging.getLogger(__name__)


def load(path: str | Path, name: str | None = None) -> Profile:
    """Read a profile; lines that are not records are an error naming the line."""
    path = Path(path)
    prof = Profile(name or path.stem.removesuffix(".profile"))
    records: list[tuple[int, dict[str, Any]]] = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                role = rec["role"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a profile record ({exc})") from None
            if role not in ("scheduler", "worker"):
                raise ValueError(f"{path}:{n}: role must be scheduler or worker, got {role!r}")
            records.append((n, rec))
    # Servers append: of a file that several servers wrote one after another, the
    # last one's records (its engine core's and its workers').
    engines = list(dict.fromkeys(r.get("pid") for _, r in records if r["role"] == "scheduler"))
    if len(engines) > 1:
        first = next(n for n, r in records
                     if r["role"] == "scheduler" and r.get("pid") == engines[-1])
        # Its workers may write a record before its engine core's first one.
        last = {engines[-1]} | {r.get("pid") for n, r in records
                                if r["role"] == "worker" and n > first}
        logger.warning("%s holds the records of %d servers; reading the last one's", path,
                       len(engines))
        records = [(n, r) for n, r in records if r.get("pid") in last]
    for _, rec in records:
        (prof.scheduler if rec["role"] == "scheduler" else prof.worker).append(rec)
    # Inside vLLM's MultiConnector every child writes records: keep HiCache's (else the
    # first child's), one record per step and rank.
    for half in (prof.scheduler, prof.worker):
        names = list(dict.fromkeys(r.get("connector", "") for r in half))
        keep = "HiCacheConnector" if "HiCacheConnector" in names else (names or [""])[0]
        half[:] = [r for r in half if r.get("connector", "") == keep]
    return prof


def _ms(xs: Sequence[float]) -> float | None:
    return round(1e3 * statistics.fmean(xs), 3) if xs else None


def _pct(xs: Sequence[float], q: float) -> float | None:
    return round(1e3 * float(np.percentile(xs, q)), 3) if xs else None


def _hook_s(rec: Mapping[str, Any], names: Sequence[str] | None = None,
            skip: Sequence[str] = ()) -> float:
    return sum(s for k, (_, s) in rec.get("hooks", {}).items()
               if (names is None or k in names) and k not in skip)


LAYER_HOOKS = ("wait_for_layer_load", "save_kv_layer")


def _serving(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records after a process's first (which covers the engine's start)."""
    return sorted(records, key=lambda r: r["t0"])[1:]


def _gc_ms(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean GC seconds per record while serving, in ms (None: profiles written before
    records carried ``gc``)."""
    return _ms([r["gc"]["s"] for r in _serving(records) if "gc" in r])


def _full_collections(records: Sequence[Mapping[str, Any]]) -> int | None:
    counts = [r["gc"]["collections"][2] for r in _serving(records) if "gc" in r]
    return sum(counts) if counts else None


def _sum_known(scheduler: int | None, worker: int | None) -> int | None:
    """Both halves' counts added, None when the scheduler's records carry none."""
    return None if scheduler is None else scheduler + (worker or 0)


def _busy(prof: Profile, skip_idle: bool) -> list[dict[str, Any]]:
    """Worker steps of the first rank (the steps all ranks run), in order; with
    ``skip_idle`` only those that ran a forward pass."""
    pids = sorted({r["pid"] for r in prof.worker})
    steps = [r for r in prof.worker if pids and r["pid"] == pids[0]]
    steps.sort(key=lambda r: r["t0"])
    return [r for r in steps if r.get("forward_s") is not None] if skip_idle else steps


def requests(prof: Profile) -> list[dict[str, float]]:
    """Per admitted request: queued (arrival -> admitting step), to its first token."""
    ends = {r["seq"]: r["t1"] for r in prof.worker if r.get("seq") is not None}
    admitted: dict[str, tuple[float, float]] = {}
    first: dict[str, float] = {}
    for rec in prof.scheduler:
        for a in rec.get("admitted", []):
            admitted.setdefault(a["id"], (a["arrival"], rec["t1"]))
        for rid in rec.get("first_token", []):
            if rid not in first and rec["seq"] in ends:
                first[rid] = ends[rec["seq"]]
    out = []
    for rid, (arrival, scheduled) in admitted.items():
        row = {"queued": max(0.0, scheduled - arrival)}
        if rid in first:
            row["to_first_token"] = first[rid] - scheduled
            row["ttft"] = first[rid] - arrival
        out.append(row)
    return out


def _by_thread_ms(steps: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """Mean CPU ms per step of each helper-thread family, in the step and between."""
    if not steps:
        return {}
    families = sorted({f for r in steps for part in ("cpu", "cpu_between")
                       for f in r.get(part, {}).get("hicache_by_thread", {})})
    return {f: [_ms([r["cpu"].get("hicache_by_thread", {}).get(f, 0.0) for r in steps]),
                _ms([r.get("cpu_between", {}).get("hicache_by_thread", {}).get(f, 0.0)
                     for r in steps])]
            for f in families}


def summarize(prof: Profile) -> dict[str, Any]:
    """Per-step means and per-request latencies (see the module docstring)."""
    steps = _busy(prof, skip_idle=True)
    every = _busy(prof, skip_idle=False)
    gaps = [b["t0"] - a["t1"] for a, b in zip(every, every[1:], strict=False)]
    reqs = requests(prof)
    out: dict[str, Any] = {
        "name": prof.name, "worker_steps": len(steps),
        "span_s": round(every[-1]["t1"] - every[0]["t0"], 3) if every else None,
        "forward_ms": _ms([r["forward_s"] for r in steps]),
        "step_ms": _ms([r["t1"] - r["t0"] for r in steps]),
        "gap_ms": _ms(gaps),
        "layer_hooks_ms": _ms([_hook_s(r, LAYER_HOOKS) for r in steps]),
        "worker_hooks_ms": _ms([_hook_s(r, skip=LAYER_HOOKS) for r in steps]),
        "forward_thread_cpu_ms": _ms([r["cpu"]["thread"] for r in steps]),
        "forward_thread_waited_ms": _ms([r["cpu"]["thread_waited"] for r in steps]),
        "helper_cpu_ms": _ms([r["cpu"]["hicache_threads"] for r in steps]),
        "helper_cpu_between_ms": _ms([r.get("cpu_between", {}).get("hicache_threads", 0.0)
                                      for r in steps]),
        "helper_cpu_by_thread_ms": _by_thread_ms(steps),
        "scheduler_steps": len(prof.scheduler),
        "scheduler_hooks_ms": _ms([_hook_s(r) for r in prof.scheduler]),
        "scheduler_thread_cpu_ms": _ms([r["cpu"]["thread"] for r in prof.scheduler
                                         if "cpu" in r]),
        "scheduler_gc_ms": _gc_ms(prof.scheduler),
        "worker_gc_ms": _gc_ms(every),
        "full_collections": _sum_known(_full_collections(prof.scheduler),
                                       _full_collections(every)),
        "deferred_per_step": (round(statistics.fmean(r.get("deferred", 0)
                                                     for r in prof.scheduler), 3)
                              if prof.scheduler else None),
        "tokens_per_step": (round(statistics.fmean(r["scheduled"]["tokens"]
                                                   for r in prof.scheduler), 1)
                            if prof.scheduler else None),
        "requests": len(reqs),
    }
    for key in ("queued", "to_first_token", "ttft"):
        xs = [r[key] for r in reqs if key in r]
        out[f"{key}_ms"] = {"mean": _ms(xs), "p50": _pct(xs, 50), "p99": _pct(xs, 99)}
    return out


ROWS = (("worker steps", "worker_steps", "d"), ("tokens / step", "tokens_per_step", ".0f"),
        ("step ms", "step_ms", ".2f"), ("forward ms", "forward_ms", ".2f"),
        ("gap between steps ms", "gap_ms", ".2f"),
        ("layer hooks ms (in forward)", "layer_hooks_ms", ".3f"),
        ("worker hooks ms (outside)", "worker_hooks_ms", ".3f"),
        ("scheduler hooks ms", "scheduler_hooks_ms", ".3f"),
        ("scheduler thread CPU ms", "scheduler_thread_cpu_ms", ".2f"),
        ("GC ms, engine core", "scheduler_gc_ms", ".3f"),
        ("GC ms, worker", "worker_gc_ms", ".3f"),
        ("full GC collections (both)", "full_collections", "d"),
        ("forward thread CPU ms", "forward_thread_cpu_ms", ".2f"),
        ("forward thread waited ms", "forward_thread_waited_ms", ".3f"),
        ("HiCache threads CPU ms (in step)", "helper_cpu_ms", ".3f"),
        ("HiCache threads CPU ms (between)", "helper_cpu_between_ms", ".3f"),
        ("lookups deferred / step", "deferred_per_step", ".3f"))


def compare_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table: one column per profile, then each against the first."""
    names = [s["name"] for s in summaries]
    head = "| per step (means) | " + " | ".join(names) + " | " + " | ".join(
        f"{n} × {names[0]}" for n in names[1:]) + " |"
    lines = [head, "|---" * (len(names) * 2) + "|"]

    def cell(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def ratio(a: Any, b: Any) -> str:
        return "-" if not a or b is None else f"{b / a:.2f}"

    rows = [(label, [s.get(key) for s in summaries], fmt) for label, key, fmt in ROWS]
    families = sorted({f for s in summaries for f in s.get("helper_cpu_by_thread_ms", {})})
    for family in families:
        for i, where in enumerate(("in step", "between")):
            rows.append((f"{family} CPU ms ({where})",
                         [(s.get("helper_cpu_by_thread_ms", {}).get(family) or [0.0, 0.0])[i]
                          for s in summaries], ".3f"))
    for key, label in (("queued_ms", "request: queued ms"),
                       ("to_first_token_ms", "request: admitted → first token ms"),
                       ("ttft_ms", "request: arrival → first token ms")):
        for stat in ("mean", "p99"):
            rows.append((f"{label} ({stat})", [s[key][stat] for s in summaries], ".1f"))
    for label, vals, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(cell(v, fmt) for v in vals) + " | "
                     + " | ".join(ratio(vals[0], v) for v in vals[1:]) + " |")
    return "\n".join(lines)


def plot(profiles: Sequence[Profile], out: str | Path) -> Path:
    """Steps over time (forward pass and the hooks around it) and the per-step split."""
    from hicache.integration.bench.report import _ensure_mpl_config_dir, _save

    _ensure_mpl_config_dir()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2),
                                 gridspec_kw={"width_ratios": [2, 1]})
    for i, prof in enumerate(profiles):
        steps = _busy(prof, skip_idle=True)
        if not steps:
            continue
        t0 = steps[0]["t0"]
        ax.plot([r["t0"] - t0 for r in steps], [1e3 * (r["t1"] - r["t0"]) for r in steps],
                ".", ms=3, color=f"C{i}", label=f"{prof.name}: step")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("worker step (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Engine steps over time")
    sums = [summarize(p) for p in profiles]
    for s in sums:  # the scheduler's hooks run between the worker's steps
        s["rest_of_gap_ms"] = max(0.0, (s.get("gap_ms") or 0.0)
                                  - (s.get("scheduler_hooks_ms") or 0.0))
    parts = (("forward_ms", "forward pass"), ("worker_hooks_ms", "worker hooks"),
             ("scheduler_hooks_ms", "scheduler hooks"), ("rest_of_gap_ms", "rest of the gap"))
    bottom = np.zeros(len(sums))
    for j, (key, label) in enumerate(parts):
        vals = np.array([s.get(key) or 0.0 for s in sums])
        bx.bar(range(len(sums)), vals, bottom=bottom, color=f"C{j}", label=label)
        bottom += vals
    bx.set_xticks(range(len(sums)), [s["name"] for s in sums], rotation=15)
    bx.set_ylabel("ms per step (mean)")
    bx.set_title("Where a step's time goes")
    bx.legend(fontsize=8)
    bx.grid(axis="y", alpha=0.3)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)
