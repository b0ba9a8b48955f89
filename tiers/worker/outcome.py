"""What one rank's jobs owe vLLM and the scheduler after its steps, collected until taken.

Contract:
- Plain state, shared by the worker's jobs (loads.py, store_queue.py,
  fetch_endings.py), which add to it, and taken by the worker facade
  (core.py): vLLM gets the released (finished_sending) and received
  (finished_recving) requests, the blocks to recompute (``load_errors``),
  and, with several KV-cache groups, the requests whose load failed
  (``failed_recv``); the scheduler gets the bad slots, each ended fetch's
  page count (``fetched``) and the last plan whose stores are done
  (``done_seq``), through the step report (report.py).
- ``take_*`` hand a collection over and start a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.tiers.index.plans import NULL_BLOCK_ID


@dataclass
class StepOutcome:
    """What the jobs collected since it was last taken (see the module docstring)."""

    load_errors: set[int] = field(default_factory=set)
    failed_recv: set[str] = field(default_factory=set)
    bad_slots: set[int] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    fetched: dict[str, list[int]] = field(default_factory=dict)
    # The highest plan ``seq`` whose stores (and every earlier plan's) are done.
    done_seq: int = 0

    def take_load_errors(self) -> set[int]:
        """Blocks vLLM recomputes; the null block (tokens out of a sliding window)
        is never one (vLLM would recompute every request that holds it)."""
        errors, self.load_errors = self.load_errors, set()
        errors.discard(NULL_BLOCK_ID)
        return errors

    def take_failed_recv(self) -> set[str]:
        failed, self.failed_recv = self.failed_recv, set()
        return failed

    def take_released(self) -> set[str]:
        released, self.released = self.released, set()
        return released

    def take_received(self) -> set[str]:
        received, self.received = self.received, set()
        return received

    def take_for_report(self) -> tuple[set[int], dict[str, list[int]]]:
        """The bad slots and ended fetches, for the step report."""
        taken = self.bad_slots, self.fetched
        self.bad_slots, self.fetched = set(), {}
        return taken
