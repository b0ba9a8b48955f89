"""SGLang HiCache on the lent GPU, on e2e.py's workload: returning-turn TTFT from its
device cache, its host tier (L2), its file storage (L3), and recompute, for the
side-by-side table with vLLM + HiCache.

Contract:
- Runs where the SGLang bundle (``bundle.py build --profile sglang``; device.sh
  ``sglang``) is first on PYTHONPATH and a CUDA GPU exists. sglang is imported inside
  ``run`` only: on machines without it, the pure helpers (workload, medians, report)
  import and are tested.
- One offline ``sglang.Engine`` (token ids in) with ``enable_hierarchical_cache``,
  page ``--page-size`` (16, vLLM's GPU block), the triton attention backend,
  pytorch sampling, no CUDA graphs (the bundle carries neither FA3 nor flashinfer's
  JIT sources), a device pool capped at ``--max-total-tokens`` (else a small model
  on a large GPU gets tens of millions of slots, and ratio 2 asks as much pinned host
  memory), ``--host-gb`` of host pool and the file storage backend in ``--l3-dir``.
- Workload, the token ids of e2e.py (``prompt_tokens``, same seeds): for each history
  length H and conversation c, turn 1 decodes ``--gen`` tokens greedily; then the
  history + its answer + a new 64-token question is sent in four states:
    ``floor``: right away (the device cache holds it);
    ``l2``: after a filler prompt long enough to push every page out of the capped
      device pool into the host tier;
    ``l3``: after ``flush_cache()`` (device and host emptied) and a pause for the
      storage backups to land (SGLang writes them in the background; a benchmark
      pause, not a check);
    ``recompute``: a fresh prompt of the same length, never seen.
  A warm-up conversation runs first and is not reported (kernels compile, JIT).
- TTFT: seconds from submission to the first streamed chunk, median over
  conversations; the tier that served each prompt's cached tokens comes from
  ``meta_info.cached_tokens_details`` (device / host / storage).
- Outputs in ``--out``: ``results.json`` and ``report.md``.

    PYTHONPATH=<sglang site>:. python3 -m hicache.integration.bench.gpu.sglang_e2e run \\
        --out OUT --histories 8192,32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hicache.integration.bench.gpu.e2e import QUESTION_TOKENS, prompt_tokens

BRANCHES = ("floor", "l2", "l3", "recompute")


def conversations(histories: list[int], n: int, warmup: int) -> list[tuple[int, int]]:
    """(history, conversation) pairs, the warm-up (conversation -1) first."""
    out = [(warmup, -1)] if warmup else []
    return out + [(h, c) for h in histories for c in range(n)]


def returning_prompt(history: list[int], answer: list[int], seed: int, question: int,
                     vocab: int) -> list[int]:
    """e2e.py's returning turn: history, its answer, question ``question``."""
    return history + answer + prompt_tokens(QUESTION_TOKENS, seed * 10 + question, vocab)


def tiers(meta: dict[str, Any]) -> dict[str, int]:
    """Cached tokens per SGLang tier of one response (empty when it does not say)."""
    details = meta.get("cached_tokens_details") or {}
    if not isinstance(details, dict):
        return {}
    return {k: int(v) for k, v in details.items() if isinstance(v, int | float)}


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median TTFT per (history, branch), and its ratio to recompute."""
    out = []
    for h in sorted({r["history"] for r in rows if r["conv"] >= 0}):
        row: dict[str, Any] = {"history": h}
        for branch in BRANCHES:
            sel = [r for r in rows if r["history"] == h and r["conv"] >= 0
                   and r["branch"] == branch and r["ttft"] is not None]
            if sel:
                row[branch] = {"ttft_ms": 1000 * statistics.median(r["ttft"] for r in sel),
                               "cached": statistics.median(r["cached"] for r in sel),
                               "n": len(sel), "tiers": sel[-1].get("tiers", {})}
        base = row.get("recompute", {}).get("ttft_ms")
        for branch in BRANCHES:
            if base and branch in row:
                row[branch]["vs_recompute"] = row[branch]["ttft_ms"] / base
        out.append(row)
    return out


def report(results: dict[str, Any]) -> str:
    lines = ["# SGLang HiCache end-to-end", "", f"`{results['command']}`", "",
             f"SGLang {results.get('sglang_version')}, engine start "
             f"{results.get('start_seconds', 0):.1f} s", "",
             "| history | " + " | ".join(BRANCHES) + " |", "|---|" + "---|" * len(BRANCHES)]
    for row in results.get("table", []):
        cells = []
        for branch in BRANCHES:
            cell = row.get(branch)
            if cell is None:
                cells.append("")
                continue
            ratio = f" ({cell['vs_recompute']:.2f}x)" if "vs_recompute" in cell else ""
            cells.append(f"{cell['ttft_ms']:.1f}{ratio} [{cell['cached']:.0f}: "
                         f"{cell['tiers']}]")
        lines.append(f"| {row['history']} | " + " | ".join(cells) + " |")
    if results.get("error"):
        lines += ["", "## Error", "", "```", results["error"], "```"]
    return "\n".join(lines) + "\n"


# ---- the run (GPU, sglang bundle) ---------------------------------------------


def _generate(engine: Any, prompt: list[int], gen: int, stream: bool) -> dict[str, Any]:
    """One greedy request. Streamed: TTFT at the first chunk (the output ids are then
    not kept: chunks may carry only their own tokens); else the whole answer."""
    params = {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    if stream:
        for chunk in engine.generate(input_ids=prompt, sampling_params=params, stream=True):
            if ttft is None:
                ttft = time.perf_counter() - t0
            last = chunk
    else:
        last = engine.generate(input_ids=prompt, sampling_params=params)
    meta = last.get("meta_info", {})
    return {"tokens": [] if stream else list(last.get("output_ids") or []), "ttft": ttft,
            "cached": int(meta.get("cached_tokens", 0)), "tiers": tiers(meta),
            "prompt_len": len(prompt)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import sglang

    from hicache.integration.models.tiny_model import ensure_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(ensure_tiny_model(args.preset))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    Path(args.l3_dir).mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "preset": args.preset,
                               "sglang_version": getattr(sglang, "__version__", "?"),
                               "rows": []}
    started = time.perf_counter()
    engine = sglang.Engine(
        model_path=model, dtype="bfloat16", page_size=args.page_size,
        attention_backend="triton", sampling_backend="pytorch", disable_cuda_graph=True,
        grammar_backend="none", max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction, enable_hierarchical_cache=True,
        hicache_size=args.host_gb, hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete", random_seed=0, log_level="warning")
    results["start_seconds"] = time.perf_counter() - started
    filler_len = args.max_total_tokens - 2 * QUESTION_TOKENS - args.gen
    try:
        for h, c in conversations(args.histories, args.conversations, args.warmup):
            seed = h * 1000 + c
            history = prompt_tokens(h, seed, vocab)
            first = _generate(engine, history, args.gen, stream=False)
            results["rows"].append(dict(first, history=h, conv=c, branch="turn1"))
            answer = first["tokens"]
            for branch, question in (("floor", 1), ("l2", 2), ("l3", 3)):
                if branch == "l2":  # every page out of the capped device pool
                    _generate(engine, prompt_tokens(filler_len, seed * 7 + 1, vocab), 1,
                              stream=False)
                elif branch == "l3":
                    time.sleep(args.backup_pause)
                    engine.flush_cache()
                row = _generate(engine, returning_prompt(history, answer, seed, question,
                                                         vocab), args.gen, stream=True)
                results["rows"].append(dict(row, history=h, conv=c, branch=branch))
            fresh = prompt_tokens(h + len(answer) + QUESTION_TOKENS, seed * 7 + 2, vocab)
            row = _generate(engine, fresh, args.gen, stream=True)
            results["rows"].append(dict(row, history=h, conv=c, branch="recompute"))
            (out / "results.json").write_text(json.dumps(results, indent=1))
    except Exception as exc:  # noqa: BLE001 - keep what finished, say what broke
        import traceback

        results["error"] = "".join(traceback.format_exception(exc))[-4000:]
    finally:
        engine.shutdown()
    results["table"] = table(results["rows"])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    print(report(results), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--preset", default="gpu8b")
    r.add_argument("--out", default="bench_results/gpu-sglang")
    r.add_argument("--histories", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8192, 32768])
    r.add_argument("--conversations", type=int, default=2)
    r.add_argument("--gen", type=int, default=32)
    r.add_argument("--warmup", type=int, default=2048)
    r.add_argument("--page-size", type=int, default=16)
    r.add_argument("--max-total-tokens", type=int, default=40960,
                   help="device KV pool in tokens: one history and its turn")
    r.add_argument("--mem-fraction", type=float, default=0.6)
    r.add_argument("--host-gb", type=float, default=16.0)
    r.add_argument("--l3-dir", default="/tmp/hicache-sglang-l3")
    r.add_argument("--backup-pause", type=float, default=3.0,
                   help="seconds for SGLang's background storage backups before flush")
    args = p.parse_args(argv)
    import os

    # SGLang's file storage backend takes its folder from the environment.
    os.environ.setdefault("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", args.l3_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(args)


if __name__ == "__main__":
    main()
