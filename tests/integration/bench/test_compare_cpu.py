"""The CPU preset, reduced, end to end against real servers — and the simulator checked
against what those servers measured.

One `run_compare` launches, in turn: vLLM alone, vLLM + HiCache (write_through,
file L3), vLLM's native CPU offloading (which this CPU build refuses at start)
and SGLang (whose interpreter is absent here). The shipped preset file is the
starting point; only the system list and the workload size are cut down.

Then the hicache run's recorded trace is replayed by `hicache simulate`'s
engine with the server's sizes, and its per-tier hit rates must be within
5 percentage points of the rates the bench client measured (admin /stats
deltas per tier, and vLLM's usage.cached_tokens for the total).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hicache.integration.bench.compare import run_compare
from hicache.integration.bench.sim_engine import SimConfig, SimEngine
from hicache.integration.bench.systems import load_config, plan, preset_path
from hicache.integration.bench.trace import read_trace

pytestmark = pytest.mark.engine

KEEP = ("vllm", "hicache-wt+file", "vllm-native-offload", "sglang-hicache")


@pytest.fixture(scope="module")
def compare(tmp_path_factory, tiny_model):
    cfg = load_config(preset_path("cpu"))
    systems = []
    for s in cfg.systems:
        if s.name in KEEP:
            if s.kind == "sglang":  # an interpreter that is certainly absent
                s = replace(s, python=str(tmp_path_factory.mktemp("nosglang") / "bin/python"))
            systems.append(s)
    # A budget for ~60% of the eight histories, so L1, L2 and L3 all serve pages.
    cfg = replace(cfg, systems=tuple(systems), model=tiny_model, memory_budget_gb=0.012,
                  workload={**cfg.workload, "turns": 3})
    out = tmp_path_factory.mktemp("compare")
    report = run_compare(cfg, out=out, progress=False)
    return cfg, out, {r["system"]: r for r in report["rows"]}


def test_every_system_has_a_number_or_a_reason(compare):
    cfg, out, rows = compare
    assert list(rows) == list(KEEP)
    for name in ("vllm", "hicache-wt+file"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["summary"]["n_requests"] == 24
    assert rows["vllm-native-offload"]["status"] == "not run"
    assert "CUDA" in rows["vllm-native-offload"]["reason"]  # vLLM's own message, from its log
    assert rows["sglang-hicache"]["status"] == "not run"
    assert "not found" in rows["sglang-hicache"]["reason"]
    if Path(".venv-peers/sglang/bin/python").exists():  # the peer venv built by setup_venvs.sh
        real = [s for s in load_config(preset_path("cpu")).systems if s.kind == "sglang"][0]
        lp = plan(cfg, real, port=1, admin_port=2, workdir=out)
        assert lp.not_run and "needs a CUDA GPU" in lp.not_run
    md = (out / "compare.md").read_text()
    for name in KEEP:
        assert f"| {name}" in md
    assert json.loads((out / "compare.json").read_text())["rows"][0]["system"] == "vllm"
    assert list(out.glob("*.png")), "no plots written"


def test_hicache_serves_returning_turns_that_vllm_recomputes(compare):
    _, _, rows = compare
    base, hi = rows["vllm"], rows["hicache-wt+file"]
    assert hi["summary"]["cached_share"] > base["summary"]["cached_share"] + 0.15
    tiers = hi["tiers"]
    # The budget holds ~60% of the eight histories and they return in turn (LRU's worst
    # case), so most returning pages come back from L3.
    assert tiers["l3"]["hits"] > tiers["l2"]["hits"] >= 0 and tiers["l1"]["hits"] > 0
    assert hi["returning_ttft_ratio"] is not None and base["returning_ttft_ratio"] == 1.0


def test_simulator_matches_the_measured_hit_rates_within_5_points(compare):
    cfg, out, rows = compare
    measured = rows["hicache-wt+file"]
    tiers = measured["tiers"]
    records = read_trace(out / "hicache-wt+file.trace.jsonl")
    assert len(records) == 24 and all(r.output is not None for r in records)
    sim = SimEngine(SimConfig(
        l1_blocks=cfg.l1_blocks, l2_pages=tiers["l2"]["capacity_pages"], l3_pages=-1,
        block_size=cfg.block_size, page_size=cfg.page_size, write_policy="write_through",
    )).run(records)
    got = sim.hit_rates()
    want = {t: tiers[t]["hit_rate"] for t in ("l1", "l2", "l3")}
    want["total"] = measured["summary"]["cached_share"]
    print(json.dumps({"simulated": got, "measured": want}, indent=1))
    for tier in ("l1", "l2", "l3", "total"):
        assert abs(got[tier] - want[tier]) <= 0.05, (tier, got, want)
    assert sim.prompt_tokens == measured["summary"]["prompt_tokens"]
