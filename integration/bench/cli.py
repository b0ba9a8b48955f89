"""``hicache bench run|replay|compare``, ``hicache profile`` and ``hicache simulate``: the
typer commands.

They parse options, turn bad input into exit code 2 with a message that
names the option and the allowed values, and call client.py, compare.py and
simulate.py. The component benchmarks against SGLang and LMCache need a source
checkout (peer venvs; the wheel leaves them out): ``make bench-peers`` or
``python -m hicache.integration.bench.peers``. Heavy imports (vLLM via the
scheduler, matplotlib) happen inside the commands so ``hicache --help``
stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

bench_app = typer.Typer(
    help="Benchmark servers: one workload (run), every system of a config (compare). "
         "Component benchmarks against SGLang and LMCache: make bench-peers (a source "
         "checkout).",
    no_args_is_help=True,
)

EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    Console(stderr=True).print(f"[red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@bench_app.command("run")
def run_cmd(
    url: Annotated[str, typer.Option("--url", help="OpenAI-compatible server base URL.")] =
        "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model id (default: the server's first).")] = None,
    scenario: Annotated[str, typer.Option(
        help="multiturn, shared_doc, system_prompt or agent.")] = "multiturn",
    clients: Annotated[int, typer.Option(help="Concurrent clients.")] = 4,
    turns: Annotated[int, typer.Option(help="Requests per client, sent one after another.")] = 3,
    history_tokens: Annotated[int, typer.Option(help="First prompt length, tokens.")] = 1024,
    shared_prefix_tokens: Annotated[int, typer.Option(
        help="Shared system prompt (shared_doc: document) length, tokens.")] = 0,
    num_docs: Annotated[int, typer.Option(help="shared_doc: distinct documents.")] = 1,
    question_tokens: Annotated[int, typer.Option(help="New user tokens per turn.")] = 64,
    answer_tokens: Annotated[int, typer.Option(help="Generated tokens per request.")] = 32,
    think_time: Annotated[float, typer.Option(help="Seconds between a client's turns.")] = 0.0,
    max_in_flight: Annotated[int, typer.Option(
        help="Requests outstanding at once across clients (0: one per client).")] = 0,
    pause_min: Annotated[float, typer.Option(help="agent: shortest tool-call pause, s.")] = 0.0,
    pause_max: Annotated[float, typer.Option(help="agent: longest tool-call pause, s.")] = 0.0,
    retain_s: Annotated[float, typer.Option(
        "--retain-s", help="agent: send kv_transfer_params hicache.retain_s (0: no).")] = 0.0,
    prefetch_lead: Annotated[float, typer.Option(
        help="agent: POST /prefetch a session's history this many seconds before its "
        "next turn (needs --admin-url; 0: no).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Workload seed (same seed, same prompts).")] = 0,
    config: Annotated[Path | None, typer.Option(
        "--config", exists=True, dir_okay=False,
        help="YAML/JSON mapping of workload keys (overrides the options).")] = None,
    admin_url: Annotated[str | None, typer.Option(
        help="HiCache admin API, for hits per tier (e.g. http://127.0.0.1:8790).")] = None,
    admin_token: Annotated[str | None, typer.Option(envvar="HICACHE_ADMIN_TOKEN")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Record the requests as a JSONL trace for `hicache simulate`.")] = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="Tokenizer for servers that do not return token ids.")] = None,
    out: Annotated[Path, typer.Option(help="Directory for bench.json and the plots.")] =
        Path("bench_results/bench"),
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Run one workload against a running server; print and save its numbers."""
    from hicache.integration.bench.client import run_bench_sync
    from hicache.integration.bench.report import write_plots
    from hicache.integration.bench.workloads import WorkloadSpec

    values: dict[str, Any] = dict(
        scenario=scenario, clients=clients, turns=turns, history_tokens=history_tokens,
        shared_prefix_tokens=shared_prefix_tokens, num_docs=num_docs,
        question_tokens=question_tokens, answer_tokens=answer_tokens, think_time_s=think_time,
        max_in_flight=max_in_flight, seed=seed)
    if scenario == "agent":  # the agent keys are errors for the other scenarios
        values.update(pause_min_s=pause_min, pause_max_s=pause_max, retain_s=retain_s,
                      prefetch_lead_s=prefetch_lead)
    if config is not None:
        import yaml

        loaded = yaml.safe_load(config.read_text())
        if not isinstance(loaded, dict):
            _fail(f"--config {config}: expected a mapping of workload keys")
        values.update(loaded)
    try:
        spec = WorkloadSpec.from_dict(values)
    except ValueError as e:
        _fail(str(e))
    result = run_bench_sync(url, spec, model=model, admin_url=admin_url,
                            admin_token=admin_token, trace_path=trace, progress=progress,
                            tokenizer=tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    result.to_json(out / "bench.json")
    plots = write_plots({"run": result}, out)
    console = Console()
    console.print_json(data=result.to_dict()["summary"])
    console.print(f"wrote {out / 'bench.json'}" + "".join(f", {p}" for p in plots)
                  + (f", trace {trace}" if trace else ""))


@bench_app.command("replay")
def replay_cmd(
    trace: Annotated[Path, typer.Option(
        "--trace", exists=True, dir_okay=False,
        help="A recorded trace (Mooncake's conversation_trace.jsonl, the WEKA Claude Code "
             "corpus' cc_traces_compact.jsonl.gz).")],
    fmt: Annotated[str, typer.Option(
        "--format", help="Trace format: mooncake (requests in trace order) or claude-code "
        "(agent sessions, each turn after the previous one and its think time).")] =
        "mooncake",
    url: Annotated[str, typer.Option("--url", help="OpenAI-compatible server base URL.")] =
        "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(help="Model id (default: the server's first).")] = None,
    requests: Annotated[int, typer.Option(
        help="mooncake: requests to replay, from the start (skipped ones not counted).")]
        = 800,
    sessions: Annotated[int | None, typer.Option(
        help="claude-code: sessions to replay, from the start of the file (default 8).")]
        = None,
    max_turns: Annotated[int | None, typer.Option(
        help="claude-code: each session's first N turns (default 0: all).")] = None,
    block_tokens: Annotated[int | None, typer.Option(
        help="Tokens per trace block (default: 128 for mooncake's 512-token blocks, 1 for "
             "claude-code's 64-token blocks; fewer scales prompts down).")] = None,
    max_model_len: Annotated[int, typer.Option(
        help="Skip requests whose prompt + answer exceed this many tokens.")] = 4096,
    max_output_tokens: Annotated[int, typer.Option(
        help="Answer length: the trace's, capped at this.")] = 16,
    output_tokens: Annotated[int | None, typer.Option(
        help="Answer length for every request (overrides the trace's).")] = None,
    concurrency: Annotated[int | None, typer.Option(
        help="mooncake: requests in flight at most (closed loop without --time-scale; "
             "default 16); claude-code: sessions at once (default 4).")] = None,
    time_scale: Annotated[float | None, typer.Option(
        help="mooncake: send each request at its timestamp times this (open loop); "
             "claude-code: multiply each recorded think time (default 1).")] = None,
    max_think_s: Annotated[float | None, typer.Option(
        help="claude-code: cap each (scaled) think time at this many seconds.")] = None,
    session_gap: Annotated[float | None, typer.Option(
        help="claude-code: start session k no earlier than k times this many seconds "
             "(default 0: as slots free).")] = None,
    hints: Annotated[bool, typer.Option(
        help="claude-code: the agent tells the cache its session (session_id, retain_s, "
             "POST /prefetch before a turn, close at the end).")] = False,
    retain_s: Annotated[float | None, typer.Option(
        help="claude-code with --hints: retain_s on every request.")] = None,
    prefetch_lead_s: Annotated[float | None, typer.Option(
        help="claude-code with --hints: prefetch the session's history this long before "
             "its next turn (needs --admin-url).")] = None,
    return_in: Annotated[bool, typer.Option(
        help="claude-code with --hints: each request says when its session returns "
             "(return_in_s: the next turn's pause), so the server reads it back itself.")]
        = False,
    token_high: Annotated[int, typer.Option(
        help="Token ids are drawn below this (the model's vocabulary size or less).")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed of the token runs (same seed, same prompts).")]
        = 0,
    admin_url: Annotated[str | None, typer.Option(
        help="HiCache admin API, for hits per tier (e.g. http://127.0.0.1:8790).")] = None,
    admin_token: Annotated[str | None, typer.Option(envvar="HICACHE_ADMIN_TOKEN")] = None,
    name: Annotated[str, typer.Option(help="Label of this run in the table and plots.")] =
        "replay",
    out: Annotated[Path, typer.Option(help="Directory for replay.json and the plots.")] =
        Path("bench_results/replay"),
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    record: Annotated[Path | None, typer.Option(
        "--record", dir_okay=False,
        help="Write the served requests as a trace for `hicache simulate`.")] = None,
) -> None:
    """Replay a production trace against a running server; print and save its numbers."""
    from hicache.integration.bench.replay import TRACE_FORMATS
    from hicache.integration.bench.report import format_table, write_plots

    if fmt not in TRACE_FORMATS:
        _fail(f"--format {fmt!r} is not known; allowed: {', '.join(TRACE_FORMATS)}")
    agent_only = {"--sessions": sessions, "--max-turns": max_turns, "--max-think-s": max_think_s,
                  "--session-gap": session_gap, "--hints": hints or None, "--retain-s": retain_s,
                  "--prefetch-lead-s": prefetch_lead_s, "--return-in": return_in or None}
    given = [k for k, v in agent_only.items() if v is not None]
    if fmt == "mooncake" and given:
        _fail(f"{given[0]} applies to --format claude-code only")
    if not hints and (retain_s is not None or prefetch_lead_s is not None or return_in):
        _fail("--retain-s, --prefetch-lead-s and --return-in are agent hints: add --hints")
    common = {"model": model, "admin_url": admin_url, "admin_token": admin_token,
              "progress": progress, "record_path": record}
    try:
        if fmt == "mooncake":
            result = _replay_mooncake(trace, requests, _or(block_tokens, 128), max_model_len,
                                      max_output_tokens, output_tokens, token_high, seed, url,
                                      _or(concurrency, 16), time_scale, common)
        else:
            result = _replay_sessions(trace, _or(sessions, 8), _or(max_turns, 0),
                                      _or(block_tokens, 1), max_model_len, max_output_tokens,
                                      output_tokens, token_high, seed, url, _or(concurrency, 4),
                                      1.0 if time_scale is None else time_scale, max_think_s,
                                      session_gap or 0.0,
                                      (retain_s or 0.0, prefetch_lead_s or 0.0, return_in)
                                      if hints else None, common)
    except ValueError as e:
        _fail(str(e))
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    plots = write_plots({name: result}, out)
    console = Console()
    console.print(format_table({name: result}))
    t = result["trace"]
    read = (f"{t['replayed']} of {t['lines_read']} trace lines" if fmt == "mooncake" else
            f"{t['replayed']} turns of {t['sessions']} sessions")
    console.print(f"replayed {read} ({t['skipped_too_long']} longer than --max-model-len "
                  f"skipped); wrote {out / 'replay.json'}" + "".join(f", {p}" for p in plots)
                  + (f", trace {record}" if record else ""), highlight=False)
    if result["summary"]["n_errors"]:
        raise typer.Exit(1)


def _or(value: int | None, default: int) -> int:
    """An option's value, or its format's default where it was not given."""
    return default if value is None else value


def _replay_mooncake(trace: Path, requests: int, block_tokens: int, max_model_len: int,
                     max_output_tokens: int, output_tokens: int | None, token_high: int,
                     seed: int, url: str, concurrency: int, time_scale: float | None,
                     common: dict[str, Any]) -> dict[str, Any]:
    from hicache.integration.bench.replay import ReplaySpec, load_trace, replay_sync

    spec = ReplaySpec(block_tokens=block_tokens, max_model_len=max_model_len,
                      requests=requests, max_output_tokens=max_output_tokens,
                      output_tokens=output_tokens, token_high=token_high, seed=seed)
    loaded = load_trace(trace, "mooncake", spec)
    if not loaded.requests:
        _fail(f"--trace {trace}: no request fits --max-model-len {max_model_len}")
    return replay_sync(url, loaded, concurrency=concurrency, time_scale=time_scale, **common)


def _replay_sessions(trace: Path, sessions: int, max_turns: int, block_tokens: int,
                     max_model_len: int, max_output_tokens: int, output_tokens: int | None,
                     token_high: int, seed: int, url: str, concurrency: int, time_scale: float,
                     max_think_s: float | None, session_gap: float,
                     hints: tuple[float, float, bool] | None,
                     common: dict[str, Any]) -> dict[str, Any]:
    from hicache.integration.bench.session_replay import (
        AgentHints,
        SessionSpec,
        load_claude_code_file,
        replay_sessions_sync,
    )

    spec = SessionSpec(block_tokens=block_tokens, max_model_len=max_model_len,
                       sessions=sessions, max_turns=max_turns,
                       max_output_tokens=max_output_tokens, output_tokens=output_tokens,
                       token_high=token_high, seed=seed)
    loaded = load_claude_code_file(trace, spec)
    if not loaded.sessions:
        _fail(f"--trace {trace}: no turn fits --max-model-len {max_model_len}")
    agent = None if hints is None else AgentHints(retain_s=hints[0], prefetch_lead_s=hints[1],
                                                  return_in=hints[2])
    return replay_sessions_sync(url, loaded, concurrency=concurrency, time_scale=time_scale,
                                max_think_s=max_think_s, session_gap_s=session_gap,
                                hints=agent, **common)


@bench_app.command("compare")
def compare_cmd(
    config: Annotated[str, typer.Argument(
        help="A YAML config, or a shipped preset: cpu, gpu, agent.")],
    out: Annotated[Path | None, typer.Option(help="Output directory (default: the config's).")]
        = None,
    only: Annotated[str | None, typer.Option(
        help="Comma-separated system names to run (default: all).")] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Launch every system of CONFIG in turn on the same workload; one table and plots."""
    from dataclasses import replace

    from hicache.integration.bench.compare import run_compare
    from hicache.integration.bench.systems import ConfigError, load_config, preset_path

    path = preset_path(config)
    if not path.exists():
        _fail(f"config {config!r}: no such file, and not a preset (allowed: cpu, gpu, agent)")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        _fail(str(e))
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = [s.name for s in cfg.systems]
        unknown = [n for n in names if n not in known]
        if unknown:
            _fail(f"--only: unknown system {unknown[0]!r}; allowed: {', '.join(known)}")
        cfg = replace(cfg, systems=tuple(s for s in cfg.systems if s.name in names))
    try:
        report = run_compare(cfg, out=out, progress=progress)
    except ConfigError as e:  # what a config names but this machine lacks (a trace file)
        _fail(str(e))
    bad = [r for r in report["rows"] if r["status"] == "errors"]
    if bad:
        raise typer.Exit(1)


def simulate_cmd(
    trace: Annotated[Path, typer.Argument(exists=True, dir_okay=False,
                                          help="JSONL trace (from `hicache bench run --trace`, "
                                               "or see --format).")],
    trace_format: Annotated[str, typer.Option(
        "--format", help="hicache (this project's), mooncake (FAST'25 release) or "
        "claude-code (the WEKA corpus, compact JSONL, .gz ok); a public trace's block "
        "becomes one page.")] = "hicache",
    limit: Annotated[int | None, typer.Option(
        min=1, help="The first N requests (claude-code: sessions).")] = None,
    time_scale: Annotated[float, typer.Option(
        min=0.0, help="Multiply the trace's times (mooncake, claude-code).")] = 1.0,
    session_gap: Annotated[float, typer.Option(
        min=0.0, help="claude-code: seconds between one session's start and the next's.")]
        = 60.0,
    l1_blocks: Annotated[str, typer.Option(help="vLLM KV blocks to try, e.g. 80,160.")] = "80",
    l2_pages: Annotated[str, typer.Option(help="L2 pages to try; 0 = no connector.")] = "0,128,512",
    l3_pages: Annotated[str, typer.Option(help="L3 pages to try; none = no L3, inf = unbounded.")]
        = "none",
    policy: Annotated[str, typer.Option(
        help="Write policies: write_through, write_through_selective, write_back.")] =
        "write_through",
    block_size: Annotated[int, typer.Option(help="vLLM block size, tokens.")] = 32,
    page_size: Annotated[int, typer.Option(help="HiCache page size, tokens.")] = 32,
    prefetch_threshold: Annotated[int, typer.Option(
        help="Smallest L3 hit worth fetching, tokens.")] = 256,
    eviction: Annotated[str, typer.Option(
        help="L2 evictions: lru and tlru (HiCache's), oracle (Belady: knows the trace; "
             "the headroom).")] = "lru",
    target_hit_rate: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="Print, per policy, the smallest sizes of the grid whose "
        "share of prompt tokens cached reaches this (e.g. 0.9).")] = None,
    tlru_tail_pages: Annotated[int, typer.Option(
        min=1, help="tlru: pages at the end of each conversation it evicts first.")] = 64,
    hints: Annotated[str, typer.Option(
        help="Replay the trace's client actions (hicache hints, admin prefetches): "
             "on, off or on,off.")] = "on",
    calibrate_from: Annotated[Path | None, typer.Option(
        help="A `hicache bench run` result (bench.json) to fit prefill cost to.")] = None,
    copy_json: Annotated[Path, typer.Option(help="Copy benchmark results (L2 bandwidth).")] =
        Path("bench_results/copy.json"),
    l3_json: Annotated[Path, typer.Option(help="L3 benchmark results (L3 bandwidth).")] =
        Path("bench_results/l3.json"),
    page_bytes: Annotated[int, typer.Option(help="KV bytes per page (0: from --model).")] = 0,
    model: Annotated[Path | None, typer.Option(
        help="Model directory whose config.json gives the KV bytes per page.")] = None,
    dtype_bytes: Annotated[int, typer.Option(help="Bytes per KV element for --model.")] = 2,
    out: Annotated[Path, typer.Option(help="Directory for simulate.json and simulate.png.")] =
        Path("bench_results/simulate"),
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Replay a trace through the real HiRadixTree for a grid of L1/L2/L3 sizes."""
    from hicache.integration.bench.simulate import (
        Grid,
        calibrate,
        headroom,
        model_page_bytes,
        parse_sizes,
        parse_switches,
        plot,
        render_table,
        run_grid,
        smallest_sizes,
    )
    from hicache.integration.bench.trace import TraceError
    from hicache.integration.bench.trace_formats import load_trace

    try:
        records = load_trace(trace, trace_format, page_size=page_size, limit=limit,
                             time_scale=time_scale, session_gap_s=session_gap)
        policies = tuple(p.strip() for p in policy.split(",") if p.strip())
        grid = Grid(
            l1_blocks=parse_sizes(l1_blocks, "--l1-blocks"),  # type: ignore[arg-type]
            l2_pages=parse_sizes(l2_pages, "--l2-pages"),  # type: ignore[arg-type]
            l3_pages=parse_sizes(l3_pages, "--l3-pages", allow_none=True),
            write_policies=policies, block_size=block_size, page_size=page_size,
            prefetch_threshold=prefetch_threshold,
            evictions=tuple(e.strip() for e in eviction.split(",") if e.strip()),
            hints=parse_switches(hints, "--hints"), tlru_tail_pages=tlru_tail_pages)
        configs = grid.configs()
    except (TraceError, ValueError) as e:
        _fail(str(e))
    if not configs:
        _fail("the grid is empty (with --l2-pages 0 only, --l3-pages must include none)")
    if not page_bytes and model is not None:
        page_bytes = model_page_bytes(model, page_size, dtype_bytes)
    cost = calibrate(bench_json=calibrate_from, copy_json=copy_json, l3_json=l3_json,
                     page_bytes=page_bytes, page_size=page_size)
    try:
        rows = run_grid(records, grid, cost, progress=progress)
    except ValueError as e:
        _fail(str(e))
    out.mkdir(parents=True, exist_ok=True)
    gaps = headroom(rows)
    smallest = smallest_sizes(rows, target_hit_rate) if target_hit_rate is not None else []
    (out / "simulate.json").write_text(json.dumps(
        {"trace": str(trace), "requests": len(records), "cost_model": {
            k: v for k, v in cost.__dict__.items()}, "rows": rows, "headroom": gaps,
         "smallest_sizes": smallest}, indent=2))
    png = plot(rows, out / "simulate.png")
    console = Console()
    console.print(render_table(rows, cost))
    for g in gaps:
        console.print(
            f"headroom at L1 {g['l1_blocks']} / L2 {g['l2_pages']} / L3 {g['l3_pages']}: "
            f"LRU (hints {g['lru_hints']}) {100 * g['lru_hit_total']:.1f}%, oracle (hints "
            f"{g['oracle_hints']}) {100 * g['oracle_hit_total']:.1f}%: "
            f"{g['headroom_points']:+.1f} points", highlight=False)
    for s in smallest:
        where = (f"L1 {s['l1_blocks']} / L2 {s['l2_pages']} / L3 {s['l3_pages']} "
                 f"({100 * s['hit_total']:.1f}%)" if s["hit_total"] is not None
                 else "no size of the grid")
        console.print(f"smallest reaching {100 * s['target']:.0f}% cached, {s['write_policy']}"
                      f" / {s['eviction']} / hints {s['hints']}: {where}", highlight=False)
    for key, src in cost.sources.items():
        console.print(f"  {key} = {getattr(cost, key)!r}  ({src})", highlight=False)
    console.print(f"wrote {out / 'simulate.json'}, {png}")


profile_app = typer.Typer(
    help="Read step profiles (a server started with HICACHE_PROFILE=FILE): where each "
         "engine step's time went, HiCache against a baseline.",
    no_args_is_help=True,
)

ProfileFiles = Annotated[list[Path], typer.Argument(
    exists=True, dir_okay=False, help="Profile files; the first is the baseline.")]


def _load_profiles(files: list[Path], names: str | None) -> list[Any]:
    from hicache.integration.bench.profile_report import load

    labels = [n.strip() for n in names.split(",")] if names else [None] * len(files)
    if len(labels) != len(files):
        _fail(f"--names: {len(labels)} names for {len(files)} files")
    try:
        return [load(f, n) for f, n in zip(files, labels, strict=True)]
    except ValueError as e:
        _fail(str(e))


@profile_app.command("summary")
def profile_summary_cmd(
    files: ProfileFiles,
    names: Annotated[str | None, typer.Option(help="Comma-separated labels, one per file.")]
        = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summaries as JSON.")]
        = False,
) -> None:
    """Per-step means and per-request latencies, side by side with ratios to the first."""
    from hicache.integration.bench.profile_report import compare_table, summarize

    sums = [summarize(p) for p in _load_profiles(files, names)]
    if json_out:
        Console().print_json(data=sums)
    else:
        print(compare_table(sums))


@profile_app.command("plot")
def profile_plot_cmd(
    files: ProfileFiles,
    names: Annotated[str | None, typer.Option(help="Comma-separated labels, one per file.")]
        = None,
    out: Annotated[Path, typer.Option(help="PNG to write.")] = Path("bench_results/profile.png"),
) -> None:
    """Steps over time and where a step's time goes, as a PNG."""
    from hicache.integration.bench.profile_report import plot

    print(plot(_load_profiles(files, names), out))


def register(app: typer.Typer) -> None:
    """Add ``bench``, ``profile`` and ``simulate`` to the top-level ``hicache`` app."""
    app.add_typer(bench_app, name="bench")
    app.add_typer(profile_app, name="profile")
    app.command("simulate")(simulate_cmd)
