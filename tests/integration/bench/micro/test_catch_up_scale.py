"""integration/bench/micro/catch_up_scale.py: every L2 page is backed up once (the
run checks it) and every L2 size gets its row."""

from hicache.integration.bench.micro import catch_up_scale


def test_two_sizes_give_two_rows_of_figures(capsys):
    catch_up_scale.main(["--slots", "300,900", "--prefix-pages", "8", "--in-flight", "16"])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["300", "900"]
    for row in rows:
        plans, mean, largest, total = (float(c.replace(",", "")) for c in row.split("|")[2:6])
        assert plans > 1 and 0 < mean <= largest and total > 0
