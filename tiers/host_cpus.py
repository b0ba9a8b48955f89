"""CPU lists and the calling thread's CPU affinity, for the host's threads.

Contract:
- ``parse_cpu_list("0-3,8")`` -> frozenset of ints (Linux's cpulist format);
  ``ValueError`` naming the bad part. ``format_cpus`` writes a set back in that
  form ("" when empty). ``read_cpus(path)`` reads such a file (/sys), None when
  it cannot be read or parsed.
- ``pin_current_thread(cpus)``: restricts the calling thread to ``cpus`` (the
  kernel keeps those the process's cpuset allows); False, and nothing changed,
  when none of them is allowed or ``cpus`` is empty. ``running_on(cpus)``: the
  same for a block, the thread's own affinity restored after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (Linux's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or range (like 2 or 4-7)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a CPU number or range (like 2 or 4-7)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def read_cpus(path: Path) -> frozenset[int] | None:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


def pin_current_thread(cpus: frozenset[int]) -> bool:
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # none of them in this process's cpuset
        logger.warning("HiCache: cannot run a helper thread on CPUs %s (%s); it stays on %s",
                       sorted(cpus), exc, sorted(os.sched_getaffinity(0)))
        return False
    return True


@contextlib.contextmanager
def running_on(cpus: frozenset[int]) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    pinned = pin_current_thread(cpus)
    try:
        yield
    finally:
        if pinned:
            os.sched_setaffinity(0, before)
