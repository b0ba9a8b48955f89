"""The GPU end-to-end runner (integration/bench/gpu/e2e.py): its tables from known
case results, and one real run on the CPU build of vLLM (the null oracle and
HiCache with L2 + file L3, each in its own child process)."""

from __future__ import annotations

import argparse
import json

import pytest

from hicache.integration.bench.gpu import e2e
from hicache.integration.vllm.engine import note_engine_start


def _case(name, kind, mode, rows):
    return {"case": name, "kind": kind, "mode": mode, "status": "ok", "rows": rows}


def _row(branch, tokens, cached=0, ttft=0.1, history=100, conv=0):
    return {"history": history, "conv": conv, "branch": branch, "tokens": tokens,
            "cached": cached, "ttft": ttft}


def test_identity_compares_each_branch_with_the_null_branch_of_the_same_prompt():
    null = _case("null-eager", "null", "eager", [
        _row("turn1", [1, 2]), _row("floor", [3, 4], 96), _row("floor3", [5, 6], 96),
        _row("recompute", [9, 9]), _row("turn1", [7], conv=-1)])
    hicache = _case("hicache-eager", "hicache", "eager", [
        _row("turn1", [1, 2]), _row("l2", [3, 4], 96), _row("l3", [5, 7], 96),
        _row("turn1", [0], conv=-1)])  # warm-up rows are not compared
    other_mode = _case("hicache-graphs", "hicache", "graphs", [_row("l2", [3, 4], 96)])
    table = {r["case"]: r for r in e2e.identity(
        {"null-eager": null, "hicache-eager": hicache, "hicache-graphs": other_mode})}
    row = table["hicache-eager"]
    assert (row["oracle"], row["compared"], row["identical"]) == ("null-eager", 3, 2)
    assert row["mismatches"] == [{"history": 100, "conv": 0, "branch": "l3", "first_diff": 1,
                                  "cached": 96, "oracle_cached": 96}]
    assert table["hicache-graphs"]["oracle"] is None  # no null case in that mode


def test_a_repeat_is_compared_with_its_original_branch_by_branch():
    first = _case("null-graphs", "null", "graphs", [_row("turn1", [1]), _row("floor", [2])])
    again = dict(_case("null-graphs-repeat", "null", "graphs",
                       [_row("turn1", [1]), _row("floor", [3])]), repeat_of="null-graphs")
    (row,) = e2e.identity({"null-graphs": first, "null-graphs-repeat": again})
    assert (row["case"], row["oracle"], row["compared"], row["identical"]) == (
        "null-graphs-repeat", "null-graphs", 2, 1)


def test_ttft_table_takes_medians_and_ratios_to_recompute_of_the_same_mode():
    null = _case("null-eager", "null", "eager", [
        _row("recompute", [1], ttft=t, conv=c) for c, t in enumerate((0.2, 0.4, 0.3))
    ] + [_row("floor", [1], 96, ttft=0.05)])
    hicache = _case("hicache-eager", "hicache", "eager", [
        _row("l2", [1], 96, ttft=t, conv=c) for c, t in enumerate((0.1, 0.15, 0.5))])
    (row,) = e2e.ttft_table({"a": null, "b": hicache})
    assert row["recompute"]["ttft_ms"] == pytest.approx(300)
    assert row["hicache L2"]["ttft_ms"] == pytest.approx(150)
    assert row["hicache L2"]["vs_recompute"] == pytest.approx(0.5)
    assert row["floor (L1 hit)"]["cached"] == 96
    assert "vLLM offloading" not in row
    text = e2e.report({"preset": "p", "device": "d", "command": "c",
                       "cases": {"a": null, "b": hicache}, "identity": [],
                       "ttft": [row]})
    assert "150.0 (0.50x) [96]" in text


def test_failed_case_reports_its_log_tail(tmp_path):
    args = argparse.Namespace(
        device="cpu", dtype="bfloat16", block_size=32, max_model_len=1024, histories=[64],
        conversations=1, gen=2, warmup=0, host_gb=0.1, gpu_util=0.5,
        l3_dir=str(tmp_path / "l3"), switch_interval=0.0)
    result = e2e._run_child("null-eager", args, str(tmp_path / "no-such-model"), tmp_path,
                            timeout=300)
    assert result["status"].startswith("failed") and result["log_tail"]


def _cpu_fp8_kv() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.mark.engine
@pytest.mark.parametrize("kv", [
    pytest.param("", id="model-dtype"),
    # --kv-cache-dtype fp8 (1-byte KV): pages move as bytes; the oracle is the null
    # connector with the same fp8 cache whose L1 kept the history.
    pytest.param("fp8", id="fp8", marks=pytest.mark.skipif(
        not _cpu_fp8_kv(), reason="vLLM's CPU fp8 KV cache needs AVX-512 or AMX")),
])
def test_cpu_run_is_token_identical_and_reads_l2_and_l3(tmp_path, kv):
    null, hicache = ("null-fp8", "hicache-fp8") if kv else ("null-eager", "hicache-eager")
    out = tmp_path / "out"
    note_engine_start("LLM (e2e child)")
    note_engine_start("LLM (e2e child)")
    e2e.main(["run", "--preset", "test", "--device", "cpu", "--histories", "512",
              "--conversations", "1", "--warmup", "0", "--gen", "16",
              "--cases", f"{null},{hicache}", "--block-size", "32",
              "--max-model-len", "2048", "--host-gb", "0.5", "--out", str(out),
              "--l3-dir", str(tmp_path / "l3")])
    results = json.loads((out / "results.json").read_text())
    cases = results["cases"]
    assert {c["status"] for c in cases.values()} == {"ok"}, cases
    (identity,) = results["identity"]
    assert (identity["oracle"], identity["compared"], identity["identical"]) == (
        null, 3, 3), identity
    rows = {r["branch"]: r for r in cases[hicache]["rows"]}
    assert rows["turn1"]["cached"] == 0
    assert rows["l2"]["cached"] >= 512  # the whole history, from L2
    assert rows["l3"]["cached"] >= 512  # and again from L3 after L1 and L2 were emptied
    counters = cases[hicache]["hicache_counters"]
    assert counters["l3_fetched_pages"] > 0 and counters["load_errors"] == 0
    mode = "eager-fp8" if kv else "eager"
    assert cases[hicache]["mode"] == mode
    assert (out / "report.md").read_text().count(f"| {mode} | 512 |") == 1
