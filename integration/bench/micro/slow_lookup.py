"""What a slow L3 lookup costs a batch: one long decode plus fresh prompts, submitted
together, with a file L3 whose ``exists_prefix`` sleeps ``--delay`` seconds, looked up in
the background (probe threads) and inline on vLLM's scheduling thread, against the
same engine with an instant lookup, in one run.

The store is this module's ``SlowFileBackend`` (a file backend that sleeps in
``exists_prefix``), loaded as a ``dynamic`` backend. With lookups on vLLM's scheduling
thread, each fresh prompt's lookup delays every running request in turn; with
background lookups the batch should pay about one lookup latency at most. Prints the wall times, the extra time in lookup
latencies and whether the tokens matched the instant run's.

    python -m hicache.integration.bench.micro.slow_lookup [--delay 1.0] [--prompts 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from hicache.tiers.l3.base import ReadBatch, StorageConfig
from hicache.tiers.l3.file.backend import FileBackend


class SlowFileBackend(FileBackend):
    """The file backend, with ``slow_exists_s`` of sleep in every ``exists_prefix`` and
    ``slow_get_s`` in every read batch (arrival_prefetch.py)."""

    def __init__(self, config: StorageConfig) -> None:
        extra = dict(config.extra_config)
        self.delay = float(extra.pop("slow_exists_s", 0.0))
        self.get_delay = float(extra.pop("slow_get_s", 0.0))
        # False: the scheduler asks this store inline (tiers/controller/fetches.py)
        background = bool(extra.pop("concurrent_lookups", True))
        super().__init__(dataclasses.replace(config, extra_config=extra))
        self.capabilities = dataclasses.replace(self.capabilities,
                                                concurrent_lookups=background)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        time.sleep(self.delay)
        return super().exists_prefix(keys)

    def read(self, batch: ReadBatch) -> list[bool]:
        time.sleep(self.get_delay)
        return super().read(batch)


def run_once(model: str, delay: float, background: bool, prompts: list[list[int]],
             long_prompt: list[int], args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    from hicache.integration.vllm.engine import EngineSpec, close_llm, greedy_params, open_llm

    with tempfile.TemporaryDirectory() as l3:
        spec = EngineSpec(
            model=model, block_size=32, max_model_len=4096, max_num_seqs=8, dtype="bfloat16",
            in_process=True,
            hicache={"hicache_size": 0.5, "hicache_storage_backend": "dynamic",
                     "hicache_storage_backend_extra_config": {
                         "module_path": __name__, "class_name": "SlowFileBackend",
                         "path": l3, "slow_exists_s": delay,
                         "concurrent_lookups": background}})
        llm = open_llm(spec)
        try:
            params: list[Any] = [greedy_params(args.long_tokens)]
            params += [greedy_params(args.answer_tokens)] * len(prompts)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in [long_prompt, *prompts]],
                                params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        finally:
            close_llm(llm)
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> None:
    from hicache.integration.bench.gpu.e2e import prompt_tokens
    from hicache.integration.models.tiny_model import ensure_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--delay", type=float, default=1.0, help="seconds per exists_prefix")
    p.add_argument("--prompts", type=int, default=6, help="fresh prompts")
    p.add_argument("--prompt-tokens", type=int, default=1536)
    p.add_argument("--long-tokens", type=int, default=256, help="the long decode's tokens")
    p.add_argument("--answer-tokens", type=int, default=16)
    args = p.parse_args(argv)
    model = str(ensure_tiny_model("test"))
    prompts = [prompt_tokens(args.prompt_tokens, 100 + i, 2000) for i in range(args.prompts)]
    long_prompt = prompt_tokens(64, 7, 2000)
    fast, want = run_once(model, 0.0, True, prompts, long_prompt, args)
    print(f"instant lookups: {fast:.2f} s")
    for background in (True, False):
        slow, got = run_once(model, args.delay, background, prompts, long_prompt, args)
        extra = (slow - fast) / args.delay if args.delay else 0.0
        how = "background" if background else "inline"
        print(f"{args.delay:.1f} s lookups, {how}: {slow:.2f} s = +{extra:.2f} lookup "
              f"latencies ({args.prompts} fresh prompts, one {args.long_tokens}-token "
              f"decode); tokens identical: {got == want}")

if __name__ == "__main__":
    main()
