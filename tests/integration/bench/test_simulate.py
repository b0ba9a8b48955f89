"""Simulator front end: cost-model calibration, the size grid, and `hicache simulate` itself."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hicache.integration.bench.simulate import CostModel, Grid, calibrate, fit_prefill, parse_sizes
from hicache.integration.bench.trace import TraceRecord, write_trace
from hicache.integration.cli.main import app


def test_fit_prefill_recovers_a_line_and_refuses_degenerate_data():
    pts = [(n, 0.01 + 2e-4 * n) for n in (100, 400, 900, 1600)]
    base, slope = fit_prefill(pts)
    assert base == pytest.approx(0.01) and slope == pytest.approx(2e-4)
    assert fit_prefill(pts[:2]) is None
    assert fit_prefill([(5, 1.0)] * 4) is None


def test_calibrate_reads_each_benchmark_and_says_so(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"requests": [
        {"prompt_tokens": p, "cached_tokens": c, "ttft": 0.005 + 1e-4 * (p - c)}
        for p, c in ((1000, 0), (1000, 500), (2000, 100), (600, 0))]}))
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps({"rows": [
        {"page_size": 32, "direction": "load", "path": "cpu-batch", "gbps": g} for g in (4, 6, 8)]
        + [{"page_size": 32, "direction": "save", "path": "cpu-batch", "gbps": 99}]}))
    l3 = tmp_path / "l3.json"
    l3.write_text(json.dumps([{"backend": "file", "ours_read_gbs": 3.0},
                              {"backend": "mooncake", "ours_read_gbs": 99.0}]))
    cost = calibrate(bench_json=bench, copy_json=copy, l3_json=l3, page_bytes=1 << 20,
                     page_size=32)
    assert cost.prefill_s_per_token == pytest.approx(1e-4)
    assert cost.l2_load_gbps == 6 and cost.l3_read_gbps == 3.0
    assert "bench.json" in cost.sources["prefill_s_per_token"]
    assert calibrate().sources["l2_load_gbps"] == "default"
    # A page from L2 costs its bytes over the L2 bandwidth, and is not prefilled.
    assert cost.ttft_s(64, 32, 1, 0) == pytest.approx(
        cost.base_s + 32 * cost.prefill_s_per_token + (1 << 20) / 6e9)


def test_grid_skips_l3_and_policies_without_an_l2():
    grid = Grid(l1_blocks=(40,), l2_pages=(0, 100), l3_pages=(None, -1),
                write_policies=("write_through", "write_back"))
    got = [(c.l2_pages, c.l3_pages, c.write_policy) for c in grid.configs()]
    assert got == [(0, None, "write_through"), (100, None, "write_through"),
                   (100, None, "write_back"), (100, -1, "write_through"), (100, -1, "write_back")]


def test_parse_sizes_names_the_option():
    assert parse_sizes("none,inf,64", "--l3-pages", allow_none=True) == (None, -1, 64)
    with pytest.raises(ValueError, match="--l2-pages: 'inf' is not a size; allowed: integers"):
        parse_sizes("inf", "--l2-pages")


def test_cli_replays_a_trace_over_a_grid(tmp_path):
    recs = []
    for turn in range(2):
        for c in range(3):
            prompt = tuple(range(c * 5000, c * 5000 + 400 + turn * 100))
            recs.append(TraceRecord(id=f"c{c}-t{turn}", arrival=turn * 3 + c, finish=turn * 3 + c + .5,
                                    output_tokens=4, prompt=prompt, prompt_tokens=len(prompt)))
    trace = write_trace(tmp_path / "t.jsonl", recs)
    out = tmp_path / "sim"
    res = CliRunner().invoke(app, ["simulate", str(trace), "--l1-blocks", "20,60",
                                   "--l2-pages", "0,100", "--l3-pages", "none",
                                   "--page-bytes", "4096", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "simulate.json").read_text())["rows"]
    assert len(rows) == 4 and (out / "simulate.png").stat().st_size > 1000
    by = {(r["l1_blocks"], r["l2_pages"]): r for r in rows}
    # 3 x 13 pages do not fit 19 L1 blocks; with 59 blocks or a 100-page L2 they do.
    assert by[(20, 0)]["hit_total"] < by[(60, 0)]["hit_total"] == by[(20, 100)]["hit_total"]
    assert by[(20, 100)]["hit_l2"] > 0
    # The oracle beside LRU at each L2 size, and the headroom between them.
    res = CliRunner().invoke(app, ["simulate", str(trace), "--l1-blocks", "20",
                                   "--l2-pages", "20", "--eviction", "lru,oracle",
                                   "--hints", "on,off", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "simulate.json").read_text())
    assert {(r["eviction"], r["hints"]) for r in result["rows"]} == {
        ("lru", "on"), ("lru", "off"), ("oracle", "on"), ("oracle", "off")}
    assert len(result["headroom"]) == 4 and "headroom at L1 20 / L2 20" in res.output
    for gap in result["headroom"]:
        assert gap["oracle_hit_total"] >= gap["lru_hit_total"]


def test_cli_rejects_bad_options(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [TraceRecord(id="a", arrival=0, output_tokens=1,
                                                           prompt=(1, 2), prompt_tokens=2)])
    res = CliRunner().invoke(app, ["simulate", str(trace), "--l2-pages", "lots"])
    assert res.exit_code == 2 and "--l2-pages: 'lots' is not a size" in res.output
    res = CliRunner().invoke(app, ["simulate", str(trace), "--policy", "lru", "--l2-pages", "8"])
    assert res.exit_code == 2 and "write_policy must be one of" in res.output
    res = CliRunner().invoke(app, ["simulate", str(trace), "--l2-pages", "8",
                                   "--eviction", "lfu"])
    assert res.exit_code == 2 and "eviction must be one of lru, tlru, oracle" in res.output
    res = CliRunner().invoke(app, ["simulate", str(trace), "--hints", "maybe"])
    assert res.exit_code == 2 and "--hints: 'maybe' is not a switch" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival": 0}\n')
    res = CliRunner().invoke(app, ["simulate", str(bad)])
    assert res.exit_code == 2 and "missing key 'output_tokens'" in res.output
    assert isinstance(CostModel().ttft_s(10, 0, 0, 0), float)


def test_page_bytes_count_each_kv_cache_groups_real_bytes():
    from hicache.integration.bench.simulate import model_page_bytes
    from hicache.integration.models.tiny_model import ensure_tiny_model

    # Gemma-3 style: five sliding-window layers and one full layer, all with KV
    # (2 KV heads x 32 dims, K and V, bf16).
    assert model_page_bytes(ensure_tiny_model("gemma3"), 32) == 6 * 2 * 2 * 32 * 2 * 32
    # Nemotron-H style (Mamba2, attention, Mamba2, MLP): one attention layer's KV,
    # and a conv + SSM state checkpoint per Mamba layer; the MLP layer has none.
    kv = 1 * 2 * 2 * 32 * 2 * 64
    conv = (8 * 32 + 2 * 16) * 3 * 2
    ssm = 8 * 32 * 16 * 4
    assert model_page_bytes(ensure_tiny_model("nemotron_h"), 64) == kv + 2 * (conv + ssm)
