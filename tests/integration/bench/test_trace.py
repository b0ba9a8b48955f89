"""Trace JSONL: round trip, both request forms, and errors that name the line and the key."""

from __future__ import annotations

import pytest

from hicache.integration.bench.trace import (
    TraceError,
    TraceRecord,
    parse_record,
    read_trace,
    write_trace,
)


def test_round_trip_both_forms_sorted_by_arrival(tmp_path):
    recs = [
        TraceRecord(id="b", arrival=2.0, output_tokens=4, prompt=(5, 6, 7), prompt_tokens=3,
                    finish=2.5, output=(1, 2, 3, 4), cache_salt="tenant",
                    hints={"retain_s": 8}, prefetch_at=1.5, prefetch_tokens=2),
        TraceRecord(id="a", arrival=1.0, output_tokens=2, page_hashes=("h1", "h2"), page_size=16,
                    prompt_tokens=40),
    ]
    path = write_trace(tmp_path / "t.jsonl", recs)
    back = read_trace(path)
    assert [r.id for r in back] == ["a", "b"]
    assert back[1] == recs[0] and back[0] == recs[1]


@pytest.mark.parametrize("line, key", [
    ('{"output_tokens": 1, "prompt": [1]}', "'arrival'"),
    ('{"arrival": 0, "prompt": [1]}', "'output_tokens'"),
    ('{"arrival": 0, "output_tokens": 1}', "'prompt'"),
    ('{"arrival": 0, "output_tokens": 1, "prompt": [1], "page_hashes": ["x"], "page_size": 2}',
     "exactly one"),
    ('{"arrival": 0, "output_tokens": 1, "prompt": [1, -2]}', "'prompt'"),
    ('{"arrival": 0, "output_tokens": 1, "page_hashes": ["x"]}', "'page_size'"),
    ('{"arrival": 0, "output_tokens": 1, "page_hashes": ["x"], "page_size": 4, '
     '"prompt_tokens": 2}', "'prompt_tokens'"),
    ('{"arrival": 3, "finish": 1, "output_tokens": 1, "prompt": [1]}', "'finish'"),
    ('{"arrival": 0, "output_tokens": 1, "prompt": [1], "output": ["a"]}', "'output'"),
    ('{"arrival": 0, "output_tokens": 1, "prompt": [1], "hicache": 8}', "'hicache'"),
    ('{"arrival": 1, "output_tokens": 1, "prompt": [1], "prefetch_at": 2}', "'prefetch_at'"),
    ('{"arrival": 1, "output_tokens": 1, "prompt": [1], "prefetch_at": 0, '
     '"prefetch_tokens": 5}', "'prefetch_tokens'"),
    ('[1, 2]', "JSON object"),
    ('{nope', "not JSON"),
])
def test_bad_lines_name_the_key(line, key):
    with pytest.raises(TraceError, match=key) as e:
        parse_record(line, "t.jsonl:7")
    assert "t.jsonl:7" in str(e.value)


def test_empty_trace_is_an_error(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "e.jsonl")
