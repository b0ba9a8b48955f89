"""L1 capacity of a hybrid model with HiCache: vLLM's hybrid KV cache manager on vs off.

Starts the CPU engine twice with HiCache configured and the same KV memory
(``VLLM_CPU_KVCACHE_SPACE``, GiB): once as HiCache runs it now (the manager
on: a KV-cache group per layer kind) and once with
``--disable-hybrid-kv-cache-manager`` (what vLLM did while HiCache was not
``SupportsHMA``). It reads each engine's own ``kv_cache_config`` and prints
how many ``--max-model-len``-token requests fit at once: a full-attention
group holds every block of a request, a sliding-window group the blocks of
its window (vLLM's own "Maximum concurrency" log line ignores that). Each
engine runs in a subprocess of its own.

    python -m hicache.integration.bench.micro.l1_capacity [--preset gemma3] [--kv-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(preset: str, hybrid: bool, max_model_len: int, block: int) -> dict:
    """One engine's groups and capacity (runs in the current process)."""
    from hicache.integration.models.tiny_model import ensure_tiny_model
    from hicache.integration.vllm.engine import EngineSpec, close_llm, open_llm

    extra = {} if hybrid else {"disable_hybrid_kv_cache_manager": True}
    llm = open_llm(EngineSpec(model=str(ensure_tiny_model(preset)), block_size=block,
                              max_model_len=max_model_len, in_process=True,
                              hicache={"hicache_size": 0.01}, extra_args=extra))
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        groups, per_request = [], 0
        for g in config.kv_cache_groups:
            spec = g.kv_cache_spec
            window = getattr(spec, "sliding_window", None)
            kind = type(spec).__name__
            groups.append(f"{kind} x{len(g.layer_names)} layers")
            if kind == "SlidingWindowSpec" and window:
                per_request += -(-(window - 1) // block) + 1
            else:
                per_request += -(-max_model_len // block)
        requests = config.num_blocks // per_request
        return {"hybrid_manager": hybrid, "groups": groups, "l1_blocks": config.num_blocks,
                "blocks_per_request": per_request, "requests": requests,
                "tokens": requests * max_model_len}
    finally:
        close_llm(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gemma3")
    parser.add_argument("--kv-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = measure(args.preset, args.one == "on", args.max_model_len, args.block_size)
        print("RESULT " + json.dumps(result))
        return
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib))
    rows = []
    for mode in ("on", "off"):
        out = subprocess.run(
            [sys.executable, "-m", __spec__.name if __spec__ else __name__, "--one", mode,
             "--preset", args.preset, "--max-model-len", str(args.max_model_len),
             "--block-size", str(args.block_size)],
            env=env, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(next(line for line in out.splitlines()
                                    if line.startswith("RESULT "))[7:]))
    print(f"{args.preset}, {args.kv_gib} GiB of KV, {args.max_model_len}-token requests")
    for r in rows:
        print(f"  hybrid manager {'on ' if r['hybrid_manager'] else 'off'}: "
              f"{', '.join(r['groups'])}; {r['l1_blocks']} blocks, "
              f"{r['blocks_per_request']} per request -> {r['requests']} requests, "
              f"{r['tokens']:,} tokens")
    print(f"  ratio on/off: {rows[0]['tokens'] / rows[1]['tokens']:.2f}x")


if __name__ == "__main__":
    main()
