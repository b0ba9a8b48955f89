"""Bench workloads: seeded prompts, growth per scenario, shared prefixes, config errors."""

from __future__ import annotations

import re

import pytest

from hicache.integration.bench.workloads import SCENARIOS, WorkloadSpec


def conversation(spec: WorkloadSpec, client: int, answer_len: int = 5) -> list[list[int]]:
    """Every prompt of one client, with fake answers [turn] * answer_len."""
    prompts = [spec.first_prompt(client)]
    for turn in range(1, spec.turns):
        answer = [turn] * answer_len
        prompts.append(spec.next_prompt(client, turn, prompts[-1], answer))
    return prompts


def test_same_seed_same_prompts_and_other_seed_differs():
    for scenario in SCENARIOS:
        spec = WorkloadSpec(scenario=scenario, clients=3, turns=3, history_tokens=200,
                            shared_prefix_tokens=50, seed=5)
        again = WorkloadSpec.from_dict(spec.to_dict())
        other = WorkloadSpec.from_dict({**spec.to_dict(), "seed": 6})
        for c in range(3):
            assert conversation(spec, c) == conversation(again, c)
            assert conversation(spec, c) != conversation(other, c)


def test_token_ids_stay_in_range():
    spec = WorkloadSpec(clients=2, history_tokens=3000, token_low=100, token_high=110)
    ids = spec.first_prompt(1)
    assert len(ids) == 3000 and min(ids) >= 100 and max(ids) < 110
    assert len(set(ids)) == 10


def test_multiturn_history_grows_by_answer_and_question():
    spec = WorkloadSpec(clients=2, turns=4, history_tokens=300, shared_prefix_tokens=40,
                        question_tokens=25)
    for c in range(2):
        prompts = conversation(spec, c, answer_len=7)
        assert len(prompts[0]) == 300
        for turn in range(1, 4):
            prev = prompts[turn - 1]
            assert prompts[turn][: len(prev)] == prev
            assert prompts[turn][len(prev): len(prev) + 7] == [turn] * 7
            assert len(prompts[turn]) == len(prev) + 7 + 25
    # Questions are fresh per client and turn.
    q = [conversation(spec, c)[1][-25:] for c in range(2)]
    assert q[0] != q[1]


def test_multiturn_shares_only_the_system_prompt():
    spec = WorkloadSpec(clients=3, history_tokens=300, shared_prefix_tokens=40)
    firsts = [spec.first_prompt(c) for c in range(3)]
    assert firsts[0][:40] == firsts[1][:40] == firsts[2][:40]
    assert firsts[0][40:80] != firsts[1][40:80] != firsts[2][40:80]
    no_prefix = WorkloadSpec(clients=2, history_tokens=100)
    assert no_prefix.first_prompt(0)[:10] != no_prefix.first_prompt(1)[:10]


def test_multiturn_needs_the_answer():
    spec = WorkloadSpec()
    assert spec.needs_answer_ids
    with pytest.raises(ValueError, match="previous answer"):
        spec.next_prompt(0, 1, spec.first_prompt(0), None)
    with pytest.raises(ValueError, match="turn must be in 1..2"):
        spec.next_prompt(0, 3, [], [])
    with pytest.raises(ValueError, match="client must be in 0..3"):
        spec.first_prompt(4)


def test_shared_doc_clients_share_their_doc_and_history_does_not_grow():
    spec = WorkloadSpec(scenario="shared_doc", clients=5, turns=3, history_tokens=260,
                        shared_prefix_tokens=200, num_docs=2)
    assert not spec.needs_answer_ids
    convs = [conversation(spec, c) for c in range(5)]
    docs = {c: convs[c][0][:200] for c in range(5)}
    assert docs[0] == docs[2] == docs[4] and docs[1] == docs[3] and docs[0] != docs[1]
    for c, prompts in enumerate(convs):
        assert [len(p) for p in prompts] == [260, 260, 260]
        assert all(p[:200] == docs[c] for p in prompts)
        questions = [p[200:] for p in prompts]
        assert len({tuple(q) for q in questions}) == 3  # a fresh question every turn
    assert convs[0][0][200:] != convs[2][0][200:]  # same doc, different questions


def test_system_prompt_is_shared_and_every_message_is_fresh():
    spec = WorkloadSpec(scenario="system_prompt", clients=3, turns=2, history_tokens=150,
                        shared_prefix_tokens=100)
    prompts = [p for c in range(3) for p in conversation(spec, c)]
    assert all(len(p) == 150 and p[:100] == prompts[0][:100] for p in prompts)
    assert len({tuple(p[100:]) for p in prompts}) == 6
    # The system prompt and a shared_doc document of the same seed differ.
    doc = WorkloadSpec(scenario="shared_doc", history_tokens=150, shared_prefix_tokens=100)
    assert doc.shared_prefix(0) != spec.shared_prefix(0)


@pytest.mark.parametrize(("d", "message"), [
    ({"scenario": "x"},
     "workload key 'scenario' must be one of multiturn, shared_doc, system_prompt, agent, got 'x'"),
    ({"foo": 1}, "unknown workload key 'foo'; allowed: scenario, clients, turns"),
    ({"clients": 0}, "workload key 'clients' must be an integer >= 1, got 0"),
    ({"turns": "3"}, "workload key 'turns' must be an integer, got '3'"),
    ({"answer_tokens": True}, "workload key 'answer_tokens' must be an integer"),
    ({"think_time_s": -0.5}, "workload key 'think_time_s' must be a number of seconds >= 0"),
    ({"token_low": 50, "token_high": 50}, "workload key 'token_high' must be an integer >= 51"),
    ({"history_tokens": 100, "shared_prefix_tokens": 101},
     "workload key 'shared_prefix_tokens' must be in 0..history_tokens (100)"),
    ({"scenario": "shared_doc"},
     "workload key 'shared_prefix_tokens' (the document length) must be in 1..1023"),
    ({"scenario": "system_prompt", "history_tokens": 64, "shared_prefix_tokens": 64},
     "workload key 'shared_prefix_tokens' (the system prompt) must be in 1..63"),
    ({"seed": -1}, "workload key 'seed' must be an integer >= 0"),
])
def test_from_dict_errors_name_the_key(d, message):
    with pytest.raises(ValueError) as e:
        WorkloadSpec.from_dict(d)
    assert message in str(e.value)


def test_from_dict_accepts_every_field_and_round_trips():
    spec = WorkloadSpec.from_dict({"scenario": "shared_doc", "clients": 2, "turns": 1,
                                   "history_tokens": 64, "shared_prefix_tokens": 32,
                                   "num_docs": 2, "think_time_s": 1, "seed": 9})
    assert spec.think_time_s == 1.0 and spec.total_requests == 2
    assert WorkloadSpec.from_dict(spec.to_dict()) == spec


def test_agent_sessions_grow_like_multiturn_with_seeded_tool_pauses():
    spec = WorkloadSpec(scenario="agent", clients=3, turns=3, history_tokens=64,
                        shared_prefix_tokens=16, question_tokens=8, answer_tokens=4,
                        pause_min_s=1.0, pause_max_s=5.0, retain_s=30, prefetch_lead_s=0.5)
    assert spec.needs_answer_ids
    first = spec.first_prompt(1)
    nxt = spec.next_prompt(1, 1, first, [7, 7, 7, 7])
    assert nxt[: len(first) + 4] == first + [7, 7, 7, 7] and len(nxt) == 64 + 4 + 8
    pauses = [spec.pause_of(c, t) for c in range(3) for t in (1, 2)]
    assert all(1.0 <= p <= 5.0 for p in pauses) and len(set(pauses)) == 6
    assert pauses == [WorkloadSpec.from_dict(spec.to_dict()).pause_of(c, t)
                      for c in range(3) for t in (1, 2)]  # seeded: the same every time
    assert spec.pause_of(0, 0) == 0.0


@pytest.mark.parametrize(("d", "message"), [
    ({"scenario": "multiturn", "retain_s": 5}, "apply to scenario agent only"),
    ({"scenario": "agent", "pause_min_s": 3, "pause_max_s": 1}, "'pause_max_s' (1.0) must be"),
    ({"scenario": "agent", "prefetch_lead_s": -1}, "'prefetch_lead_s' must be a number"),
    ({"scenario": "agent", "retain_s": "long"}, "'retain_s' must be a number of seconds"),
])
def test_agent_keys_are_checked(d, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        WorkloadSpec.from_dict(d)
