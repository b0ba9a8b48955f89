"""integration/bench/micro/rounds.py: case names checked against the allowed ones, and
every case run in turn, round after round."""

from __future__ import annotations

import argparse

import pytest

from hicache.integration.bench.micro.rounds import alternate, pick_cases


def test_cases_keep_their_order_and_an_unknown_one_names_the_allowed(capsys):
    p = argparse.ArgumentParser()
    assert pick_cases(p, "b,,a", ["a", "b"]) == ["b", "a"]
    with pytest.raises(SystemExit):
        pick_cases(p, "a,zz", {"a": 1, "b": 2})
    err = capsys.readouterr().err
    assert "--cases: unknown ['zz']; allowed: a, b" in err


def test_rounds_alternate_the_cases_and_keep_their_rows(capsys):
    rows = alternate(["x", "y"], 2, lambda r, n: {"round": r, "case": n})
    assert rows == [{"round": 1, "case": "x"}, {"round": 1, "case": "y"},
                    {"round": 2, "case": "x"}, {"round": 2, "case": "y"}]
    assert "[4/4] round 2: y ..." in capsys.readouterr().out
