"""``hicache bench run``'s client against a real ``vllm serve`` with HiCacheConnector.

One server (80 L1 blocks of 32 tokens, L2 = 160 pages) serves four runs:

* A: 3 clients x 3 turns of a multiturn chat (600-token histories, 64-token
  system prompt, 16-token answers), with progress bar and trace;
* B: the same shape with another seed: its ~70 blocks push A out of L1;
* A again (seed of A): A's pages now come back from L2;
* failures: prompts longer than the model and a request timeout.

Peak concurrent KV of a run is 3 x 25 blocks <= 80, so vLLM never preempts
(asserted): a preempted request is counted again by the connector's tier
counters on re-admission, but vLLM reports ``cached_tokens`` from its first
admission only, so the tier/usage identity below holds only without preemption.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from support.serve import launch_serve

from hicache.integration.bench.client import BenchError, BenchResult, run_bench, run_bench_sync
from hicache.integration.bench.compare import free_port, stop_server, wait_ready
from hicache.integration.bench.report import write_plots
from hicache.integration.bench.trace import read_trace
from hicache.integration.bench.workloads import WorkloadSpec

pytestmark = pytest.mark.engine

PAGE = 32
SERVE_ARGS = ("--block-size 32 --num-gpu-blocks-override 80 --dtype float32 --enforce-eager "
              "--enable-prompt-tokens-details")
SPEC_A = WorkloadSpec(clients=3, turns=3, history_tokens=600, shared_prefix_tokens=64,
                      question_tokens=64, answer_tokens=16, seed=11)
SPEC_B = WorkloadSpec.from_dict({**SPEC_A.to_dict(), "seed": 12})
TOKEN = "bench-admin-token"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port, admin_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("bench-serve") / "serve.log"
    env = dict(os.environ, MODEL=tiny_model, MAX_MODEL_LEN="2048", PORT=str(port),
               SERVE_ARGS=SERVE_ARGS, VLLM_CPU_KVCACHE_SPACE="1",
               EXTRA_CONFIG=json.dumps({"hicache_admin_port": admin_port,
                                        "hicache_admin_token": TOKEN}))
    proc = launch_serve(env, log)
    base = f"http://127.0.0.1:{port}"
    try:
        why = wait_ready(proc, base, 240)
        if why is not None:
            pytest.fail(f"{why}:\n{log.read_text()[-3000:]}")
        yield base, f"http://127.0.0.1:{admin_port}"
    finally:
        stop_server(proc)


def preemptions(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_preemptions_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_preemptions_total missing from /metrics")


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    base, admin = server
    out = tmp_path_factory.mktemp("bench")
    results: dict[str, BenchResult] = {}
    preempted: dict[str, float] = {}
    for name, spec, kw in (("A", SPEC_A, {"trace_path": out / "trace.jsonl", "progress": True}),
                           ("B", SPEC_B, {}), ("A again", SPEC_A, {})):
        before = preemptions(base)
        results[name] = run_bench_sync(base, spec, admin_url=admin, **{"progress": False, **kw})
        preempted[name] = preemptions(base) - before
    return results, preempted, out


def test_every_request_completes_with_exact_lengths(runs, tiny_model):
    results, _, _ = runs
    for res in results.values():
        assert res.model == tiny_model  # from GET /v1/models
        assert res.summary["n_errors"] == 0 and len(res.requests) == 9
        for r in res.requests:
            assert r.error is None
            assert r.ttft is not None and r.ttft > 0 and r.finish > r.first_token > r.arrival
            assert r.output_tokens == 16 and len(r.answer_ids) == 16
            # one gap per token after the first chunk; how many tokens a chunk
            # carries depends on how busy the machine is, so only the bound is fixed
            assert len(r.itl) <= 15 and all(gap >= 0 for gap in r.itl)
            assert r.prompt_tokens == len(r.prompt_ids)


def by_id(res: BenchResult) -> dict:
    return {r.id: r for r in res.requests}


def test_multiturn_prompts_carry_the_history(runs):
    results, _, _ = runs
    for res in results.values():
        reqs = by_id(res)
        for c in range(3):
            for t in (1, 2):
                prev, cur = reqs[f"c{c}-t{t - 1}"], reqs[f"c{c}-t{t}"]
                history = prev.prompt_ids + prev.answer_ids
                assert cur.prompt_ids[: len(history)] == history
                assert len(cur.prompt_ids) == len(history) + 64
    # Same seed, same model, greedy: the replay sends exactly the same prompts.
    a, again = by_id(results["A"]), by_id(results["A again"])
    assert {k: r.prompt_ids for k, r in a.items()} == {k: r.prompt_ids for k, r in again.items()}


def test_returning_turns_report_their_cached_history(runs):
    results, _, _ = runs
    reqs = by_id(results["A"])
    for c in range(3):
        # Turn 0: cold, except the 64-token system prompt (2 pages) when another
        # client's prefill of it finished in an earlier engine step.
        assert reqs[f"c{c}-t0"].cached_tokens in (0, 64)
        for t in (1, 2):
            prev = reqs[f"c{c}-t{t - 1}"]
            # The whole history is in L1 except the last answer token, whose KV
            # is never computed: full pages of prompt + 15 answer tokens.
            expect = (prev.prompt_tokens + 15) // PAGE * PAGE
            assert reqs[f"c{c}-t{t}"].cached_tokens == expect
    # After B pushed A out of L1, A's prompts are served again in full (from L2
    # where L1 lost them): every full page but the one holding the last token.
    for r in results["A again"].requests:
        assert r.cached_tokens == (r.prompt_tokens - 1) // PAGE * PAGE
    assert results["A again"].summary["cached_share"] > results["A"].summary["cached_share"]


def test_admin_tier_deltas_add_up_to_cached_tokens(runs):
    results, preempted, _ = runs
    assert preempted == {"A": 0, "B": 0, "A again": 0}, "workload too big for L1: preemptions"
    for name, res in results.items():
        tiers = res.tiers
        assert tiers["page_size"] == PAGE and set(tiers) == {"page_size", "prompt_tokens",
                                                             "l1", "l2"}
        assert tiers["prompt_tokens"] == res.summary["prompt_tokens"]
        # Each admitted request counts each prompt page once, in the first tier
        # that held it, and vLLM's cached_tokens = local hit + connector tokens,
        # both whole pages here (page = block = 32 tokens): the sums are equal.
        tier_tokens = sum(tiers[t]["hits"] * PAGE for t in ("l1", "l2"))
        assert tier_tokens == res.summary["cached_tokens"], name
        for t in ("l1", "l2"):
            assert tiers[t]["hit_tokens"] == tiers[t]["hits"] * PAGE
    assert results["A"].tiers["l2"]["hits"] == 0 and results["A"].tiers["l1"]["hits"] > 0
    again = results["A again"].tiers["l2"]
    assert again["hits"] > 0 and again["hit_rate"] > 0.1
    # Turn 0 of the replay: every one of its 3 x 18 full pages came from a cache
    # (test_returning_turns_report_their_cached_history), most of them from L2, B having
    # evicted A from L1. How many L1 still held depends on how B's requests interleaved
    # (a loaded machine once left one more there: 53 L2 hits where 54 were usual), so
    # the bound is "most", not "all".
    assert again["hits"] > 3 * ((600 - 1) // PAGE) // 2


def test_trace_json_and_plots(runs):
    results, _, out = runs
    trace = read_trace(out / "trace.jsonl")
    reqs = by_id(results["A"])
    assert sorted(t.id for t in trace) == sorted(reqs)
    for t in trace:
        r = reqs[t.id]
        assert list(t.prompt) == r.prompt_ids and t.prompt_tokens == len(r.prompt_ids)
        assert t.output == tuple(r.answer_ids)
        assert t.output_tokens == 16 and t.finish == pytest.approx(r.finish, abs=1e-5)
        assert t.arrival == pytest.approx(r.arrival, abs=1e-5)
    path = results["A"].to_json(out / "A.json")
    back = BenchResult.from_json(path)
    assert back.to_dict() == results["A"].to_dict() and back.spec == SPEC_A
    pngs = write_plots({"A": results["A"], "A again": json.loads(
        json.dumps(results["A again"].to_dict()))}, out / "plots")
    assert len(pngs) == 3 and all(p.stat().st_size > 5000 for p in pngs)


def test_failed_requests_are_recorded_and_end_only_their_conversation(server, tiny_model):
    base, _ = server
    too_long = WorkloadSpec(clients=2, turns=2, history_tokens=2100, answer_tokens=4)
    res = run_bench_sync(base, too_long, model=tiny_model, progress=False)
    assert [r.id for r in sorted(res.requests, key=lambda r: r.client)] == ["c0-t0", "c1-t0"]
    assert all(r.error and r.error.startswith("HTTP 400") for r in res.requests)
    assert res.summary["n_errors"] == 2 and res.summary["ttft_ms"]["p50"] is None

    spec = WorkloadSpec(clients=1, turns=2, history_tokens=1500, answer_tokens=200, seed=99)
    timed_out = asyncio.run(run_bench(base, spec, progress=False, request_timeout=0.05))
    (r,) = timed_out.requests
    assert r.error == "timeout: no complete answer within 0.05 s"
    assert timed_out.summary["n_errors"] == 1


def test_bad_admin_url_is_a_clear_error(server):
    base, admin = server
    with pytest.raises(BenchError, match="/stats answered 404"):
        run_bench_sync(base, WorkloadSpec(clients=1, turns=1, history_tokens=40),
                       admin_url=admin + "/nope", progress=False)


def test_agent_sessions_pause_retain_and_prefetch(server, runs, tmp_path):
    """The agent scenario as a client runs it: each later turn waits its seeded tool
    pause, carries the history, asks the admin to prefetch the history before it
    returns and sends retain_s, which pins pages. This server has no L3, so every
    prefetch is refused (409) and counted as failed; the requests are unaffected.
    The trace records the hints and when each history's prefetch was asked (the
    simulator replays both). (The prefetch itself: tests/e2e/test_engine_sessions.py.)"""
    base, admin = server
    spec = WorkloadSpec(scenario="agent", clients=2, turns=3, history_tokens=300,
                        shared_prefix_tokens=64, question_tokens=32, answer_tokens=8,
                        pause_min_s=0.2, pause_max_s=0.4, retain_s=600, prefetch_lead_s=0.1,
                        seed=21)
    result = run_bench_sync(base, spec, admin_url=admin, admin_token=TOKEN, progress=False,
                            trace_path=tmp_path / "agent.jsonl")
    assert result.summary["n_errors"] == 0
    assert result.summary["prefetch_calls"] == 2 * 2 == result.summary["prefetch_failed"]
    traced = {r.id: r for r in read_trace(tmp_path / "agent.jsonl")}
    by = {(r.client, r.turn): r for r in result.requests}
    for client in range(2):
        for turn in (1, 2):
            prev, cur = by[(client, turn - 1)], by[(client, turn)]
            # asyncio sleeps never end early (beyond the clock's resolution)
            assert cur.arrival - prev.finish >= spec.pause_of(client, turn) - 0.005
            assert cur.prompt_ids[: len(prev.prompt_ids) + 8] == [*prev.prompt_ids,
                                                                  *prev.answer_ids]
            rec = traced[cur.id]
            assert rec.hints == {"retain_s": 600}
            assert rec.prefetch_tokens == len(prev.prompt_ids) + 8
            assert rec.prefetch_at is not None and prev.finish <= rec.prefetch_at <= rec.arrival
        assert traced[by[(client, 0)].id].prefetch_at is None
    pins = httpx.get(f"{admin}/stats", timeout=10).json()["pins"]
    assert pins["pins"] >= 1 and pins["pinned_pages"] > 0
    with pytest.raises(BenchError, match="prefetch_lead_s needs the admin endpoint"):
        run_bench_sync(base, spec, progress=False)


def test_a_mooncake_trace_replays_through_the_cli(server, tmp_path):
    """``hicache bench replay`` on a Mooncake-format slice the test writes (32-token
    blocks here): one request at a time, so what each reuses is known exactly. b
    extends a (4 blocks, then 2 more): its cached tokens are a's 4 blocks; c shares
    only block 0 with them; d is longer than the model and is skipped; e repeats b
    after c: all of it but its last page. Then the same slice at once (time scale 0,
    2 in flight): every request completes, in trace order."""
    from typer.testing import CliRunner

    from hicache.integration.cli.main import app

    base, admin = server
    ids = {"a": [100, 101, 102, 103], "b": [100, 101, 102, 103, 104, 105],
           "c": [100, 200], "d": list(range(300, 400)), "e": [100, 101, 102, 103, 104, 105]}
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(v),
                         "output_length": 4, "hash_ids": v}) for i, v in enumerate(ids.values())]
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    common = ["bench", "replay", "--trace", str(trace), "--url", base, "--block-tokens", "32",
              "--max-model-len", "2048", "--token-high", "1000", "--seed", "4",
              "--admin-url", admin, "--admin-token", TOKEN, "--no-progress"]
    done = CliRunner().invoke(app, [*common, "--concurrency", "1", "--out", str(tmp_path / "1"),
                                    "--record", str(tmp_path / "served.jsonl")])
    assert done.exit_code == 0, done.output
    assert "replayed 4 of 5 trace lines (1 longer than --max-model-len skipped)" in " ".join(
        done.output.split())
    result = json.loads((tmp_path / "1" / "replay.json").read_text())
    reqs = result["requests"]
    assert [r["id"] for r in reqs] == ["line1", "line2", "line3", "line5"]
    assert [r["prompt_tokens"] for r in reqs] == [128, 192, 64, 192]
    assert all(r["error"] is None and r["output_tokens"] == 4 for r in reqs)
    assert reqs[1]["cached_tokens"] == 128 and reqs[2]["cached_tokens"] == 32
    assert reqs[3]["cached_tokens"] == (192 - 1) // PAGE * PAGE
    tiers = result["tiers"]
    assert sum(tiers[t]["hits"] * PAGE for t in ("l1", "l2")) == sum(
        r["cached_tokens"] for r in reqs)
    assert (tmp_path / "1" / "ttft_cdf.png").stat().st_size > 5000
    # --record: the served requests as a trace the simulator reads (skipped d absent).
    served = read_trace(tmp_path / "served.jsonl")
    assert [r.id for r in served] == ["line1", "line2", "line3", "line5"]
    assert [r.prompt_tokens for r in served] == [128, 192, 64, 192]
    assert all(r.output is not None and len(r.output) == 4 for r in served)
    done = CliRunner().invoke(app, [*common, "--concurrency", "2", "--time-scale", "0",
                                    "--out", str(tmp_path / "2")])
    assert done.exit_code == 0, done.output
    again = json.loads((tmp_path / "2" / "replay.json").read_text())["requests"]
    assert [r["id"] for r in again] == ["line1", "line2", "line3", "line5"]
    assert all(r["error"] is None for r in again)


def test_claude_code_sessions_replay_through_the_cli(server, tmp_path):
    """``hicache bench replay --format claude-code`` on two sessions the test writes
    (one 32-token page per 64-token trace block), one session at a time so what each
    turn reuses is known exactly: x's second turn keeps its first turn's 4 blocks
    (cached: 4 pages), its third keeps 2 after a sub-agent's turn whose chain is its
    own (nothing cached); y carries the same hash ids as x but ids are local to a
    session, so it shares nothing, and starts half a second after x (two sessions
    at once, --session-gap). With ``--hints`` every request names its session,
    each later turn's history on its own request list is prefetched within its pause
    (this server has no L3: refused and counted), each request says when its session
    returns (--return-in) and each session is closed at the end."""
    from typer.testing import CliRunner

    from hicache.integration.cli.main import app

    base, admin = server

    def req(t: float, blocks: int, keep: int, add: list[int], think: float) -> dict:
        return {"t": t, "in": 64 * blocks, "out": 4, "think_time": think, "keep": keep,
                "add": add}

    x = [req(0, 4, 0, [1, 2, 3, 4], 0.0), req(5, 6, 4, [5, 6], 0.5),
         {"t": 8, "type": "subagent", "requests": [req(0, 2, 0, [9, 10], 0.5)]},
         req(20, 4, 2, [7, 8], 0.5)]
    trace = tmp_path / "cc.jsonl"
    trace.write_text("\n".join(json.dumps({"id": sid, "block_size": 64, "requests": x})
                               for sid in ("x", "y")) + "\n")
    done = CliRunner().invoke(app, [
        "bench", "replay", "--trace", str(trace), "--format", "claude-code", "--url", base,
        "--block-tokens", "32", "--max-model-len", "2048", "--token-high", "1000",
        "--concurrency", "2", "--session-gap", "0.5", "--time-scale", "0.4", "--hints",
        "--retain-s", "60", "--return-in",
        "--prefetch-lead-s", "0.1", "--admin-url", admin, "--admin-token", TOKEN,
        "--no-progress", "--out", str(tmp_path / "out"), "--record", str(tmp_path / "r.jsonl")])
    assert done.exit_code == 0, done.output
    assert "replayed 8 turns of 2 sessions" in " ".join(done.output.split())
    result = json.loads((tmp_path / "out" / "replay.json").read_text())
    reqs = sorted(result["requests"], key=lambda r: r["id"])
    assert [r["id"] for r in reqs] == [f"{s}#{i}" for s in "xy" for i in range(4)]
    assert reqs[4]["arrival"] >= 0.5 - 0.005  # y's first turn: not before its gap
    assert all(r["error"] is None and r["output_tokens"] == 4 for r in reqs)
    assert [r["prompt_tokens"] for r in reqs] == [128, 192, 64, 128] * 2
    assert [r["cached_tokens"] for r in reqs] == [0, 128, 0, 64] * 2
    assert [r["turn"] for r in reqs] == [0, 1, 2, 3] * 2
    for prev, cur in zip(reqs, reqs[1:], strict=False):
        if cur["client"] == prev["client"]:  # asyncio sleeps never end early
            assert cur["arrival"] - prev["finish"] >= 0.4 * 0.5 - 0.005
    s = result["summary"]
    assert (s["prefetch_calls"], s["prefetch_failed"], s["closed"], s["close_failed"]) == (
        4, 4, 2, 0)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for sid in "xy":
        state = httpx.get(f"{admin}/sessions/{sid}", headers=headers, timeout=10).json()
        assert state["open"] is False and state["turns"] == 4
    served = sorted(read_trace(tmp_path / "r.jsonl"), key=lambda r: r.id)
    # --return-in: each turn but a session's last says when the next one comes (its
    # pause, 0.4 x 0.5 s); this server has no L3, so it books nothing.
    assert [r.hints for r in served] == [
        {"session_id": r.id[0], "retain_s": 60, **({} if r.id.endswith("#3") else
                                                    {"return_in_s": 0.2})} for r in served]
    # Prefetched: x#0 before x#1; x#1 before x#3 (of which x#3 keeps 2 blocks); the
    # sub-agent's first turn continues no history of its own.
    assert [r.prefetch_tokens for r in served] == [0, 128, 0, 64] * 2
