"""``hicache bench replay``'s trace reading, without a server: Mooncake lines become
token prompts that share exactly what the trace says they share; what a model cannot
take is skipped and counted; bad lines are errors that name the line and the keys.
(The replay against a real server: tests/integration/bench/test_client.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.integration.bench.replay import (
    ReplaySpec,
    ideal_cached_share,
    load_mooncake,
    load_trace,
)


def line(ts: int, ids: list[int], input_length: int, output_length: int = 5) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_length,
                       "output_length": output_length, "hash_ids": ids})


def test_equal_hash_ids_become_equal_token_runs_and_lengths_scale():
    spec = ReplaySpec(block_tokens=8, max_model_len=64, requests=10, token_high=50)
    trace = load_mooncake([
        line(1000, [7, 8], 1024),          # two whole blocks: 16 tokens
        line(1500, [7, 8, 9], 1100),       # 3rd block partial: ceil(1100 / 64) = 18
        line(2500, [3], 100, output_length=40),
    ], spec)
    a, b, c = trace.requests
    assert (len(a.prompt), len(b.prompt), len(c.prompt)) == (16, 18, 2)
    assert b.prompt[:16] == a.prompt  # shared blocks, shared tokens
    assert c.prompt != a.prompt[:2]   # another id, other tokens
    assert all(10 <= t < 50 for t in a.prompt + b.prompt)
    assert [r.at_s for r in trace.requests] == [0.0, 0.5, 1.5]
    assert [r.output_tokens for r in trace.requests] == [5, 5, 16]  # capped at 16
    again = load_mooncake([line(0, [7, 8], 1024)], spec).requests[0]
    assert again.prompt == a.prompt  # seeded: same ids, same tokens, every run
    other_seed = load_mooncake([line(0, [7, 8], 1024)], ReplaySpec(
        block_tokens=8, token_high=50, seed=1)).requests[0]
    assert other_seed.prompt != a.prompt


def test_requests_the_model_cannot_take_are_skipped_and_counted():
    spec = ReplaySpec(block_tokens=8, max_model_len=20, requests=2, output_tokens=1)
    trace = load_mooncake([line(0, [1, 2, 3], 1536),  # 24 tokens + 1 > 20: skipped
                           line(1, [1], 512), line(2, [2], 512), line(3, [3], 512)], spec)
    assert len(trace.requests) == 2 and trace.skipped_too_long == 1
    assert trace.lines_read == 3  # stops once it has what it was asked for
    assert [r.line for r in trace.requests] == [2, 3]
    assert all(r.output_tokens == 1 for r in trace.requests)


@pytest.mark.parametrize(("text", "named"), [
    ("not json", "line 1"),
    (json.dumps({"timestamp": 0, "hash_ids": [1]}), "input_length"),
    (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}),
     "hash_ids"),
])
def test_a_bad_line_is_an_error_naming_the_line_and_the_keys(text, named):
    with pytest.raises(ValueError, match=named):
        load_mooncake([text], ReplaySpec())


def test_unknown_format_and_bad_settings_name_the_allowed_values(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    path.write_text(line(0, [1], 512) + "\n")
    with pytest.raises(ValueError, match="allowed: mooncake"):
        load_trace(path, "sharegpt", ReplaySpec())
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        ReplaySpec(block_tokens=0)
    with pytest.raises(ValueError, match="token_low/token_high"):
        ReplaySpec(token_low=10, token_high=10)


def test_ideal_cached_share_counts_full_pages_seen_before():
    spec = ReplaySpec(block_tokens=8, max_model_len=64)
    trace = load_mooncake([line(0, [1, 2], 1024), line(1, [1, 2, 3], 1536)], spec)
    # Second prompt: its first 16 tokens were seen (2 pages of 8), of 16 + 24 in all.
    assert ideal_cached_share(trace.requests, 8) == pytest.approx(16 / 40)
