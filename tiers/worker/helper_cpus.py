"""Which CPUs HiCache's worker threads run on beside vLLM's forward pass.

See DESIGN.md "Processes and threads".

vLLM's CPU engine pins each rank's forward thread (and its OpenMP team) to
the cores of ``VLLM_CPU_OMP_THREADS_BIND`` ("auto": the cores of one NUMA node
per rank, less those it reserves for the engine core and the API server). A
thread inherits the affinity of the thread that starts it, so HiCache's L3
threads, started by the forward thread, would share its cores and take them
from the pass. They run on the cores vLLM leaves to the other processes
instead; only where there are none do they share the forward's cores (and
then their backups wait for the gaps between passes, forward_gate.py).

Contract:
- ``parse_cpu_list("0-3,8")`` -> frozenset of ints; ``ValueError`` naming the
  bad part. ``format_cpus`` writes a set back in that form ("" when empty).
- ``place_helpers(setting, forward, omp_bind, online, node_cpus)`` (pure):
  ``setting`` is ``hicache_helper_cpus``: "auto", "inherit" or a CPU list;
  ``forward`` the forward thread's CPUs; ``omp_bind`` vLLM's
  ``VLLM_CPU_OMP_THREADS_BIND`` (None: unset, i.e. "auto"); ``online`` the
  host's CPUs; ``node_cpus`` each NUMA node's CPUs (empty: unknown). Returns a
  ``HelperPlacement``: "inherit" pins nothing; a list pins there; "auto" pins
  to the CPUs of the forward's NUMA nodes that no rank's forward is bound to
  (every list of an explicit bind; this rank's own under "auto", the others
  being on other nodes), and to nothing when vLLM does not bind ("nobind"),
  the forward may run on every CPU, or none is left.
- ``HelperPlacement.shares_forward``: whether the helper threads may run on a
  CPU the forward pass uses (nothing pinned, or a list that overlaps it).
- ``host_placement(setting, on_cpu)``: ``place_helpers`` for this process, read
  from the calling thread (vLLM's forward thread), the environment and /sys; a
  GPU engine ("auto", ``on_cpu`` False) pins nothing: its forward pass is on the
  device, and vLLM does not pin its host threads.
- ``pin_current_thread(cpus)``: restricts the calling thread to ``cpus`` (the
  kernel keeps those the process's cpuset allows); False, and nothing changed,
  when none of them is allowed or ``cpus`` is empty. ``running_on(cpus)``: the
  same for a block, the thread's own affinity restored after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HELPER_CPU_MODES = ("auto", "inherit")


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


def check_setting(value: str) -> str:
    """``hicache_helper_cpus``'s value, or ``ValueError`` saying what it allows."""
    if value in HELPER_CPU_MODES:
        return value
    try:
        parse_cpu_list(value)
    except ValueError as exc:
        raise ValueError(f"must be one of {', '.join(HELPER_CPU_MODES)} or a CPU list "
                         f"such as '2-3,6': {exc}") from None
    return value


@dataclass(frozen=True)
class HelperPlacement:
    """Where the helper threads run: ``cpus`` (empty: where they are started)."""

    cpus: frozenset[int]
    forward: frozenset[int]
    why: str

    @property
    def shares_forward(self) -> bool:
        return not self.cpus or bool(self.cpus & self.forward)


def place_helpers(setting: str, forward: frozenset[int], omp_bind: str | None,
                  online: frozenset[int],
                  node_cpus: Mapping[int, frozenset[int]]) -> HelperPlacement:
    if setting == "inherit":
        return HelperPlacement(frozenset(), forward, "hicache_helper_cpus is 'inherit'")
    if setting != "auto":
        return HelperPlacement(parse_cpu_list(setting), forward, "hicache_helper_cpus")
    bind = (omp_bind or "auto").strip()
    if bind == "nobind":
        return HelperPlacement(frozenset(), forward, "vLLM binds no forward thread (nobind)")
    if not forward or forward >= online:
        return HelperPlacement(frozenset(), forward, "the forward pass may run on every CPU")
    bound = set(forward)
    if bind != "auto":
        for ranks_cpus in bind.split("|"):
            try:
                bound |= parse_cpu_list(ranks_cpus)
            except ValueError:
                return HelperPlacement(frozenset(), forward,
                                       f"VLLM_CPU_OMP_THREADS_BIND={bind!r} is not CPU lists")
    near = set(online)
    nodes = [cpus for cpus in node_cpus.values() if cpus & forward]
    if nodes:
        near = set().union(*nodes) & online
    spare = frozenset(near - bound)
    if not spare:
        return HelperPlacement(frozenset(), forward,
                               "every CPU near the forward pass runs a forward pass")
    return HelperPlacement(spare, forward, "the CPUs vLLM left beside its forward pass")


def _read_cpus(path: Path) -> frozenset[int] | None:
    try:
        return parse_cpu_list(path.read_text())
    except (OSError, ValueError):
        return None


def host_placement(setting: str, on_cpu: bool) -> HelperPlacement:
    forward = frozenset(os.sched_getaffinity(0))
    if setting == "auto" and not on_cpu:
        return HelperPlacement(frozenset(), forward, "the forward pass runs on a GPU")
    sys_cpu = Path("/sys/devices/system")
    online = _read_cpus(sys_cpu / "cpu" / "online") or frozenset(range(os.cpu_count() or 1))
    nodes: dict[int, frozenset[int]] = {}
    for node in sorted(sys_cpu.glob("node/node[0-9]*")):
        cpus = _read_cpus(node / "cpulist")
        if cpus:
            nodes[int(node.name[4:])] = cpus
    return place_helpers(setting, forward, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                         online, nodes)


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
