"""``hicache profile summary|plot`` on profiles written here, record by record: per-step
means, per-request latencies from the joined halves, ratios to the baseline, the
plot, and bad files named by line. (Real engines' profiles: tests/connector/
test_engine_admission.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hicache.integration.bench.profile_report import load, requests, summarize
from hicache.integration.cli.main import app


def write(path: Path, forward_s: float, hook_s: float, gc_s: float | None = None) -> Path:
    """Two steps: request r arrives at 10.0, is admitted in step 1 (built at 10.5) and
    gets its first token at the end of step 2's worker step (11.3). ``gc_s``: each
    half's second record carries that much garbage collection and one full
    collection, its first (the engine's start) 9 s and one more (None: records
    written before ``gc``)."""
    recs = [
        {"role": "scheduler", "connector": "C", "pid": 1, "seq": 1, "t0": 10.0, "t1": 10.5,
         "hooks": {"build_connector_meta": [1, hook_s]}, "deferred": 0,
         "scheduled": {"requests": 1, "tokens": 64}, "batch": {"r": 64},
         "admitted": [{"id": "r", "arrival": 10.0, "prompt": 100, "local": 0,
                       "external": 0}], "first_token": []},
        {"role": "worker", "connector": "C", "pid": 2, "seq": 1, "t0": 10.5, "t1": 10.9,
         "forward_s": forward_s, "hooks": {"wait_for_save": [1, hook_s]},
         "cpu": {"thread": 0.3, "hicache_threads": 0.0, "process": 0.3, "thread_waited": 0},
         "cpu_between": {"hicache_threads": 0.0}},
        {"role": "scheduler", "connector": "C", "pid": 1, "seq": 2, "t0": 10.5, "t1": 10.95,
         "hooks": {}, "deferred": 1, "scheduled": {"requests": 1, "tokens": 36},
         "batch": {"r": 36}, "admitted": [], "first_token": ["r"]},
        {"role": "worker", "connector": "C", "pid": 2, "seq": 2, "t0": 11.0, "t1": 11.3,
         "forward_s": forward_s, "hooks": {},
         "cpu": {"thread": 0.2, "hicache_threads": 0.01, "process": 0.21, "thread_waited": 0,
                 "hicache_by_thread": {"hicache-l3": 0.008, "hicache-copy": 0.002}},
         "cpu_between": {"hicache_threads": 0.002, "hicache_by_thread": {"hicache-l3": 0.002}}},
    ]
    if gc_s is not None:
        for rec in recs:
            rec["gc"] = {"s": gc_s if rec["seq"] == 2 else 9.0, "collections": [2, 0, 1]}
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_summary_joins_the_halves_and_compares_with_the_baseline(tmp_path):
    base = write(tmp_path / "null.profile.jsonl", 0.2, 0.0)
    mine = write(tmp_path / "hicache.profile.jsonl", 0.3, 0.01)
    prof = load(mine)
    assert prof.name == "hicache"
    (req,) = requests(prof)
    assert req["queued"] == pytest.approx(0.5) and req["ttft"] == pytest.approx(1.3)
    s = summarize(prof)
    assert s["worker_steps"] == 2 and s["forward_ms"] == pytest.approx(300)
    assert s["gap_ms"] == pytest.approx(100) and s["deferred_per_step"] == 0.5
    assert s["helper_cpu_ms"] == pytest.approx(5)  # (0 + 10 ms) / 2 steps
    # Per thread family, in the step and between (the first record has no breakdown).
    assert s["helper_cpu_by_thread_ms"] == {"hicache-copy": [pytest.approx(1), 0.0],
                                            "hicache-l3": [pytest.approx(4), pytest.approx(1)]}
    done = CliRunner().invoke(app, ["profile", "summary", str(base), str(mine)])
    assert done.exit_code == 0, done.output
    assert "| forward ms | 200.00 | 300.00 | 1.50 |" in done.output
    assert "| hicache-l3 CPU ms (in step) | 4.000 | 4.000 | 1.00 |" in done.output
    png = tmp_path / "p.png"
    done = CliRunner().invoke(app, ["profile", "plot", str(base), str(mine), "--out", str(png),
                                    "--names", "null,hicache"])
    assert done.exit_code == 0, done.output
    assert png.stat().st_size > 5000


def test_a_file_two_servers_appended_to_reads_as_the_last_one(tmp_path, caplog):
    old = write(tmp_path / "old.profile.jsonl", 0.2, 0.0)
    new = write(tmp_path / "new.profile.jsonl", 0.3, 0.01)
    renumbered = [json.loads(line) for line in new.read_text().splitlines()]
    for rec in renumbered:  # the second server's processes have other pids
        rec["pid"] += 100
    both = tmp_path / "both.profile.jsonl"
    both.write_text(old.read_text() + "".join(json.dumps(r) + "\n" for r in renumbered))
    with caplog.at_level("WARNING"):
        prof = load(both)
    assert "holds the records of 2 servers" in caplog.text
    assert {r["pid"] for r in prof.scheduler + prof.worker} == {101, 102}
    assert summarize(prof)["forward_ms"] == pytest.approx(300)
    assert len(requests(prof)) == 1


def test_garbage_collection_per_step_and_full_collections(tmp_path):
    old = summarize(load(write(tmp_path / "old.profile.jsonl", 0.2, 0.0)))
    assert old["scheduler_gc_ms"] is None and old["full_collections"] is None
    base = write(tmp_path / "null.profile.jsonl", 0.2, 0.0, gc_s=0.004)
    mine = write(tmp_path / "hicache.profile.jsonl", 0.2, 0.0, gc_s=0.06)
    s = summarize(load(mine))
    # The second record of each half only: the first covers the engine's start.
    assert s["scheduler_gc_ms"] == pytest.approx(60)
    assert s["worker_gc_ms"] == pytest.approx(60) and s["full_collections"] == 2
    done = CliRunner().invoke(app, ["profile", "summary", str(base), str(mine)])
    assert done.exit_code == 0, done.output
    assert "| GC ms, engine core | 4.000 | 60.000 | 15.00 |" in done.output
    assert "| full GC collections (both) | 2 | 2 | 1.00 |" in done.output


def test_a_file_that_is_not_a_profile_is_an_error_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "scheduler"}\n{"role": "planner"}\n')
    done = CliRunner().invoke(app, ["profile", "summary", str(bad)])
    assert done.exit_code == 2 and "bad.jsonl:2" in done.output
    done = CliRunner().invoke(app, ["profile", "summary", str(bad), str(bad), "--names", "a"])
    assert done.exit_code == 2 and "--names" in done.output
