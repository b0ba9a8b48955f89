"""One rank's step report: what changed since the last one, for the scheduler and the metrics.

Contract:
- ``take`` returns the report (tiers/index/plans.py ``WorkerReport``) or
  None when nothing changed: bad slots and ended fetches (outcome.py),
  counter increments since the previous report, latency observations (copy
  time of the step's L2 loads and stores, time of each finished L3 fetch),
  this rank's changed gauges (queue depths, whether its L3 breaker is
  open), the last plan whose stores are done when that moved (stores across
  steps only), and the L3 keys its backups stored with how many L3-changing
  commands it had applied then (tiers/index/commands.py). It feeds both
  the admin view and vLLM's stats (connector/vllm_metrics.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from hicache.tiers.index.plans import WorkerReport
from hicache.tiers.worker.outcome import StepOutcome
from hicache.tiers.worker.stats import CounterDeltas, WorkerStats


class StepReporter:
    """Builds this rank's reports (see the module docstring)."""

    def __init__(self, rank: int, *, report_done: bool) -> None:
        self.rank = rank
        self._report_done = report_done
        self._deltas = CounterDeltas()
        self._gauges_reported: dict[str, float] = {}
        self._done_reported = 0

    def take(self, outcome: StepOutcome, stats: WorkerStats, counters: Mapping[str, float],
             gauges: Mapping[str, float], stored: list[bytes], l3_changes: int,
             ) -> WorkerReport | None:
        deltas = self._deltas.take(counters)
        observations = stats.take_observations()
        changed = {k: v for k, v in gauges.items() if self._gauges_reported.get(k) != v}
        done_seq = outcome.done_seq
        done = ({self.rank: done_seq}
                if self._report_done and done_seq != self._done_reported else {})
        if not (outcome.bad_slots or outcome.fetched or deltas or changed or observations
                or done or stored):
            return None
        self._gauges_reported.update(changed)
        self._done_reported = done_seq
        bad_slots, fetched = outcome.take_for_report()
        rank = self.rank
        return WorkerReport(bad_slots, fetched, deltas, {rank: changed} if changed else {},
                            observations, done, {rank: stored} if stored else {},
                            {rank: l3_changes} if stored else {})
