"""Cases run in alternating rounds, the way the micro benchmarks compare servers.

Contract:
- ``pick_cases(parser, spec, allowed)``: the comma-separated case names of
  ``spec``, in order; an unknown one ends the program through
  ``parser.error``, naming the allowed ones.
- ``alternate(names, rounds, run)``: ``run(round, name)`` for every name in
  turn, ``rounds`` times (rounds numbered from 1), so that the machine's
  drift spreads over every case; prints each run's start and row; returns
  the rows in run order.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any


def pick_cases(parser: argparse.ArgumentParser, spec: str, allowed: Iterable[str]) -> list[str]:
    known = list(allowed)
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; allowed: {', '.join(known)}")
    return names


def alternate(names: list[str], rounds: int,
              run: Callable[[int, str], dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    runs = [(r, n) for r in range(1, rounds + 1) for n in names]
    for i, (round_, name) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] round {round_}: {name} ...", flush=True)
        rows.append(run(round_, name))
        print(f"    {rows[-1]}", flush=True)
    return rows
