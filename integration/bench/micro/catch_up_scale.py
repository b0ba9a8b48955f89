"""L3 catch-up as L2 grows: what one plan's catch-up costs the scheduler while L3 lags.

After an L3 is attached or flushed, every page L2 holds is missing from L3, and
the catch-up (tiers/controller/catch_up.py) backs them up a few at a time
(``--in-flight`` pages per plan, hottest first) in the plans of the steps that
follow. This builds the L2 part of the tree of a busy server (evict_scale.py's
``fill``: ``--prefixes`` shared prefixes of ``--prefix-pages`` pages,
conversations of ``--tail-pages`` pages hanging off them, until L2 holds
``--slots`` pages, none known in L3),
then runs plans until L3 holds every page: each plan's ``L3CatchUp.plan``
timed, its pages reported backed up before the next (the fastest an L3 can
go, so every plan has room). ``--touch`` pages of a random conversation are
used between two plans (a server keeps serving while L3 catches up).

Prints per L2 size the plans it took, the mean and largest time of one plan,
and the total: the scheduler spends this in ``build_connector_meta``, on the
critical path of the step it plans. Checks every page was backed up once.

    python -m hicache.integration.bench.micro.catch_up_scale [--slots 1000,4000,16000,64000]
"""

from __future__ import annotations

import argparse
import random
import time

from hicache.integration.bench.micro.evict_scale import fill, tree_args
from hicache.tiers.controller.catch_up import L3CatchUp
from hicache.tiers.controller.l2_manager import L2Manager
from hicache.tiers.controller.policies import AdmitAll
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.page_keys import PageKey


def _fill(args: argparse.Namespace, slots: int) -> tuple[L2Manager, list[list[PageKey]]]:
    l2 = L2Manager(slots, 1, SchedulerStats())
    _, paths = fill(l2.tree, args, slots)
    return l2, paths


def _catch_up(args: argparse.Namespace, slots: int) -> tuple[int, float, float]:
    """(plans, mean seconds, largest seconds) for one L2 size."""
    l2, paths = _fill(args, slots)
    catch_up = L3CatchUp(l2, AdmitAll(), SchedulerStats(), max_in_flight=args.in_flight)
    rng = random.Random(0)
    times: list[float] = []
    backed: set[PageKey] = set()
    while True:
        t0 = time.perf_counter()
        picked = catch_up.plan(io_idle=True)
        times.append(time.perf_counter() - t0)
        if not picked:
            break
        keys = [key for key, _ in picked]
        if backed.intersection(keys):
            raise SystemExit(f"L2 of {slots} pages: a page was backed up twice")
        backed.update(keys)
        l2.tree.mark_l3_keys(keys)
        catch_up.backed_up(keys)
        for _ in range(args.touch):
            l2.tree.match_prefix(rng.choice(paths))
    if len(backed) != l2.tree.total_pages():
        raise SystemExit(f"L2 of {slots} pages: {len(backed)} of "
                         f"{l2.tree.total_pages()} pages backed up")
    return len(times), sum(times) / len(times), max(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tree_args(p)
    p.add_argument("--in-flight", type=int, default=64,
                   help="catch-up pages per plan (the scheduler's default)")
    p.add_argument("--touch", type=int, default=1,
                   help="conversations used between two plans")
    args = p.parse_args(argv)
    print("| L2 pages | plans | mean us per plan | largest us | total ms |")
    print("|---:|---:|---:|---:|---:|")
    for slots in (int(x) for x in args.slots.split(",")):
        plans, mean_s, max_s = _catch_up(args, slots)
        print(f"| {slots:,} | {plans:,} | {mean_s * 1e6:.1f} | {max_s * 1e6:.1f} | "
              f"{mean_s * plans * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
