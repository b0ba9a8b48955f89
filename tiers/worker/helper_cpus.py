"""Which CPUs HiCache's worker threads run on beside vLLM's forward pass.

See DESIGN.md "Processes and threads".

vLLM's CPU engine runs each rank's forward pass on an OpenMP team pinned to
the cores of ``VLLM_CPU_OMP_THREADS_BIND`` ("auto": the cores of one NUMA node
per rank, less those it reserves for the engine core and the API server when
it has enough), one thread per core; the team's master is vLLM's forward
thread, which also does the step's serial Python work between passes. A
thread inherits the affinity of the thread that starts it, so HiCache's L3
threads, started by the forward thread, would share the master's core and
delay each next step. They run on cores no forward pass uses where there are
any; else on the team's other cores, which idle between passes (and then
their backups wait for those gaps, forward_gate.py).

Contract:
- ``omp_team(environ)``: the CPUs of this rank's OpenMP team as vLLM wrote
  them into the worker's environment (``GOMP_CPU_AFFINITY``, ``OMP_PLACES``
  or ``KMP_AFFINITY``'s proclist); None when none is set or readable.
- ``place_helpers(setting, master, team, omp_bind, online, node_cpus)``
  (pure): ``setting`` is ``hicache_helper_cpus``: "auto", "inherit" or a CPU
  list; ``master`` the forward thread's CPUs; ``team`` its OpenMP team's
  (None: the master's); ``omp_bind`` vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
  (None: unset, i.e. "auto"); ``online`` the host's CPUs; ``node_cpus`` each
  NUMA node's CPUs (empty: unknown); ``siblings`` each CPU's hyperthread
  siblings, itself included (empty: unknown). Returns a ``HelperPlacement``:
  "inherit" pins nothing; a list pins there; "auto" pins to the CPUs of the
  team's NUMA nodes that no rank's team is bound to (every list of an
  explicit bind; this rank's own under "auto", the others being on other
  nodes) and share no physical core with it, else to such CPUs that do
  (hyperthread siblings of the team's), else to the team's CPUs other than
  the master's, else nothing; nothing either when vLLM binds no thread
  ("nobind").
- ``HelperPlacement.shares_forward``: whether the helper threads may run on a
  core of the forward pass (nothing pinned, CPUs of its team or their
  hyperthread siblings): then backups wait for the gaps between passes.
- ``host_placement(setting, on_cpu)``: ``place_helpers`` for this process, read
  from the calling thread (vLLM's forward thread), the environment and /sys; a
  GPU engine ("auto", ``on_cpu`` False) pins nothing: its forward pass is on the
  device, and vLLM does not pin its host threads.
- CPU lists and the calling thread's pinning: tiers/host_cpus.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hicache.tiers.host_cpus import parse_cpu_list, read_cpus

HELPER_CPU_MODES = ("auto", "inherit")


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


def _cpu_terms(text: str) -> frozenset[int]:
    """GOMP_CPU_AFFINITY's terms, space or comma separated: ``a``, ``a-b``, ``a-b:stride``."""
    cpus: set[int] = set()
    for term in re.split(r"[\s,]+", text.strip()):
        if not term:
            continue
        span, _, stride = term.partition(":")
        lo, sep, hi = span.partition("-")
        first, last = int(lo), int(hi if sep else lo)
        cpus.update(range(first, last + 1, int(stride) if stride else 1))
    return frozenset(cpus)


def omp_team(environ: Mapping[str, str]) -> frozenset[int] | None:
    try:
        if environ.get("GOMP_CPU_AFFINITY"):
            return _cpu_terms(environ["GOMP_CPU_AFFINITY"]) or None
        if environ.get("OMP_PLACES", "").startswith("{"):
            cpus: set[int] = set()
            for place in re.findall(r"\{([^}]*)\}", environ["OMP_PLACES"]):
                for item in place.split(","):
                    start, _, count = item.strip().partition(":")
                    cpus.update(range(int(start), int(start) + int(count or 1)))
            return frozenset(cpus) or None
        found = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
        if found:
            return parse_cpu_list(found.group(1))
    except ValueError:
        return None
    return None


@dataclass(frozen=True)
class HelperPlacement:
    """Where the helper threads run: ``cpus`` (empty: where they are started)."""

    cpus: frozenset[int]
    team: frozenset[int]  # the forward pass's CPUs (its OpenMP team)
    why: str
    sibling_cpus: bool = False  # ``cpus`` are hyperthreads of the team's cores

    @property
    def shares_forward(self) -> bool:
        return not self.cpus or self.sibling_cpus or bool(self.cpus & self.team)


def place_helpers(setting: str, master: frozenset[int], team: frozenset[int] | None,
                  omp_bind: str | None, online: frozenset[int],
                  node_cpus: Mapping[int, frozenset[int]],
                  siblings: Mapping[int, frozenset[int]] | None = None) -> HelperPlacement:
    forward = master | (team or frozenset())
    if setting == "inherit":
        return HelperPlacement(frozenset(), forward, "hicache_helper_cpus is 'inherit'")
    if setting != "auto":
        return HelperPlacement(parse_cpu_list(setting), forward, "hicache_helper_cpus")
    bind = (omp_bind or "auto").strip()
    if bind == "nobind":
        return HelperPlacement(frozenset(), forward, "vLLM binds no forward thread (nobind)")
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
    shared = set().union(*(siblings.get(cpu, {cpu}) for cpu in bound)) if siblings else bound
    if spare - shared:
        return HelperPlacement(frozenset(spare - shared), forward, "cores no forward pass uses")
    if spare:
        return HelperPlacement(spare, forward, "hyperthreads of the forward pass's cores: "
                               "backups between passes", sibling_cpus=True)
    others = frozenset(forward - master)
    if others:
        return HelperPlacement(others, forward, "the forward pass's other cores: they "
                               "idle between passes, when backups run")
    return HelperPlacement(frozenset(), forward, "no core beside the forward thread's")


def host_placement(setting: str, on_cpu: bool) -> HelperPlacement:
    master = frozenset(os.sched_getaffinity(0))
    if setting == "auto" and not on_cpu:
        return HelperPlacement(frozenset(), master, "the forward pass runs on a GPU")
    sys_cpu = Path("/sys/devices/system")
    online = read_cpus(sys_cpu / "cpu" / "online") or frozenset(range(os.cpu_count() or 1))
    nodes: dict[int, frozenset[int]] = {}
    for node in sorted(sys_cpu.glob("node/node[0-9]*")):
        cpus = read_cpus(node / "cpulist")
        if cpus:
            nodes[int(node.name[4:])] = cpus
    siblings: dict[int, frozenset[int]] = {}
    for cpu in online:
        found = read_cpus(sys_cpu / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        if found:
            siblings[cpu] = found
    return place_helpers(setting, master, omp_team(os.environ),
                         os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), online, nodes, siblings)
