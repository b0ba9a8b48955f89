"""integration/bench/micro/evict_scale.py: both ways evict the same pages (the run
checks it) and every L2 size gets its row."""

from hicache.integration.bench.micro import evict_scale


def test_two_sizes_give_two_rows_of_figures(capsys):
    evict_scale.main(["--slots", "300,900", "--stores", "30", "--prefix-pages", "8"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["300", "900"]
    for row in rows:
        leaves, kept, scan, ratio = (float(c.replace(",", "")) for c in row.split("|")[2:6])
        assert leaves > 0 and kept > 0 and scan > 0 and ratio > 0
