"""The serving-under-load runner (integration/bench/gpu/serve_load.py): workloads, L1
sizing, the closed-loop client, the tables, and one real run on the CPU build of vLLM
(two engines started side by side behind their gates, measured one at a time)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from hicache.integration.bench.gpu import serve_load
from hicache.integration.vllm.engine import note_engine_start


def _args(**kw):
    p = argparse.ArgumentParser()
    serve_load._add_shared(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_prefix_jobs_share_each_prefix_and_differ_in_their_suffix():
    args = _args(num_prefixes=3, prefix_len=40, suffix_len=5, num_prompts=12)
    jobs = serve_load.PrefixJobs(args, vocab=1000)
    sent = [jobs.next_ready() for _ in range(12)]
    assert jobs.next_ready() is None and jobs.done()
    by_prefix: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for job in sent:
        assert len(job.prompt) == 45
        by_prefix.setdefault(tuple(job.prompt[:40]), []).append(tuple(job.prompt[40:]))
    assert sorted(len(v) for v in by_prefix.values()) == [4, 4, 4]
    assert len({s for v in by_prefix.values() for s in v}) == 12
    # Shuffled, and the same shuffle for the same seed.
    again = serve_load.PrefixJobs(args, vocab=1000)
    assert [j.rid for j in sent] == [again.next_ready().rid for _ in range(12)]
    assert [j.rid for j in sent] != sorted(j.rid for j in sent)


def test_multiturn_jobs_go_in_rounds_and_wait_for_their_answer():
    args = _args(conversations=2, turns=3, first_len=10, turn_len=4)
    jobs = serve_load.MultiTurnJobs(args, vocab=1000)
    a, b = jobs.next_ready(), jobs.next_ready()
    assert (a.conv, a.turn, b.conv, b.turn) == (0, 0, 1, 0)
    assert jobs.next_ready() is None  # both conversations wait for their answers
    jobs.finished(b, [7, 8])
    b2 = jobs.next_ready()
    assert (b2.conv, b2.turn) == (1, 1)
    # The whole history comes back: first turn, its answer, then new tokens.
    assert b2.prompt[:12] == b.prompt + [7, 8] and len(b2.prompt) == 16
    jobs.finished(a, [9])
    a2 = jobs.next_ready()
    assert (a2.conv, a2.turn) == (0, 1) and a2.prompt[:11] == a.prompt + [9]
    for job in (a2, b2):
        jobs.finished(job, [1])
    # Rounds: conversation 0 is behind (same turn, lower id) and goes first.
    assert [(j.conv, j.turn) for j in (jobs.next_ready(), jobs.next_ready())] == [(0, 2), (1, 2)]
    assert not jobs.done()


class ScriptedEngine:
    """A stand-in for vLLM's LLMEngine that answers each request after ``steps``
    steps, to check the client's own bookkeeping (how many requests it keeps in
    flight), which a real engine does not expose. The real engine runs in
    test_cpu_run_serves_every_request_with_both_engines_started_together."""

    def __init__(self, steps: int = 2, out_len: int = 3) -> None:
        self.steps, self.out_len = steps, out_len
        self.live: dict[str, int] = {}
        self.max_live = 0

    def add_request(self, rid, prompt, params):
        self.live[rid] = 0
        self.max_live = max(self.max_live, len(self.live))
        return f"{rid}-internal"  # vLLM may rename; outputs carry either id

    def step(self):
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.steps
            outs.append(SimpleNamespace(
                request_id=rid if done else f"{rid}-internal", finished=done,
                outputs=[SimpleNamespace(token_ids=[5] * (self.out_len if done else 0))],
                num_cached_tokens=4, metrics=SimpleNamespace(first_token_latency=0.01)))
            if done:
                del self.live[rid]
        return outs


@pytest.mark.parametrize("workload", ["prefix", "multiturn"])
def test_the_client_keeps_at_most_concurrency_requests_in_flight(workload):
    args = _args(num_prefixes=2, prefix_len=8, suffix_len=2, num_prompts=10, conversations=3,
                 turns=3, first_len=6, turn_len=2)
    engine = ScriptedEngine()
    jobs = serve_load.make_jobs(workload, args, vocab=100)
    result = serve_load.drive(engine, jobs, concurrency=2, params=None)
    assert engine.max_live == 2
    assert result["completed"] == jobs.total and jobs.done()
    assert result["ttft_measured"] == jobs.total and result["cached_tokens"] == 4 * jobs.total


def test_l1_sizes_hold_the_workload_and_a_fifth_of_the_prefixes():
    args = _args(num_prefixes=40, prefix_len=8192, num_prompts=320, block_size=16)
    large, small = serve_load.l1_blocks(args)
    tokens = serve_load.workload_tokens(args)
    assert large * 16 >= 1.25 * max(tokens.values())
    assert small == 40 * 8192 // 5 // 16
    # Never below what vLLM needs for one sequence of max_model_len (and two of the
    # longest requests).
    tiny = _args(num_prefixes=1, prefix_len=512, suffix_len=32, output_len=8, block_size=32,
                 first_len=256, turns=2, turn_len=32)
    _, small = serve_load.l1_blocks(tiny)
    assert small * 32 >= serve_load.max_model_len(tiny) and small >= 2 * (552 // 32)


def test_tables_compare_with_null_of_the_same_l1_and_with_the_floor():
    def case(name, small, rps, p99):
        w = {"req_per_s": rps, "ttft_p50_ms": p99 / 2, "ttft_p99_ms": p99, "cached_tokens": 1,
             "prompt_tokens": 2}
        return {"case": name, "status": "ok", "small_l1": small, "l1_blocks": 9,
                "workloads": {"prefix": w}}
    cases = {"null": case("null", False, 10.0, 100.0), "hicache": case("hicache", False, 9.0, 110.0),
             "null-small": case("null-small", True, 2.0, 400.0),
             "hicache-small": case("hicache-small", True, 5.0, 200.0),
             "offload": {"case": "offload", "status": "failed rc=1", "small_l1": False}}
    rows = {r["case"]: r for r in serve_load.ratios(cases) if "req_per_s" in r}
    assert rows["hicache"]["x_null"]["req_per_s"] == pytest.approx(0.9)
    assert rows["hicache-small"]["x_null"]["ttft_p99_ms"] == pytest.approx(0.5)
    assert rows["hicache-small"]["x_floor"]["req_per_s"] == pytest.approx(0.5)
    text = serve_load.report({"preset": "p", "device": "d", "command": "c", "l1_blocks": 9,
                              "small_l1_blocks": 3, "workload_tokens": {},
                              "cases": cases, "table": serve_load.ratios(cases)})
    assert "| prefix | hicache-small | 9 | 5.00 | 2.500 |" in text
    assert "| - | offload | failed rc=1 |" in text


def test_waves_group_cases_of_one_l1_size_only_when_parallel():
    names = ["null", "hicache-small", "hicache", "null-small"]
    assert list(serve_load.waves(names, parallel=True)) == [["null", "hicache"],
                                                            ["hicache-small", "null-small"]]
    assert list(serve_load.waves(names, parallel=False)) == [[n] for n in names]


@pytest.mark.engine
def test_cpu_run_serves_every_request_with_both_engines_started_together(tmp_path):
    out = tmp_path / "out"
    note_engine_start("LLM (serve_load child)")
    note_engine_start("LLM (serve_load child)")
    serve_load.main(["run", "--preset", "test", "--device", "cpu", "--cases", "null,hicache",
                     "--parallel", "--workloads", "multiturn", "--block-size", "32",
                     "--max-num-batched-tokens", "2048", "--concurrency", "3",
                     "--conversations", "4", "--turns", "2", "--first-len", "256",
                     "--turn-len", "32", "--output-len", "8", "--num-prefixes", "2",
                     "--prefix-len", "256", "--host-gb", "0.2", "--warmup", "64",
                     "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    cases = results["cases"]
    assert {c["status"] for c in cases.values()} == {"ok"}, cases
    for case in cases.values():
        w = case["workloads"]["multiturn"]
        assert w["completed"] == 8 and w["ttft_measured"] == 8
    # Second turns find their history: vLLM's L1 holds it (large L1) in both engines.
    assert cases["hicache"]["workloads"]["multiturn"]["cached_tokens"] >= 4 * 256
    rows = {r["case"]: r for r in results["table"]}
    assert rows["null"]["x_null"]["req_per_s"] == pytest.approx(1.0)
    assert "x_null" in rows["hicache"]
    assert (out / "report.md").exists() and (out / "serve_load.png").exists()
