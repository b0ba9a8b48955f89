"""``python -m hicache.integration.bench.peers``: our tiers vs SGLang and LMCache, side by side.

Compares (a) HiRadixTree with SGLang's RadixCache, (b) our file L3 backend
with SGLang's HiCacheFile, (c) our L2 / file-L3 store and retrieve paths with
LMCache's engine (local_cpu, local_disk), on one seeded workload. Each peer
runs in its own venv built by ``bash integration/bench/peers/setup_venvs.sh``; a
missing venv or a failing peer gives "not run: <reason>" rows. Prints a
table, writes ``<out>/peers.json`` and ``<out>/peers.png``; exits 0 unless
our own side failed (a peer that could not run is reported, not fatal).

    python -m hicache.integration.bench.peers [--out bench_results] [--quick]
        [--peers sglang,lmcache] [--parts radix,file,kv] [--repeats N]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from hicache.integration.bench.peers.ours import PARTS
from hicache.integration.bench.peers.runner import (
    DEFAULT_VENVS,
    PEERS,
    Options,
    print_table,
    run,
    write_outputs,
)


def _names(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.split(",") if x)
        bad = [x for x in names if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; allowed: {list(allowed)}")
        return names

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hicache.integration.bench.peers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--quick", action="store_true", help="tiny workload (seconds; for tests)")
    p.add_argument("--peers", type=_names(tuple(PEERS)), default=tuple(PEERS),
                   help="peers to run (default: all); parts of others say 'not run'")
    p.add_argument("--parts", type=_names(PARTS), default=PARTS,
                   help="radix (vs SGLang), file (vs SGLang), kv (vs LMCache)")
    p.add_argument("--venvs", type=Path, default=DEFAULT_VENVS,
                   help="where setup_venvs.sh built the peer venvs")
    p.add_argument("--repeats", type=int, default=None, help="repeats per operation (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the workload, store files and peer logs here (default: temp dir)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per peer run, seconds")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    opts = Options(out=args.out, quick=args.quick, peers=args.peers, parts=args.parts,
                   venvs=args.venvs, seed=args.seed, repeats=args.repeats,
                   workdir=args.workdir, timeout_s=args.timeout, plot=not args.no_plot)
    result = run(opts)
    print_table(result)
    paths = write_outputs(result, opts.out, opts.plot)
    print("wrote " + " and ".join(str(x) for x in paths))
    return 1 if result["ours_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
