"""``hicache bench replay --format claude-code``'s trace reading, without a server:
compact Claude Code sessions become turns whose prompts share exactly what the
trace's ``keep`` says, sub-agents run inline with chains of their own, sessions
never share tokens, what a model cannot take is skipped and counted, and bad
lines are errors naming the line and the key. (The replay against a real server:
tests/integration/bench/test_client.py.)"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hicache.integration.bench.session_replay import (
    AgentHints,
    SessionSpec,
    load_claude_code,
    load_claude_code_file,
)


def req(t: float, n_in: int, keep: int, add: list[int], out: int = 5,
        think: float = 0.0) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": out, "think_time": think, "keep": keep,
            "add": add}


def session(sid: str, requests: list[dict], block: int = 64) -> str:
    return json.dumps({"id": sid, "block_size": block, "requests": requests})


def lines(*texts: str) -> list[tuple[str, str]]:
    return [(f"t.jsonl:{i}", t) for i, t in enumerate(texts, 1)]


SPEC = SessionSpec(block_tokens=4, max_model_len=64, token_high=50)


def test_turns_share_what_keep_says_and_lengths_scale():
    trace = load_claude_code(lines(session("s1", [
        req(0, 3 * 64, 0, [1, 2, 3]),                  # 12 tokens
        req(9, 5 * 64 + 10, 3, [4, 5], think=7.5),     # 5 full blocks: 20 (partial dropped)
        req(20, 2 * 64, 1, [9], out=40, think=2.0),    # keeps block 1 only, then block 9
    ])), SPEC)
    (a, b, c), = trace.sessions
    assert [len(t.prompt) for t in (a, b, c)] == [12, 20, 8]
    assert b.prompt[:12] == a.prompt                 # kept blocks, same tokens
    assert c.prompt[:4] == a.prompt[:4] and c.prompt[4:] != a.prompt[4:8]
    assert all(10 <= x < 50 for t in (a, b, c) for x in t.prompt)
    assert [t.think_s for t in (a, b, c)] == [0.0, 7.5, 2.0]
    assert [t.output_tokens for t in (a, b, c)] == [5, 5, 16]  # capped at 16
    assert [t.index for t in (a, b, c)] == [0, 1, 2]
    again = load_claude_code(lines(session("s1", [req(0, 3 * 64, 0, [1, 2, 3])])), SPEC)
    assert again.sessions[0][0].prompt == a.prompt  # seeded: same ids, same tokens
    other = load_claude_code(lines(session("s2", [req(0, 3 * 64, 0, [1, 2, 3])])), SPEC)
    assert other.sessions[0][0].prompt != a.prompt  # ids are local to their session


def test_sub_agents_run_inline_with_their_own_chain():
    trace = load_claude_code(lines(session("p", [
        req(0, 2 * 64, 0, [1, 2]),
        {"t": 5, "type": "subagent", "agent_id": "x", "requests": [
            req(0, 64, 0, [7]), req(3, 2 * 64, 1, [8], think=1.0)]},
        req(9, 3 * 64, 2, [3], think=4.0),
    ])), SPEC)
    turns, = trace.sessions
    assert [len(t.prompt) for t in turns] == [8, 4, 8, 12]
    assert turns[2].prompt[:4] == turns[1].prompt      # the sub-agent's own chain
    assert turns[3].prompt[:8] == turns[0].prompt      # the parent's chain resumes
    assert [t.think_s for t in turns] == [0.0, 0.0, 1.0, 4.0]
    assert {t.session for t in turns} == {"p"} and [t.index for t in turns] == [0, 1, 2, 3]
    assert [t.chain for t in turns] == ["p", "p/x", "p/x", "p"]


def test_too_long_turns_are_skipped_and_counted_and_limits_apply(tmp_path: Path):
    texts = [session("a", [req(0, 10 * 64, 0, list(range(10))),     # 40 + 5 > 44
                           req(1, 2 * 64, 0, [1, 2])]),
             session("b", [req(0, 64, 0, [1]), req(1, 2 * 64, 1, [2]), req(2, 3 * 64, 2, [3])]),
             session("c", [req(0, 64, 0, [1])])]
    path = tmp_path / "cc.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(texts) + "\n")
    trace = load_claude_code_file(path, SessionSpec(block_tokens=4, max_model_len=44,
                                                    sessions=2, max_turns=2))
    assert trace.sessions_read == 2 and trace.skipped_too_long == 1
    assert [[len(t.prompt) for t in s] for s in trace.sessions] == [[8], [4, 8]]
    assert trace.turns == 3 and trace.prompt_tokens == 20


@pytest.mark.parametrize(("text", "named"), [
    ("not json", "t.jsonl:1: not JSON"),
    (json.dumps({"block_size": 64, "requests": []}), "'id'"),
    (session("s", [{"t": 0, "in": 64, "out": 1, "add": [1]}]), "request 0: key 'keep'"),
    (session("s", [req(0, 64, 0, [1])], block=0), "'block_size' must be >= 1"),
    (json.dumps({"id": "s", "block_size": 64, "requests": 3}), "'requests' must be a list"),
])
def test_a_bad_line_is_an_error_naming_the_line_and_the_key(text, named):
    with pytest.raises(ValueError, match=named):
        load_claude_code(lines(text), SPEC)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="max_turns must be >= 0"):
        SessionSpec(max_turns=-1)
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        SessionSpec(sessions=0)
    with pytest.raises(ValueError, match="prefetch_lead_s must be >= 0"):
        AgentHints(prefetch_lead_s=-1)
