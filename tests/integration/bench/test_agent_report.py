"""agent_report: returning-turn TTFT quantiles per system and run, pooled, as ratios to
the first system, and the CDF plot, from bench compare's run directories."""

import json

from hicache.integration.bench.agent_report import report


def _run(d, times: dict[str, list[float]]) -> None:
    d.mkdir()
    rows = [{"system": name, "status": "ok"} for name in times]
    rows.append({"system": "absent", "status": "not run"})
    (d / "compare.json").write_text(json.dumps({"rows": rows}))
    for name, ttfts in times.items():
        reqs = [{"turn": 0, "ttft": 9.0}]  # first turns are not returning turns
        reqs += [{"turn": 1, "ttft": t} for t in ttfts]
        reqs.append({"turn": 2, "ttft": 5.0, "error": "timeout"})  # failed: left out
        (d / f"{name}.json").write_text(json.dumps({"requests": reqs}))


def test_quantiles_per_run_pooled_and_ratios(tmp_path):
    _run(tmp_path / "r1", {"lru": [0.1, 0.2, 0.3, 0.4], "sessions": [0.05, 0.1, 0.1, 0.2]})
    _run(tmp_path / "r2", {"lru": [0.2, 0.2, 0.2, 0.6], "sessions": [0.1, 0.1, 0.1, 0.1]})
    plot = tmp_path / "cdf.png"
    got = report([tmp_path / "r1", tmp_path / "r2"], plot)
    assert list(got) == ["lru", "sessions"]
    assert got["lru"]["runs"][0] == {"p50_ms": 300.0, "p99_ms": 400.0, "n": 4}
    assert got["lru"]["pooled"] == {"p50_ms": 200.0, "p99_ms": 600.0, "n": 8}
    assert got["sessions"]["pooled"] == {"p50_ms": 100.0, "p99_ms": 200.0, "n": 8}
    assert got["sessions"]["ratio_to_first"] == {"p50_ms": 0.5, "p99_ms": 0.333}
    assert plot.stat().st_size > 0
