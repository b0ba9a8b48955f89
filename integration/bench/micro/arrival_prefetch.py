"""What prefetch at arrival buys: returning conversations whose histories only L3 holds,
submitted together to an engine with few run slots, with the prefetch on and off, against
recomputing them, in one run.

A first engine serves ``--conversations`` histories of ``--history`` tokens and backs
their pages up to a file L3. Each later engine (a fresh process state: empty L2) gets
the returning turns all at once, with ``max_num_seqs`` = ``--slots``, so most of them
queue, and an L1 of ``--l1-blocks`` (about two histories). The store is this package's
``SlowFileBackend``, sleeping ``--get-delay`` seconds in every read batch (a remote
store's latency). With the prefetch off, a request's pages are read only once vLLM
admits it and has given it L1 blocks, which it holds while it waits; with it on, every
queued request's pages are read into L2 while it waits, so it starts from L2.
Prints the batch's wall time and median TTFT (vLLM's own first-token latency) for
each case, their ratios to recompute and to each other, and whether the tokens match
the recompute run's.

    python -m hicache.integration.bench.micro.arrival_prefetch [--conversations 8]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def engine(model: str, l3: Path, *, slots: int, arrival: bool, get_delay: float,
           l1_blocks: int | None = None) -> Any:
    """An in-process engine whose L3 is slow_lookup's ``SlowFileBackend`` in ``l3``."""
    from hicache.integration.vllm.engine import EngineSpec, open_llm

    return open_llm(EngineSpec(
        model=model, block_size=32, max_model_len=2048, max_num_seqs=slots,
        num_blocks=l1_blocks,
        dtype="bfloat16", prefix_caching=False, in_process=True,
        extra_args={"disable_log_stats": False},
        hicache={"hicache_size": 0.5, "hicache_storage_backend": "dynamic",
                 "hicache_prefetch_at_arrival": arrival,
                 "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_backend_extra_config": {
                     "module_path": "hicache.integration.bench.micro.slow_lookup",
                     "class_name": "SlowFileBackend", "path": str(l3),
                     "slow_get_s": get_delay}}))


def serve(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, list[float],
                                                                    list[list[int]]]:
    """(wall seconds, TTFT of each request, tokens of each)."""
    from hicache.integration.vllm.engine import greedy_params

    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(tokens),
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    ttfts = [float(getattr(o.metrics, "first_token_latency", 0.0) or 0.0) for o in outs]
    return wall, ttfts, [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> None:
    from hicache.integration.bench.gpu.e2e import prompt_tokens
    from hicache.integration.models.tiny_model import ensure_tiny_model
    from hicache.integration.vllm.engine import close_llm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--history", type=int, default=1536, help="tokens of each history")
    p.add_argument("--slots", type=int, default=2, help="vLLM's max_num_seqs")
    p.add_argument("--l1-blocks", type=int, default=128,
                   help="vLLM's KV cache in 32-token blocks (128: about two histories; "
                   "0: vLLM's own sizing)")
    p.add_argument("--get-delay", type=float, default=0.1,
                   help="seconds of sleep per L3 read batch (32 pages)")
    p.add_argument("--answer-tokens", type=int, default=16)
    args = p.parse_args(argv)
    model = str(ensure_tiny_model("test"))
    histories = [prompt_tokens(args.history, 300 + i, 2000)
                 for i in range(args.conversations)]
    turn = [h + prompt_tokens(32, 900 + i, 2000) for i, h in enumerate(histories)]
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "written"
        llm = engine(model, written, slots=8, arrival=True, get_delay=0.0)
        try:
            serve(llm, histories, 1)
        finally:
            close_llm(llm)
        results: dict[str, tuple[float, list[float], list[list[int]]]] = {}
        cases = [("recompute", None), ("prefetch off", False), ("prefetch on", True)]
        for name, arrival in cases:
            l3 = Path(tmp) / name.replace(" ", "-")
            if arrival is None:
                l3.mkdir()  # an empty store: every history is recomputed
            else:
                shutil.copytree(written, l3)
            llm = engine(model, l3, slots=args.slots, arrival=bool(arrival),
                         get_delay=args.get_delay, l1_blocks=args.l1_blocks or None)
            try:
                results[name] = serve(llm, turn, args.answer_tokens)
            finally:
                close_llm(llm)
    base_wall, base_ttft, want = results["recompute"]
    base_med = statistics.median(base_ttft)
    print(f"{args.conversations} returning conversations of {args.history} tokens, "
          f"{args.slots} run slots, L1 {args.l1_blocks} blocks, L3 reads "
          f"{args.get_delay * 1000:.0f} ms per batch")
    print("| case | wall | x recompute | median TTFT | x recompute | tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (wall, ttfts, got) in results.items():
        med = statistics.median(ttfts)
        print(f"| {name} | {wall:.2f} s | {wall / base_wall:.2f} | {med * 1000:.0f} ms | "
              f"{med / base_med:.2f} | {'identical' if got == want else 'DIFFER'} |")
    off, on = results["prefetch off"], results["prefetch on"]
    print(f"prefetch on / off: wall {on[0] / off[0]:.2f}x, median TTFT "
          f"{statistics.median(on[1]) / statistics.median(off[1]):.2f}x")


if __name__ == "__main__":
    main()
