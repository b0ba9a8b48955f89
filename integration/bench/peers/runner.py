"""Runs our side in this process and each peer's script in its own venv, then compares.

Contract:
- ``run(options)`` writes one seeded workload (``workload.write_workload``)
  into a work directory, then for each part (radix, file, kv) measures our
  side in-process (``ours.measure``) and right after it the peer owning that
  part as a subprocess: ``<venvs>/<peer>/bin/python scripts/<peer>_peer.py
  <workload.json> <result.json> <part>``. Interleaving per part keeps the
  two sides of a comparison close in time on a noisy machine.
- Peers: ``sglang`` owns ``radix`` and ``file`` (RadixCache, HiCacheFile);
  ``lmcache`` owns ``kv`` (its engine with local_cpu, then local_disk).
- Every comparison in ``comparisons(spec)`` yields one row, whatever
  happens: a missing venv, a script that fails or times out, a part the
  script reports as an error, or a metric missing from its result gives
  ``status = "not run: <reason>"`` and no ratio. Nothing is dropped.
- A row's rates are ``amount / median(seconds)``; ``ratio = ours / peer``
  of the rates, so > 1 means ours is faster. ``*_spread`` is the slowest /
  fastest repeat of a side (the noise the median had to see through). ``check`` values (tokens in the
  tree, tokens matched, pages) must agree between the two sides; a mismatch
  is noted on the row. ``verified`` says the retrieved bytes equalled the
  stored ones (on both sides).
- ``main`` prints a rich table with the load average before and after each
  part, writes ``<out>/peers.json`` (rows, raw per-repeat seconds, versions,
  load averages, spec) and ``<out>/peers.png`` (ratios).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.integration.bench.lmcache_service import NO_TELEMETRY
from hicache.integration.bench.peers import ours
from hicache.integration.bench.peers.workload import make_spec, write_workload

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SCRIPTS = HERE / "scripts"
DEFAULT_VENVS = REPO / ".venv-peers"
SETUP_HINT = "run: bash integration/bench/peers/setup_venvs.sh"

# peer -> (script, parts it owns, extra PYTHONPATH entries)
PEERS: dict[str, tuple[str, tuple[str, ...], tuple[Path, ...]]] = {
    "sglang": ("sglang_peer.py", ("radix", "file"), (SCRIPTS / "stubs",)),
    "lmcache": ("lmcache_peer.py", ("kv",), ()),
}
PART_OWNER = {part: peer for peer, (_, parts, _) in PEERS.items() for part in parts}
UNITS = {"tok": ("Mtok/s", 1e6), "B": ("GiB/s", 2**30), "op": ("ops/s", 1.0)}


@dataclass
class Options:
    out: Path = Path("bench_results")
    quick: bool = False
    peers: tuple[str, ...] = tuple(PEERS)
    parts: tuple[str, ...] = ours.PARTS
    venvs: Path = DEFAULT_VENVS
    seed: int = 0
    repeats: int | None = None
    workdir: Path | None = None
    timeout_s: float = 1800.0
    plot: bool = True


@dataclass
class Comparison:
    part: str
    case: str
    op: str
    ours_key: str
    peer: str
    peer_key: str
    note: str = ""


@dataclass
class PeerResult:
    metrics: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    failure: str | None = None  # whole-run failure: missing venv, crash, timeout
    seconds: float = 0.0


def comparisons(spec: dict[str, Any]) -> list[Comparison]:
    rows: list[Comparison] = []
    for p in spec["radix"]["page_sizes"]:
        case = f"page {p} tok"
        for op, label, note in (
            ("request", "new request: match + insert",
             "ours keys the request once (page_keys), then match + insert"),
            ("insert", "insert", "ours: page_keys (SHA-256 chain) + insert"),
            ("match", "match (hits)", "ours: page_keys (SHA-256 chain) + match"),
            ("miss", "match (misses)",
             "ours keys the whole request; SGLang stops at the first page"),
        ):
            rows.append(Comparison("radix", case, f"{label}, ours incl. hashing",
                                   f"radix/p{p}/{op}+hash", "sglang", f"radix/p{p}/{op}",
                                   note))
            rows.append(Comparison("radix", case, f"{label}, ours keys precomputed",
                                   f"radix/p{p}/{op}", "sglang", f"radix/p{p}/{op}",
                                   "tree only; ours is not charged for hashing"))
        rows.append(Comparison("radix", case, "evict half (LRU)", f"radix/p{p}/evict",
                               "sglang", f"radix/p{p}/evict",
                               "tokens evicted per s; SGLang frees whole leaves"))
    for kib in spec["file"]["page_kib"]:
        case = f"page {kib} KiB" if kib < 1024 else f"page {kib // 1024} MiB"
        for op, note in (("set", "ours: header + xxh3 checksum"),
                         ("get", "ours: checksum verified on read"),
                         ("exists", "one key per call")):
            rows.append(Comparison("file", case, op, f"file/{kib}k/{op}", "sglang",
                                   f"file/{kib}k/{op}", note))
    k = spec["kv"]
    case = f"{k['layers']}L x {k['tokens']} tok"
    for tier, peer_tier, note in (
        ("l2", "local_cpu", "ours: keys + tree + slots + CPU copy path"),
        ("l3", "local_disk", "ours: L2 path + file L3 (write-through, read from files)"),
    ):
        for op in ("store", "retrieve"):
            rows.append(Comparison("kv", case, f"{tier.upper()} {op} vs {peer_tier}",
                                   f"kv/{tier}/{op}", "lmcache", f"kv/{peer_tier}/{op}", note))
    return rows


# ---------------------------------------------------------------------- running


def run_peer(peer: str, workload: Path, workdir: Path, parts: list[str], venvs: Path,
             timeout_s: float) -> PeerResult:
    """Run one peer script for ``parts``; every failure comes back as ``failure``."""
    script, _, extra_path = PEERS[peer]
    python = venvs / peer / "bin" / "python"
    if not python.exists():
        return PeerResult(failure=f"peer venv {venvs / peer} missing ({SETUP_HINT})")
    result = workdir / f"{peer}-{'-'.join(parts)}.json"
    log = workdir / f"{peer}-{'-'.join(parts)}.log"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "SGLANG_", "LMCACHE_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in extra_path)
    env["PYTHONHASHSEED"] = "0"  # LMCache falls back to hash() without vLLM
    env.update(NO_TELEMETRY)  # LMCache reports usage unless told not to
    t0 = time.perf_counter()
    try:
        with log.open("w") as log_file:
            proc = subprocess.run(
                [str(python), str(SCRIPTS / script), str(workload), str(result), ",".join(parts)],
                stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                check=False)
    except subprocess.TimeoutExpired:
        return PeerResult(failure=f"{script} timed out after {timeout_s:.0f} s (log: {log})")
    except OSError as exc:
        return PeerResult(failure=f"cannot start {python}: {exc}")
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        return PeerResult(failure=f"{script} exited {proc.returncode}: "
                                  f"{tail[0][:200] if tail else 'no output'} (log: {log})",
                          seconds=seconds)
    doc = json.loads(result.read_text())
    return PeerResult(doc.get("metrics", {}), doc.get("errors", {}), doc.get("versions", {}),
                      None, seconds)


def _rate(m: dict[str, Any]) -> float:
    return m["amount"] / UNITS[m["unit"]][1] / statistics.median(m["seconds"])


def _spread(m: dict[str, Any]) -> float:
    """Slowest / fastest repeat: how much the machine moved during this measurement."""
    return max(m["seconds"]) / min(m["seconds"])


def build_rows(spec: dict[str, Any], our: dict[str, Any],
               peer_runs: dict[str, PeerResult]) -> list[dict[str, Any]]:
    """One row per comparison; ``peer_runs`` maps a part to its owner's run."""
    rows = []
    for c in comparisons(spec):
        row: dict[str, Any] = {"part": c.part, "case": c.case, "op": c.op, "peer": c.peer,
                               "ours_key": c.ours_key, "peer_key": c.peer_key, "note": c.note,
                               "ours": None, "peer_value": None, "ratio": None, "unit": None,
                               "status": "ok"}
        om = our.get("metrics", {}).get(c.ours_key)
        if om is not None:
            row["ours"], row["unit"] = _rate(om), UNITS[om["unit"]][0]
            row["ours_seconds"] = om["seconds"]
            row["ours_spread"] = _spread(om)
        res = peer_runs.get(c.part)
        reason = None
        if om is None:
            reason = our.get("errors", {}).get(c.part, "our side was not measured")
        elif res is None:
            reason = f"peer {c.peer} not selected (--peers)"
        elif res.failure is not None:
            reason = res.failure
        elif c.peer_key not in res.metrics:
            reason = res.errors.get(c.part, f"{c.peer} produced no {c.peer_key}")
        if reason is not None:
            row["status"] = f"not run: {reason}"
            rows.append(row)
            continue
        assert res is not None and om is not None
        pm = res.metrics[c.peer_key]
        row["peer_value"] = _rate(pm)
        row["peer_seconds"] = pm["seconds"]
        row["peer_spread"] = _spread(pm)
        row["ratio"] = row["ours"] / row["peer_value"]
        notes = [c.note] if c.note else []
        if om.get("check") is not None and pm.get("check") is not None \
                and om["check"] != pm["check"] and not c.ours_key.endswith("evict"):
            notes.append(f"CHECK MISMATCH ours {om['check']} vs {c.peer} {pm['check']}")
        if c.ours_key.endswith("evict"):
            notes.append(f"evicted {om['amount']:,} vs {pm['amount']:,} tok")
        hash_only = our["metrics"].get(c.ours_key.rsplit("/", 1)[0] + "/hash-only")
        if c.ours_key.endswith("+hash") and hash_only is not None:
            notes.append(f"page_keys alone {_rate(hash_only):.3g} Mtok/s")
        for side, m in (("ours", om), (c.peer, pm)):
            if m.get("verified") is False:
                notes.append(f"{side}: DATA MISMATCH")
        row["verified"] = (None if om.get("verified") is None and pm.get("verified") is None
                           else bool(om.get("verified")) and bool(pm.get("verified")))
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


def run(opts: Options) -> dict[str, Any]:
    spec = make_spec(opts.seed, opts.quick, opts.repeats)
    own_tmp = opts.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="hicache-peers-")) if own_tmp else opts.workdir
    assert workdir is not None
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        workload = write_workload(spec, workdir)
        print(f"workload written to {workdir} in {time.perf_counter() - t0:.1f} s "
              f"(seed {opts.seed}, {'quick' if opts.quick else 'full'}, "
              f"{spec['repeats']} repeats)", flush=True)
        our: dict[str, Any] = {"metrics": {}, "errors": {}, "versions": {}}
        peer_runs: dict[str, PeerResult] = {}  # part -> its owner's run
        loads: dict[str, list[float]] = {}
        timings: dict[str, float] = {}
        for part in opts.parts:
            owner = PART_OWNER[part]
            loads[f"{part}:start"] = list(os.getloadavg())
            print(f"[{part}] ours ... load average {_load()}", flush=True)
            t0 = time.perf_counter()
            try:
                got = ours.measure(workload, workdir / "ours", [part])
                our["metrics"].update(got["metrics"])
                our["versions"].update(got["versions"])
            except Exception as exc:  # noqa: BLE001 - reported as "not run" rows
                our["errors"][part] = f"our side failed: {type(exc).__name__}: {exc}"
                print(f"[{part}] ours FAILED: {exc!r}", flush=True)
            timings[f"ours:{part}"] = time.perf_counter() - t0
            if owner in opts.peers:
                print(f"[{part}] {owner} ... load average {_load()}", flush=True)
                res = run_peer(owner, workload, workdir, [part], opts.venvs, opts.timeout_s)
                timings[f"{owner}:{part}"] = res.seconds
                peer_runs[part] = res
                if res.failure or res.errors:
                    print(f"[{part}] {owner}: {res.failure or res.errors}", flush=True)
            loads[f"{part}:end"] = list(os.getloadavg())
        rows = [r for r in build_rows(spec, our, peer_runs) if r["part"] in opts.parts]
        versions: dict[str, Any] = {"ours": our["versions"]}
        for part, res in peer_runs.items():
            versions.setdefault(PART_OWNER[part], {}).update(res.versions)
        return {
            "rows": rows, "spec": spec, "load_average": loads, "seconds": timings,
            "versions": versions,
            "ours_errors": our["errors"],
            "peer_failures": {p: r.failure for p, r in peer_runs.items() if r.failure},
            "peer_errors": {p: r.errors for p, r in peer_runs.items() if r.errors},
            "cpus": os.cpu_count(), "python": sys.version.split()[0],
        }
    finally:
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------- output


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="HiCache components vs peers (median rates; ratio = ours / peer, "
                        ">1 = ours faster)", show_lines=False)
    for col, justify in (("part", "left"), ("case", "left"), ("operation", "left"),
                         ("unit", "left"), ("ours", "right"), ("peer", "left"),
                         ("peer rate", "right"), ("ours/peer", "right"),
                         ("spread", "right"), ("notes", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in result["rows"]:
        if r["ratio"] is None:
            ratio, peer_value = "-", f"[yellow]{r['status']}[/yellow]"
        else:
            color = "green" if r["ratio"] >= 1 else "red"
            ratio, peer_value = f"[{color}]{r['ratio']:.2f}x[/{color}]", _fmt(r["peer_value"])
        spread = "/".join(f"{r[k]:.1f}" for k in ("ours_spread", "peer_spread") if k in r)
        table.add_row(r["part"], r["case"], r["op"], r["unit"] or "-", _fmt(r["ours"]),
                      r["peer"], peer_value, ratio, spread or "-", r["note"])
    console = Console(width=220)
    console.print(table)
    loads = result["load_average"]
    console.print("load average (1/5/15 min) per part: " + "; ".join(
        f"{k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in loads.items())
        + f" on {result['cpus']} CPUs")
    console.print("spread = slowest / fastest repeat (ours/peer); medians of "
                  f"{result['spec']['repeats']} repeats")
    console.print("versions: " + json.dumps(result["versions"]))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    colors = {"radix": "tab:blue", "file": "tab:orange", "kv": "tab:green"}
    labels = [f"{r['part']} {r['case']}: {r['op']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows, strict=True):
        if r["ratio"] is None:
            ax.text(1.0, y, "  not run", va="center", fontsize=7, color="grey")
            continue
        ax.barh(y, r["ratio"], color=colors.get(r["part"], "grey"), left=0)
        ax.text(r["ratio"], y, f" {r['ratio']:.2f}x", va="center", fontsize=7)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    if ratios:
        ax.set_xlim(min(0.5, min(ratios)) / 1.5, max(2.0, max(ratios)) * 2.0)
    ax.set_yticks(ys, labels, fontsize=7)
    ax.set_xlabel("ours / peer (rate ratio, log scale; > 1 = ours faster)")
    ax.set_title("HiCache components vs SGLang (radix, file) and LMCache (kv)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, with_plot: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "peers.json"]
    paths[0].write_text(json.dumps(result, indent=1))
    if with_plot:
        plot(result, out / "peers.png")
        paths.append(out / "peers.png")
    return paths
