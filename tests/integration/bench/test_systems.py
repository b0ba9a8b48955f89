"""Compare configs and launch plans: the shipped presets parse, bad keys are named,
and a system that cannot run here gets a reason from a real probe (no mocks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hicache.integration.bench.compare import (
    add_ratios,
    failure_reason,
    markdown_table,
    run_compare,
    trace_missing,
)
from hicache.integration.bench.systems import (
    SYSTEM_KINDS,
    ConfigError,
    LaunchPlan,
    create_cost_us,
    load_config,
    parse_config,
    plan,
    preset_path,
    probe,
    remove_stores,
    rpc_dir,
    server_env,
    settled_create_us,
)
from hicache.integration.bench.trace_workload import TRACE_DIR_ENV, TraceWorkload

MINIMAL = {"name": "t", "model": "m", "workload": {"clients": 1},
           "systems": [{"name": "a", "kind": "vllm"}]}


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_presets_parse_and_cover_every_kind(name):
    cfg = load_config(preset_path(name))
    assert {s.kind for s in cfg.systems} == set(SYSTEM_KINDS)
    policies = {(s.write_policy, s.l3) for s in cfg.systems if s.kind == "hicache"}
    assert policies == {(p, l3) for p in ("write_through", "write_through_selective",
                                          "write_back") for l3 in (None, "file")}


def test_the_agent_preset_replays_claude_code_sessions_with_two_clients():
    cfg = load_config(preset_path("agent"))
    assert (cfg.workload["trace"], cfg.workload["format"]) == (
        "weka_claude_code/cc_traces_compact.jsonl.gz", "claude-code")
    lru, sessions, returning, tlru = cfg.systems
    assert returning.workload == {"hints": True, "return_in": True}
    assert (lru.kind, lru.l3, lru.workload) == ("hicache", "file", {})
    assert tlru.extra_config["hicache_eviction_policy"] == "tlru" and tlru.workload == {}
    assert (sessions.kind, sessions.l3) == ("hicache", "file")
    assert sessions.workload == {"hints": True, "retain_s": 8, "prefetch_lead_s": 1.0}
    plain, agent = (TraceWorkload.from_dict({**cfg.workload, **s.workload})
                    for s in cfg.systems[:2])
    assert (plain.hints, agent.hints, agent.prefetch_lead_s) == (False, True, 1.0)


def test_a_trace_workload_names_its_bad_keys_and_its_missing_file(tmp_path, monkeypatch):
    trace = {"trace": "cc.jsonl.gz"}
    for patch, key in (({"sessions": 0}, "'sessions'"), ({"format": "sharegpt"}, "'format'"),
                       ({"pause_min_s": 1}, "unknown workload key 'pause_min_s'"),
                       ({"retain_s": 5}, "set 'hints: true'")):
        with pytest.raises(ConfigError, match=key):
            parse_config({**MINIMAL, "workload": {**trace, **patch}})
    cfg = parse_config({**MINIMAL, "workload": trace})
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    assert f"{tmp_path / 'cc.jsonl.gz'} is not a file" in trace_missing(cfg)
    (tmp_path / "cc.jsonl.gz").write_bytes(b"")
    assert trace_missing(cfg) is None
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TRACE_DIR_ENV)
    assert trace_missing(cfg) is None  # else relative to the working directory
    with pytest.raises(ConfigError, match="workload key 'trace'"):
        run_compare(parse_config({**MINIMAL, "workload": {"trace": "nope.jsonl"}}),
                    out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # refused before any server started


@pytest.mark.parametrize("patch, key", [
    ({"colour": 1}, "'colour'"),
    ({"systems": []}, "'systems'"),
    ({"systems": [{"name": "a", "kind": "tgi"}]}, "'kind' must be one of vllm, hicache"),
    ({"systems": [{"name": "a", "kind": "hicache", "l3": "s3"}]}, "'l3' must be one of file, nixl"),
    ({"systems": [{"name": "a", "kind": "hicache", "write_policy": "x"}]}, "'write_policy'"),
    ({"systems": [{"name": "a", "kind": "vllm", "l3": "file"}]}, "kind 'hicache' only"),
    ({"systems": [{"name": "a", "kind": "vllm"}, {"name": "a", "kind": "hicache"}]}, "unique"),
    ({"systems": [{"name": "a", "kind": "vllm", "speed": 1}]}, "systems\\[0\\]: unknown key 'speed'"),
    ({"memory_budget_gb": -1}, "'memory_budget_gb'"),
    ({"systems": [{"name": "a", "kind": "vllm", "workload": {"retain_s": 3}}]},
     "system 'a': workload key\\(s\\) \\['retain_s'\\] apply to scenario agent only"),
    ({"systems": [{"name": "a", "kind": "vllm", "workload": 3}]}, "'workload' must be a mapping"),
    ({"l1_blocks": 1}, "'l1_blocks'"),
    ({"page_size": 48}, "'page_size' must be a multiple"),
    ({"workload": None}, "'workload'"),
    ({"l3_read": "warm"}, "'l3_read' must be one of cold, cached, got 'warm'"),
    ({"systems": [{"name": "n", "kind": "hicache", "l3": "nixl"}]},
     "system 'n' uses l3: nixl.*set l3_read: cached"),
])
def test_bad_config_names_the_key(patch, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({**MINIMAL, **patch})


def test_hicache_plan_is_one_vllm_flag_on_loopback(tmp_path):
    cfg = parse_config({**MINIMAL, "memory_budget_gb": 0.5, "l1_blocks": 80,
                        "systems": [{"name": "h", "kind": "hicache", "l3": "file",
                                     "write_policy": "write_back"}]})
    lp = plan(cfg, cfg.systems[0], port=1234, admin_port=4321, workdir=tmp_path)
    assert lp.not_run is None
    assert lp.cmd[lp.cmd.index("--host") + 1] == "127.0.0.1"
    assert lp.cmd[lp.cmd.index("--num-gpu-blocks-override") + 1] == "80"
    kv = json.loads(lp.cmd[lp.cmd.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    assert kv["kv_connector"] == "HiCacheConnector"
    assert extra["hicache_size"] == 0.5 and extra["hicache_write_policy"] == "write_back"
    assert extra["hicache_admin_port"] == 4321 and lp.admin_url == "http://127.0.0.1:4321"
    store = extra["hicache_storage_backend_extra_config"]
    assert Path(store["path"]).is_dir()
    assert store["direct_io"] == "on"  # l3_read: cold (the default): reads from storage
    # An admin token of its own, in the environment only (the client's writes need it).
    token = lp.env["HICACHE_ADMIN_TOKEN"]
    assert len(token) == 32 and token not in " ".join(lp.cmd)


def test_servers_keep_vllms_ipc_sockets_in_a_folder_of_this_process(tmp_path, monkeypatch):
    cfg = parse_config({**MINIMAL, "systems": [{"name": "v", "kind": "vllm"}]})
    lp = plan(cfg, cfg.systems[0], port=1234, admin_port=4321, workdir=tmp_path)
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    first, second = server_env(lp)["VLLM_RPC_BASE_PATH"], server_env(lp)["VLLM_RPC_BASE_PATH"]
    assert first == second == str(rpc_dir()) and Path(first).is_dir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))  # the operator's choice stands
    assert server_env(lp)["VLLM_RPC_BASE_PATH"] == str(tmp_path)


def test_each_run_gets_a_new_empty_store_and_earlier_ones_wait_for_remove_stores(tmp_path):
    """A run's L3 is never an earlier run's directory emptied (on ext4 without a
    journal, files created just after thousands were deleted cost a scan each):
    every plan gets a new empty one, and remove_stores deletes them all at the end."""
    cfg = parse_config({**MINIMAL, "systems": [{"name": "h", "kind": "hicache", "l3": "file"}]})

    def store_of(lp: LaunchPlan) -> Path:
        kv = json.loads(lp.cmd[lp.cmd.index("--kv-transfer-config") + 1])
        return Path(kv["kv_connector_extra_config"]["hicache_storage_backend_extra_config"]
                    ["path"])

    first = store_of(plan(cfg, cfg.systems[0], port=1, admin_port=2, workdir=tmp_path))
    (first / "page").write_bytes(b"x")  # what the first run wrote
    second = store_of(plan(cfg, cfg.systems[0], port=1, admin_port=2, workdir=tmp_path))
    assert second != first and second.parent == first.parent == tmp_path
    assert list(second.iterdir()) == []  # no page of the first run is a hit
    assert (first / "page").read_bytes() == b"x"  # not deleted between runs
    (tmp_path / "results.json").write_text("{}")
    remove_stores(tmp_path)
    assert not first.exists() and not second.exists()
    assert (tmp_path / "results.json").exists()  # only the stores go


def test_the_file_creation_probe_leaves_its_files_to_remove_stores(tmp_path):
    """The probe's files stay until remove_stores (deleting them at once would itself
    make the next run's files dearer on such a file system)."""
    cost = create_cost_us(tmp_path / "work", files=50)
    assert cost > 0
    (probe,) = (tmp_path / "work").iterdir()
    assert len(list(probe.iterdir())) == 50
    remove_stores(tmp_path / "work")
    assert list((tmp_path / "work").iterdir()) == []


def test_a_round_waits_for_cheap_files_as_long_as_it_is_allowed(tmp_path):
    """settled_create_us probes until a new file is cheap or the wait is spent (a
    scripted probe and sleep: no clock)."""
    def run(costs: list[float], wait_s: float) -> tuple[tuple[float, float], list[float]]:
        left, slept = iter(costs), []
        got = settled_create_us(tmp_path, wait_s, every_s=15, probe=lambda _: next(left),
                                sleep=slept.append)
        return got, slept

    assert run([20.0], 360) == ((20.0, 0.0), [])
    assert run([600.0, 300.0, 40.0], 360) == ((40.0, 30.0), [15, 15])
    assert run([600.0, 500.0, 400.0], 30) == ((400.0, 30.0), [15, 15])  # gave up
    assert run([600.0], 0) == ((600.0, 0.0), [])


def test_cached_l3_reads_leave_the_page_cache_on_and_nixl_needs_them(tmp_path):
    cfg = parse_config({**MINIMAL, "l3_read": "cached", "systems": [
        {"name": "f", "kind": "hicache", "l3": "file"},
        {"name": "n", "kind": "hicache", "l3": "nixl"}]})
    for spec in cfg.systems:
        lp = plan(cfg, spec, port=1, admin_port=2, workdir=tmp_path)
        kv = json.loads(lp.cmd[lp.cmd.index("--kv-transfer-config") + 1])
        assert "direct_io" not in kv["kv_connector_extra_config"][
            "hicache_storage_backend_extra_config"]


def test_equal_budget_reaches_every_kind(tmp_path):
    cfg = parse_config({**MINIMAL, "memory_budget_gb": 3, "systems": [
        {"name": "o", "kind": "vllm_offload"}, {"name": "l", "kind": "lmcache"}]})
    off = plan(cfg, cfg.systems[0], port=1, admin_port=2, workdir=tmp_path)
    assert off.cmd[off.cmd.index("--kv-offloading-size") + 1] == "3"
    assert off.cmd[off.cmd.index("--kv-offloading-backend") + 1] == "native"
    lm = plan(cfg, cfg.systems[1], port=1, admin_port=2, workdir=tmp_path)
    # LMCache reports usage unless told not to: every LMCache process gets both.
    assert lm.env["LMCACHE_TRACK_USAGE"] == "false" and lm.env["DO_NOT_TRACK"] == "1"
    assert "LMCACHE_TRACK_USAGE" not in off.env


def test_missing_interpreter_and_package_give_reasons(tmp_path):
    assert "not found" in probe(str(tmp_path / "nope" / "python"), "vllm", False)
    assert probe(sys.executable, "no_such_module_xyz", False) == (
        f"no_such_module_xyz is not installed for {sys.executable}")
    assert probe(sys.executable, "json", False) is None
    import torch

    if not torch.cuda.is_available():
        assert probe(sys.executable, "json", True) == "needs a CUDA GPU; this machine has none"
    cfg = parse_config({**MINIMAL, "systems": [
        {"name": "s", "kind": "sglang", "python": str(tmp_path / "venv/bin/python")},
        {"name": "l", "kind": "lmcache"}]})
    sg = plan(cfg, cfg.systems[0], port=1, admin_port=2, workdir=tmp_path)
    assert sg.not_run and "not found" in sg.not_run
    lm = plan(cfg, cfg.systems[1], port=1, admin_port=2, workdir=tmp_path)
    assert lm.not_run and "lmcache is not installed" in lm.not_run


def test_failure_reason_picks_the_root_cause(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "INFO starting\n"
        "(EngineCore) ERROR RuntimeError: Worker failed with error 'CPU Offloading is currently "
        "only supported on CUDA-alike and XPU GPUs', please check the stack trace above\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert failure_reason(log, "x") == (
        "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs")
    # The same failure when the engine core's own traceback reaches the log first (a
    # loaded machine): a bare "Exception:" line, then the generic wrapper.
    bare = tmp_path / "bare.log"
    bare.write_text(
        "(EngineCore pid=2) ERROR 11-27 03:25:06 [core.py:1510] Exception: CPU Offloading is "
        "currently only supported on CUDA-alike and XPU GPUs\n"
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {}\n")
    assert failure_reason(bare, "x") == (
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs")
    (tmp_path / "quiet.log").write_text("nothing here\n")
    assert failure_reason(tmp_path / "quiet.log", "exited (code 1)") == "exited (code 1)"
    # vLLM's ulimit hint quotes an error that did not happen: never the cause.
    hint = tmp_path / "hint.log"
    hint.write_text(
        "(APIServer pid=1) WARNING 11-25 22:42:23 [system_utils.py:255] Found ulimit of 20000 "
        "and failed to automatically increase. This can cause fd limit errors like "
        "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n\n")
    assert failure_reason(hint, "exited (code 1)") == "exited (code 1)"


def test_a_server_that_exited_gets_its_workers_errors_written_first(tmp_path):
    """stop_server waits for the rest of the process group (vLLM's workers write the
    root cause after the API server has exited) before the log is read."""
    import subprocess
    import sys

    from hicache.integration.bench.compare import stop_server

    log = tmp_path / "s.log"
    script = ("import os, subprocess, sys\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); "
              "print(\"RuntimeError: the root cause\", flush=True)'])\n")
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.wait(30)
    stop_server(proc)
    assert failure_reason(log, "exited (code 0)") == "RuntimeError: the root cause"


def test_table_lists_every_system_with_a_number_or_a_reason():
    cfg = parse_config(MINIMAL)
    summary = {"ttft_ms": {"p50": 10.0, "p90": 20.0, "p99": 30.0}, "itl_ms": {"p50": 1.0},
               "request_throughput": 2.0, "output_throughput": 50.0, "cached_share": 0.5,
               "prompt_tokens": 1000}
    rows = [{"system": "base", "status": "ok", "summary": summary, "returning_ttft_ms_p50": 8.0},
            {"system": "fast", "status": "ok", "summary": summary, "returning_ttft_ms_p50": 2.0},
            {"system": "peer", "status": "not run", "reason": "needs a CUDA GPU"}]
    add_ratios(rows)
    assert [r["returning_ttft_ratio"] for r in rows] == [1.0, 0.25, None]
    md = markdown_table(cfg, rows)
    assert "| peer | not run: needs a CUDA GPU |" in md
    assert "0.25x" in md and md.count("\n") == 5


def test_cli_refuses_bad_input_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from hicache.integration.cli.main import app

    run = CliRunner().invoke
    res = run(app, ["bench", "compare", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "not a preset (allowed: cpu, gpu, agent)" in res.output
    res = run(app, ["bench", "compare", "cpu", "--only", "vllm,tgi"])
    assert res.exit_code == 2 and "--only: unknown system 'tgi'; allowed: vllm, hicache-floor, hicache-wt," in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: m\nworkload: {}\nsystems: [{name: a, kind: tgi}]\n")
    res = run(app, ["bench", "compare", str(bad)])
    assert res.exit_code == 2 and "'kind' must be one of" in res.output
    res = run(app, ["bench", "run", "--scenario", "chat", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "'scenario' must be one of multiturn" in res.output
    res = run(app, ["bench", "run", "--max-in-flight", "-1", "--url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "'max_in_flight' must be an integer >= 0" in res.output
