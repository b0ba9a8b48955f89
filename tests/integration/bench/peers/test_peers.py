"""Peer benchmark runner: workload determinism, our-side numbers, "not run" rows, end to end.

No vLLM engine. Only the last test needs the peer venvs of
``integration/bench/peers/setup_venvs.sh``; it skips, saying so, when they are absent.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import numpy as np
import pytest

from hicache.integration.bench.peers import ours, runner
from hicache.integration.bench.peers.__main__ import main
from hicache.integration.bench.peers.workload import load_workload, make_spec, write_workload

RADIX_OPS = ("insert", "match", "miss", "evict", "insert+hash", "match+hash", "miss+hash")


@pytest.fixture(scope="module")
def quick_workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_workload(make_spec(seed=3, quick=True), tmp_path_factory.mktemp("wl"))


@pytest.fixture(scope="module")
def our_quick(quick_workload: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return ours.measure(quick_workload, tmp_path_factory.mktemp("ours"))


def test_workload_is_deterministic(tmp_path: Path) -> None:
    spec = make_spec(seed=11, quick=True)
    a = write_workload(spec, tmp_path / "a")
    b = write_workload(make_spec(seed=11, quick=True), tmp_path / "b")
    doc_a, arr_a = load_workload(a)
    doc_b, arr_b = load_workload(b)
    assert doc_a["digests"] == doc_b["digests"]
    assert doc_a["file_cases"] == doc_b["file_cases"]
    for name in arr_a:
        assert np.array_equal(arr_a[name], arr_b[name]), name
    other = load_workload(write_workload(make_spec(seed=12, quick=True), tmp_path / "c"))[0]
    assert all(other["digests"][k] != doc_a["digests"][k] for k in doc_a["digests"])


def test_workload_shapes_match_the_spec(quick_workload: Path) -> None:
    doc, arrays = load_workload(quick_workload)
    r, k = doc["radix"], doc["kv"]
    assert arrays["radix_hit"].shape == (r["requests"], r["prefix_len"] + r["suffix_len"])
    assert (arrays["radix_miss"][:, 0] >= 32_000).all()  # never a request's first token
    assert arrays["kv"].shape == (2, k["layers"], k["tokens"], k["kv_heads"] * k["head_dim"])
    assert arrays["kv"].dtype == np.uint16 and arrays["kv_tokens"].shape == (k["tokens"],)
    for case in doc["file_cases"]:
        assert len(case["keys"]) == case["pages"] == len(set(case["keys"]))
        assert all(len(key) == 64 for key in case["keys"])
        assert case["pages"] * case["page_bytes"] <= arrays["file_pages"].size


def test_our_side_numbers_are_sane(quick_workload: Path, our_quick: dict) -> None:
    doc, arrays = load_workload(quick_workload)
    metrics = our_quick["metrics"]
    repeats = doc["repeats"]
    for m in metrics.values():
        assert len(m["seconds"]) == repeats and all(s > 0 for s in m["seconds"])
        assert m["amount"] > 0 and m["unit"] in runner.UNITS
        rate = m["amount"] / statistics.median(m["seconds"])
        assert 0 < rate < float("inf")
    hit = np.asarray(arrays["radix_hit"])
    for p in doc["radix"]["page_sizes"]:
        # Unique page-aligned tokens: every prefix used, plus every suffix's full pages
        # (prefix and suffix lengths are page multiples in the quick spec).
        prefixes = {tuple(row[: doc["radix"]["prefix_len"]]) for row in hit}
        unique = len(prefixes) * doc["radix"]["prefix_len"] + len(hit) * doc["radix"][
            "suffix_len"]
        for op in RADIX_OPS:
            assert f"radix/p{p}/{op}" in metrics, op
        assert metrics[f"radix/p{p}/insert"]["check"] == unique
        assert metrics[f"radix/p{p}/insert+hash"]["check"] == unique
        assert metrics[f"radix/p{p}/match"]["check"] == hit.shape[0] * hit.shape[1]
        assert metrics[f"radix/p{p}/match+hash"]["check"] == hit.shape[0] * hit.shape[1]
        assert metrics[f"radix/p{p}/miss"]["check"] == 0
        assert metrics[f"radix/p{p}/evict"]["amount"] == unique // 2 // p * p
    for case in doc["file_cases"]:
        tag = f"file/{case['page_bytes'] // 1024}k"
        assert metrics[f"{tag}/get"]["verified"] is True
        assert metrics[f"{tag}/set"]["amount"] == case["pages"] * case["page_bytes"]
    for name in ("kv/l2/retrieve", "kv/l3/retrieve"):
        assert metrics[name]["verified"] is True
        assert metrics[name]["check"] == doc["kv"]["tokens"]
    assert our_quick["versions"]["copy_path"]


def test_missing_peer_venv_gives_not_run_rows(tmp_path: Path) -> None:
    """The real path: a venv directory that does not exist, no mocking."""
    missing = tmp_path / "no-such-venvs"
    opts = runner.Options(out=tmp_path / "out", quick=True, parts=("radix", "file"),
                          venvs=missing, workdir=tmp_path / "work", repeats=1)
    result = runner.run(opts)
    rows = result["rows"]
    spec = make_spec(quick=True)
    assert len(rows) == sum(1 for c in runner.comparisons(spec) if c.part in ("radix", "file"))
    for row in rows:
        assert row["status"].startswith("not run: peer venv"), row
        assert str(missing / "sglang") in row["status"]
        assert "setup_venvs.sh" in row["status"]
        assert row["ratio"] is None and row["peer_value"] is None
        assert row["ours"] is not None and row["ours"] > 0  # our side still measured
    paths = runner.write_outputs(result, opts.out)
    saved = json.loads(paths[0].read_text())
    assert [r["status"] for r in saved["rows"]] == [r["status"] for r in rows]
    assert paths[1].stat().st_size > 0
    runner.print_table(result)  # renders "not run" rows without a ratio


def test_failing_peer_and_unselected_peer(tmp_path: Path) -> None:
    """A peer python that exits non-zero, and a peer left out with --peers."""
    fake = tmp_path / "venvs" / "lmcache" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n"
                    "echo \"peer exploded on purpose, telemetry=$LMCACHE_TRACK_USAGE/$DO_NOT_TRACK\""
                    " >&2\nexit 3\n")
    fake.chmod(0o755)
    opts = runner.Options(out=tmp_path / "out", quick=True, parts=("kv", "radix"),
                          peers=("lmcache",), venvs=tmp_path / "venvs",
                          workdir=tmp_path / "work", repeats=1)
    rows = runner.run(opts)["rows"]
    kv_rows = [r for r in rows if r["part"] == "kv"]
    radix_rows = [r for r in rows if r["part"] == "radix"]
    assert kv_rows and radix_rows
    for row in kv_rows:
        assert row["status"].startswith("not run: lmcache_peer.py exited 3"), row
        assert "peer exploded on purpose" in row["status"]
        assert "telemetry=false/1" in row["status"]  # LMCache's usage reports are off
    for row in radix_rows:
        assert row["status"] == "not run: peer sglang not selected (--peers)"
        assert row["ours"] > 0


def test_cli_rejects_unknown_peer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--peers", "vllm"])
    assert "allowed" in capsys.readouterr().err


def _venvs_present() -> bool:
    return all((runner.DEFAULT_VENVS / p / "bin" / "python").exists() for p in runner.PEERS)


@pytest.mark.skipif(not _venvs_present(),
                    reason="peer venvs absent: run `bash integration/bench/peers/setup_venvs.sh` "
                           f"(builds {runner.DEFAULT_VENVS}/sglang and /lmcache)")
def test_quick_comparison_end_to_end(tmp_path: Path) -> None:
    code = main(["--quick", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "w")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "peers.json").read_text())
    assert (tmp_path / "out" / "peers.png").stat().st_size > 0
    assert result["rows"]
    for row in result["rows"]:
        assert row["status"] == "ok", row
        assert row["ratio"] > 0 and row["ours"] > 0 and row["peer_value"] > 0
        assert "MISMATCH" not in row["note"], row
        if row["op"].startswith(("get", "L2 retrieve", "L3 retrieve")):
            assert row["verified"] is True, row
    assert result["versions"]["sglang"]["torch"] == "2.13.0+cpu"
    assert result["versions"]["lmcache"]["torch"] == "2.13.0+cpu"
    assert os.path.isdir(tmp_path / "w")
