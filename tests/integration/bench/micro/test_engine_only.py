"""integration/bench/micro/engine_only.py without an engine: its load, its ratios and
its table (the engine runs are the benchmark's, docs/benchmarks.md)."""

from __future__ import annotations

import argparse

import pytest

from hicache.integration.bench.micro.engine_only import add_ratios, main, prompts, table


def _args(**kw: int) -> argparse.Namespace:
    base = {"num_prompts": 40, "num_prefixes": 3, "prefix_len": 64, "suffix_len": 8,
            "seed": 0}
    return argparse.Namespace(**{**base, **kw})


def test_every_prompt_is_one_of_the_prefixes_plus_its_own_suffix():
    load = prompts(_args())
    assert len(load) == 40 and all(len(p) == 72 for p in load)
    heads = {tuple(p[:64]) for p in load}
    assert len(heads) == 3  # every prefix used, no other
    assert len({tuple(p[64:]) for p in load}) == 40
    assert load == prompts(_args())  # seeded: every case gets the same load
    assert load != prompts(_args(seed=1))


def test_ratios_are_per_round_against_the_floor_and_recompute():
    rows = [{"round": 1, "case": "null", "status": "ok", "req_per_s": 20.0, "cached_share": .9},
            {"round": 1, "case": "null-small-l1", "status": "ok", "req_per_s": 8.0,
             "cached_share": .2},
            {"round": 1, "case": "hicache-small-l1", "status": "ok", "req_per_s": 18.0,
             "cached_share": .9},
            {"round": 2, "case": "null", "status": "ok", "req_per_s": 10.0, "cached_share": .9},
            {"round": 2, "case": "hicache-small-l1", "status": "ok", "req_per_s": 9.0,
             "cached_share": .9},
            {"round": 2, "case": "null-small-l1", "status": "failed (exit 1)"}]
    add_ratios(rows)
    assert rows[2]["x_floor"] == pytest.approx(0.9)
    assert rows[2]["x_recompute"] == pytest.approx(2.25)
    assert rows[4]["x_floor"] == pytest.approx(0.9) and "x_recompute" not in rows[4]
    text = table(rows)
    assert "| 2 | null-small-l1 | failed (exit 1) |" in text
    assert "hicache-small-l1 x_floor: median 0.900" in text
    assert "hicache-small-l1 x_recompute: median 2.250" in text


def test_an_unknown_case_is_refused_with_the_allowed_names(capsys):
    with pytest.raises(SystemExit):
        main(["--cases", "null,bogus"])
    err = capsys.readouterr().err
    assert "bogus" in err and "hicache-small-l1" in err
