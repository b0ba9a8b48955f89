"""Bench report: statistics on hand-built records, JSON round trip, plots, table."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from hicache.integration.bench.client import BenchResult, RequestRecord, tier_deltas
from hicache.integration.bench.report import format_table, summarize, write_plots
from hicache.integration.bench.workloads import WorkloadSpec


def records(cached: bool = True) -> list[RequestRecord]:
    """10 completed requests (TTFT 0.1 .. 1.0 s) over 2 turns, plus one failed request."""
    out = []
    for i in range(10):
        turn = i % 2
        out.append(RequestRecord(
            id=f"c{i // 2}-t{turn}", client=i // 2, turn=turn, arrival=0.1 * i,
            first_token=0.1 * i + 0.1 * (i + 1), finish=0.1 * i + 2.0, prompt_tokens=100,
            cached_tokens=(50 * turn if cached else None), output_tokens=4,
            ttft=0.1 * (i + 1), itl=[0.01, 0.02, 0.03], prompt_ids=list(range(100)),
        ))
    out.append(RequestRecord(id="c5-t0", client=5, turn=0, arrival=0.0, finish=0.5,
                             prompt_tokens=100, error="HTTP 400: too long"))
    return out


def test_summarize_known_values():
    s = summarize(records(), duration_s=2.0)
    assert s["n_requests"] == 11 and s["n_errors"] == 1
    assert s["ttft_ms"] == {"p50": 550.0, "p90": 910.0, "p99": 991.0, "mean": 550.0}
    assert s["itl_ms"] == {"p50": 20.0, "p90": 30.0, "p99": 30.0}
    assert s["request_throughput"] == 5.0          # 10 completed / 2 s
    assert s["output_throughput"] == 20.0          # 40 tokens / 2 s
    assert s["total_token_throughput"] == 520.0    # (1000 + 40) / 2 s
    assert s["prompt_tokens"] == 1000 and s["output_tokens"] == 40
    assert s["cached_tokens"] == 250 and s["cached_share"] == 0.25
    assert s["per_turn"] == [
        {"turn": 0, "n": 5, "ttft_ms_p50": 500.0, "cached_share": 0.0},  # TTFTs .1 .3 .5 .7 .9
        {"turn": 1, "n": 5, "ttft_ms_p50": 600.0, "cached_share": 0.5},
    ]
    json.dumps(s, allow_nan=False)


def test_cached_share_is_none_when_the_server_does_not_report_it():
    s = summarize(records(cached=False), duration_s=2.0)
    assert s["cached_tokens"] is None and s["cached_share"] is None
    assert all(t["cached_share"] is None for t in s["per_turn"])


def test_summarize_of_nothing_has_no_nans():
    s = summarize([], duration_s=0.0)
    assert s["ttft_ms"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert s["itl_ms"]["p99"] is None and s["request_throughput"] is None
    assert s["per_turn"] == [] and s["cached_share"] is None
    json.dumps(s, allow_nan=False)
    only_errors = summarize(records()[-1:], duration_s=1.0)
    assert only_errors["n_errors"] == 1 and only_errors["request_throughput"] == 0.0
    json.dumps(only_errors, allow_nan=False)


def result(name: str = "http://x", cached: bool = True) -> BenchResult:
    rs = records(cached)
    return BenchResult(spec=WorkloadSpec(clients=6, turns=2), base_url=name, model="m",
                       requests=rs, duration_s=2.0, summary=summarize(rs, 2.0),
                       tiers={"page_size": 32, "prompt_tokens": 1000,
                              "l1": {"hits": 1, "hit_tokens": 32, "hit_rate": 0.032}})


def test_json_round_trip(tmp_path):
    r = result()
    path = r.to_json(tmp_path / "sub" / "result.json")
    d = json.loads(path.read_text())
    assert "prompt_ids" not in d["requests"][0] and d["requests"][0]["itl"] == [0.01, 0.02, 0.03]
    back = BenchResult.from_json(path)
    assert back.to_dict() == r.to_dict()
    assert back.spec == r.spec and back.requests == r.requests


def test_tier_deltas():
    before = {"tiers": {"l1": {"hits": 5}, "l2": {"hits": 1, "misses": 2, "used_pages": 9}}}
    after = {"tiers": {"l1": {"hits": 15}, "l2": {"hits": 4, "misses": 12, "used_pages": 3}}}
    t = tier_deltas(before, after, 32, 1000)
    assert t == {"page_size": 32, "prompt_tokens": 1000,
                 "l1": {"hits": 10, "hit_tokens": 320, "hit_rate": 0.32},
                 "l2": {"hits": 3, "misses": 10, "hit_tokens": 96, "hit_rate": 0.096}}
    unknown = tier_deltas(before, after, None, 1000)
    assert unknown["l2"] == {"hits": 3, "misses": 10, "hit_tokens": None, "hit_rate": None}


@pytest.mark.parametrize("systems", [1, 3])
def test_plots_are_non_empty_pngs(tmp_path, systems):
    results = {"vllm": result()}
    if systems > 1:
        results["hicache (from JSON)"] = json.loads(json.dumps(result().to_dict()))
        results["no details"] = result(cached=False)
    paths = write_plots(results, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["cached_share_per_turn.png", "throughput.png",
                                             "ttft_cdf.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_format_table_lists_every_system():
    console = Console(width=200, record=True)
    console.print(format_table({"a": result(), "b": result(cached=False).to_dict()}))
    text = console.export_text()
    assert "550.00" in text and "25.0" in text and text.count("\n") >= 5
