"""Public trace formats read as simulator records (integration/bench/trace_formats.py), on
small traces each test writes itself (the real ones stay in ../shared/traces)."""

from __future__ import annotations

import gzip
import json
import math

import pytest
from typer.testing import CliRunner

from hicache.integration.bench.trace import TraceError
from hicache.integration.bench.trace_formats import load_trace
from hicache.integration.cli.main import app


def write_mooncake(path):
    rows = [
        {"timestamp": 2000, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1024, "output_length": 8, "hash_ids": [0, 7]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def session(sid, turns, sub=None):
    """A compact claude-code session: each turn keeps the previous ids and adds two."""
    requests, prev = [], []
    for i in range(turns):
        ids = prev + [10 * i + 1, 10 * i + 2]
        requests.append({"t": 20.0 * i, "in": 64 * len(ids) + 10, "out": 100,
                         "think_time": 5.0 * i, "keep": len(prev), "add": ids[len(prev):]})
        prev = ids
    if sub is not None:
        requests.append({"t": 7.5, "type": "subagent", "agent_id": "a1", "requests": sub})
    return {"id": sid, "block_size": 64, "requests": requests}


def write_claude_code(path, sessions):
    with gzip.open(path, "wt") as f:
        for s in sessions:
            f.write(json.dumps(s) + "\n")
    return path


def test_mooncake_blocks_become_chained_pages_in_arrival_order(tmp_path):
    recs = load_trace(write_mooncake(tmp_path / "m.jsonl"), "mooncake", page_size=16)
    assert [r.arrival for r in recs] == [0.5, 2.0]
    short, long = recs
    # Full blocks only: 1024 // 512 = 2, 1100 // 512 = 2; the shared id 0 is one page.
    assert len(short.page_hashes) == len(long.page_hashes) == 2
    assert short.page_hashes[0] == long.page_hashes[0]
    assert short.page_hashes[1] != long.page_hashes[1]
    assert long.prompt_tokens == math.ceil(1100 * 16 / 512) and long.output_tokens == 2


def test_claude_code_sessions_decode_and_never_share_across_sessions(tmp_path):
    sub = session("ignored", 2)["requests"]
    path = write_claude_code(tmp_path / "cc.jsonl.gz",
                             [session("s0", 3, sub=sub), session("s1", 2)])
    recs = load_trace(path, "claude-code", page_size=4, session_gap_s=100, time_scale=0.5)
    by_id = {r.id: r for r in recs}
    assert [r.arrival for r in recs] == sorted(r.arrival for r in recs)
    first, second, third = by_id["s0#0"], by_id["s0#1"], by_id["s0#2"]
    assert third.page_hashes[:4] == second.page_hashes and second.page_hashes[:2] == \
        first.page_hashes
    assert by_id["s1#0"].arrival == 100 and by_id["s1#1"].arrival == 110
    # Same local ids in another session (and in the sub-agent): other pages.
    assert not set(by_id["s1#0"].page_hashes) & set(first.page_hashes)
    agent = [r for r in recs if r.id.startswith("s0/a1")]
    assert [r.arrival for r in agent] == [7.5 * 0.5, 7.5 * 0.5 + 10]
    assert not set(agent[0].page_hashes) & set(first.page_hashes)
    assert third.extra["think_time"] == 10.0 and third.prompt_tokens == (6 * 64 + 10) * 4 // 64 + 1
    assert len(load_trace(path, "claude-code", limit=1)) == 3 + 2  # its sub-agent too


@pytest.mark.parametrize(("line", "message"), [
    ('{"id": "s", "block_size": 64}', "'requests'"),
    ('{"id": "s", "block_size": 64, "requests": [{"t": 0, "in": 5, "out": 1, "keep": 0}]}',
     "'add'"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_bad_line_names_the_key(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=message):
        load_trace(path, "claude-code")
    with pytest.raises(ValueError, match="allowed values"):
        load_trace(path, "sharegpt")


def test_simulate_reads_a_claude_code_trace(tmp_path):
    path = write_claude_code(tmp_path / "cc.jsonl.gz", [session(f"s{i}", 4) for i in range(3)])
    result = CliRunner().invoke(app, [
        "simulate", str(path), "--format", "claude-code", "--page-size", "4",
        "--block-size", "4", "--l1-blocks", "64", "--l2-pages", "0,64",
        "--eviction", "lru,tlru", "--target-hit-rate", "0.5",
        "--out", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "out" / "simulate.json").read_text())
    rows = got["rows"]
    assert [r["requests"] for r in rows] == [12, 12, 12]
    assert [r["eviction"] for r in rows] == ["-", "lru", "tlru"]
    # Each returning turn finds its last turn's pages (0, 2, 4, 6 pages of 4 tokens) of
    # prompts of 9, 17, 25 and 33 tokens: 48 of 84 prompt tokens per session.
    assert rows[1]["hit_total"] == pytest.approx(48 / 84, abs=1e-3) == rows[2]["hit_total"]
    assert [s["eviction"] for s in got["smallest_sizes"]] == ["-", "lru", "tlru"]
    assert "smallest reaching 50% cached, - / - / hints -: L1 64 / L2 0" in result.output


def test_smallest_sizes_reaching_a_target():
    from hicache.integration.bench.simulate import smallest_sizes

    def row(l1, l2, l3, hit, eviction="lru"):
        return {"l1_blocks": l1, "l2_pages": l2, "l3_pages": l3, "hit_total": hit,
                "write_policy": "write_through", "eviction": eviction, "hints": "on"}

    rows = [row(80, 512, "none", 0.91), row(80, 128, "inf", 0.95), row(80, 128, 1000, 0.90),
            row(80, 128, "none", 0.6), row(160, 64, "none", 0.99),
            row(80, 128, "none", 0.5, "oracle")]
    lru, oracle = smallest_sizes(rows, 0.9)
    assert (lru["l1_blocks"], lru["l2_pages"], lru["l3_pages"]) == (80, 128, 1000)
    assert oracle["l2_pages"] is None and oracle["hit_total"] is None
