"""The command line every GPU runner shares: ``run`` (the parent: every case in its own
child process, then the report) and ``case NAME`` (one child, writing its result as
JSON to ``--result``).

Contract: ``main_for(...)`` parses ``argv`` with the runner's own shared options
(``add_shared``, given to both sub-commands) and extras for either side, refuses an
unknown case naming the allowed ones, then calls ``run(args)`` or writes
``run_case(name, args)`` to ``--result``. ``check(args, error)`` may refuse more.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

Adder = Callable[[argparse.ArgumentParser], None]


def _none(_: argparse.ArgumentParser) -> None:
    pass


def main_for(
    argv: list[str] | None, *, description: str, cases: Mapping[str, Any],
    default_cases: Iterable[str], out_default: str, add_shared: Adder,
    run: Callable[[argparse.Namespace], Any],
    run_case: Callable[[str, argparse.Namespace], dict[str, Any]],
    add_run: Adder = _none, add_case: Adder = _none,
    check: Callable[[argparse.Namespace, Callable[[str], Any]], None] | None = None,
) -> None:
    p = argparse.ArgumentParser(description=description)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every case, then the report")
    r.add_argument("--preset", default="gpu8b")
    r.add_argument("--cases", type=lambda s: s.split(","), default=list(default_cases))
    r.add_argument("--out", default=out_default)
    r.add_argument("--deadline", type=float, default=3600.0, help="seconds for all cases")
    r.add_argument("--case-timeout", type=float, default=600.0)
    add_run(r)
    add_shared(r)
    c = sub.add_parser("case", help="one case (a child of run)")
    c.add_argument("name", choices=sorted(cases))
    c.add_argument("--model", required=True)
    c.add_argument("--result", required=True)
    add_case(c)
    add_shared(c)
    args = p.parse_args(argv)
    if check is not None:
        check(args, p.error)
    if args.cmd == "run":
        unknown = [n for n in args.cases if n not in cases]
        if unknown:
            p.error(f"unknown cases {unknown}; allowed: {sorted(cases)}")
        run(args)
    else:
        Path(args.result).write_text(json.dumps(run_case(args.name, args)))
