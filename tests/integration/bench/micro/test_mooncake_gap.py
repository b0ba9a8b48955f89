"""The Mooncake read-gap diagnostic runs every way and schedule against a real master,
reads every page back bit-exact (its own assertion) and reports a rate for each."""

from __future__ import annotations

from hicache.integration.bench.micro.mooncake_gap import profile


def test_every_way_and_schedule_reports_a_rate():
    rates = profile(1 << 20, 8 << 20, repeats=1, group_mib=[2])
    assert set(rates) == {"raw", "bare", "ours", "ours, no check", "hash",
                          "grouped 2 MiB", "pipelined 2 MiB", "ranged 2 MiB", "staged 2 MiB"}
    assert all(rate > 0 for rate in rates.values())
