"""A clock the test moves by hand: every call returns ``now`` (no real time involved)."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
