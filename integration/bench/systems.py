"""The systems ``hicache bench compare`` can launch, and the YAML config that names them.

A config fixes what every system shares — model, seed, L1 size (vLLM's
``num_gpu_blocks_override``), block/page size, the **memory budget** of the
host tier (HiCache's L2 ``hicache_size``, vLLM native offloading's
``kv_offloading_size``, LMCache's CPU size, SGLang's ``--hicache-size``) and
the workload — and lists the systems:

- ``vllm``: vLLM with its own prefix cache only (the baseline);
- ``hicache``: vLLM + HiCacheConnector, ``write_policy`` and optional ``l3``
  (``file`` or ``nixl``, in a new directory per run, removed by
  :func:`remove_stores` once the benchmark is over). ``l3_read`` (config
  level, default ``cold``) makes the file L3 read from storage, not from the
  page cache: its ``direct_io`` is ``on`` (O_DIRECT; a filesystem that
  refuses it fails the server's start, named). ``cached`` leaves reads to
  the page cache; NIXL's POSIX plugin has no O_DIRECT, so a config with a
  ``nixl`` system must say ``l3_read: cached``;
- ``vllm_offload``: vLLM's native CPU offloading (``--kv-offloading-backend native``);
- ``lmcache``: vLLM + LMCache (``--kv-offloading-backend lmcache``);
- ``sglang``: SGLang with ``--enable-hierarchical-cache``.

:func:`plan` turns one system into a command line, or into the reason it
cannot run here (its interpreter or package is missing, it needs a GPU);
the runner reports that reason instead of a number.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from hicache.integration.bench.lmcache_service import NO_TELEMETRY

SYSTEM_KINDS = ("vllm", "hicache", "vllm_offload", "lmcache", "sglang")
L3_BACKENDS = ("file", "nixl")
L3_READS = ("cold", "cached")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class ConfigError(ValueError):
    """A compare config that cannot run; the message names the key and what is allowed."""


@dataclass(frozen=True)
class SystemSpec:
    """One system of the comparison."""

    # Label in tables and plots (unique).
    name: str
    # One of SYSTEM_KINDS.
    kind: str
    # HiCache only: L1 -> L2 write policy.
    write_policy: str = "write_through"
    # HiCache only: L3 backend, or None for L1 + L2 only.
    l3: str | None = None
    # Interpreter that runs the server (default: this one). SGLang lives in its own venv.
    python: str | None = None
    # Extra command-line arguments appended to the server command.
    extra_args: tuple[str, ...] = ()
    # HiCache only: more kv_connector_extra_config keys.
    extra_config: dict[str, Any] = field(default_factory=dict)
    # Extra environment variables for the server.
    env: dict[str, str] = field(default_factory=dict)
    # The system needs a CUDA GPU in its interpreter (SGLang's HiCache does).
    needs_gpu: bool = False
    # Workload keys this system's client changes (e.g. an agent's retain_s and
    # pause-time prefetch against plain LRU on the same server and trace).
    workload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CompareConfig:
    """Everything the systems of one comparison share."""

    # Name of the preset/config (titles, output file names).
    name: str
    # Model path or id; "tiny" = the built-in tiny Llama (built on first use).
    model: str
    workload: dict[str, Any]
    systems: tuple[SystemSpec, ...]
    seed: int = 0
    # Host memory for the offloading tier of every system, GB (1e9 bytes).
    memory_budget_gb: float = 1.0
    # L1 blocks for every system (num_gpu_blocks_override); None = each engine's own sizing.
    l1_blocks: int | None = None
    block_size: int = 32
    page_size: int = 32
    max_model_len: int = 4096
    dtype: str = "auto"
    # Seconds to wait for a server to answer /health.
    ready_timeout_s: float = 300.0
    # Arguments every vLLM-based system gets (e.g. --enforce-eager on CPU).
    vllm_args: tuple[str, ...] = ()
    # Environment every system gets (e.g. VLLM_CPU_KVCACHE_SPACE).
    env: dict[str, str] = field(default_factory=dict)
    out: str = "bench_results/compare"
    # How HiCache's L3 pages are read: "cold" (from storage: O_DIRECT) or "cached"
    # (through the page cache).
    l3_read: str = "cold"


def _check_keys(d: dict[str, Any], cls: type, where: str) -> None:
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}")


def _system(d: Any, i: int) -> SystemSpec:
    where = f"systems[{i}]"
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping with 'name' and 'kind'")
    _check_keys(d, SystemSpec, where)
    for key in ("name", "kind"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ConfigError(f"{where}: key {key!r} is required (a non-empty string)")
    if d["kind"] not in SYSTEM_KINDS:
        raise ConfigError(f"{where}: key 'kind' must be one of {', '.join(SYSTEM_KINDS)}, "
                          f"got {d['kind']!r}")
    if d.get("write_policy", "write_through") not in WRITE_POLICIES:
        raise ConfigError(f"{where}: key 'write_policy' must be one of "
                          f"{', '.join(WRITE_POLICIES)}, got {d['write_policy']!r}")
    if d.get("l3") is not None and d["l3"] not in L3_BACKENDS:
        raise ConfigError(f"{where}: key 'l3' must be one of {', '.join(L3_BACKENDS)} or null, "
                          f"got {d['l3']!r}")
    if d["kind"] != "hicache":
        for key in ("write_policy", "l3", "extra_config"):
            if key in d:
                raise ConfigError(f"{where}: key {key!r} applies to kind 'hicache' only")
    if not isinstance(d.get("needs_gpu", False), bool):
        raise ConfigError(f"{where}: key 'needs_gpu' must be true or false")
    for key in ("extra_config", "env", "workload"):
        if not isinstance(d.get(key, {}), dict):
            raise ConfigError(f"{where}: key {key!r} must be a mapping")
    args = d.get("extra_args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}: key 'extra_args' must be a list of strings")
    return SystemSpec(**{**d, "extra_args": tuple(args),
                         "env": {k: str(v) for k, v in d.get("env", {}).items()}})


def parse_config(data: Any, where: str = "config") -> CompareConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    _check_keys(data, CompareConfig, where)
    for key in ("name", "model"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ConfigError(f"{where}: key {key!r} is required (a non-empty string)")
    if not isinstance(data.get("workload"), dict):
        raise ConfigError(f"{where}: key 'workload' is required (a mapping of workload keys)")
    systems = data.get("systems")
    if not isinstance(systems, list) or not systems:
        raise ConfigError(f"{where}: key 'systems' must be a non-empty list")
    specs = tuple(_system(s, i) for i, s in enumerate(systems))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{where}: system names must be unique; repeated: {', '.join(dup)}")
    from hicache.integration.bench.trace_workload import TraceWorkload, is_trace_workload
    from hicache.integration.bench.workloads import WorkloadSpec

    for spec in specs:  # each system's workload as its client will run it
        merged = {**data["workload"], **spec.workload}
        try:
            if is_trace_workload(data["workload"]):
                TraceWorkload.from_dict(merged)
            else:
                WorkloadSpec.from_dict(merged)
        except ValueError as exc:
            raise ConfigError(f"{where}: system {spec.name!r}: {exc}") from None
    num = {"memory_budget_gb": (float, 0.0), "ready_timeout_s": (float, 1.0),
           "block_size": (int, 1), "page_size": (int, 1), "max_model_len": (int, 16),
           "seed": (int, 0)}
    for key, (kind, low) in num.items():
        if key in data and (not isinstance(data[key], (int, float)) or isinstance(data[key], bool)
                            or data[key] < low or (kind is int and not isinstance(data[key], int))):
            raise ConfigError(f"{where}: key {key!r} must be {kind.__name__} >= {low}, "
                              f"got {data[key]!r}")
    if data.get("l1_blocks") is not None and (not isinstance(data["l1_blocks"], int)
                                               or data["l1_blocks"] < 2):
        raise ConfigError(f"{where}: key 'l1_blocks' must be an integer >= 2 or null")
    if data.get("page_size", 32) % data.get("block_size", 32):
        raise ConfigError(f"{where}: key 'page_size' must be a multiple of 'block_size'")
    for key in ("vllm_args",):
        if not isinstance(data.get(key, []), list):
            raise ConfigError(f"{where}: key {key!r} must be a list of strings")
    l3_read = data.get("l3_read", "cold")
    if l3_read not in L3_READS:
        raise ConfigError(f"{where}: key 'l3_read' must be one of {', '.join(L3_READS)}, "
                          f"got {l3_read!r}")
    nixl = [spec.name for spec in specs if spec.l3 == "nixl"]
    if l3_read == "cold" and nixl:
        raise ConfigError(f"{where}: key 'l3_read' is 'cold' (the default) but system "
                          f"{nixl[0]!r} uses l3: nixl, whose POSIX plugin reads through the "
                          "page cache; set l3_read: cached")
    cfg = {**data, "systems": specs, "vllm_args": tuple(data.get("vllm_args", [])),
           "env": {k: str(v) for k, v in (data.get("env") or {}).items()}}
    return CompareConfig(**cfg)


def load_config(path: str | Path) -> CompareConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, str(path))


PRESETS_DIR = Path(__file__).parent / "presets"
# The L3 directories of hicache systems under a run's workdir (plan, remove_stores).
L3_DIR_PREFIX = "l3-"


def preset_path(name: str) -> Path:
    """``cpu`` / ``gpu`` / ``agent`` -> the shipped preset file; anything else is a path."""
    candidate = PRESETS_DIR / f"{name}.yaml"
    return candidate if candidate.exists() else Path(name)


@dataclass
class LaunchPlan:
    """How to start one system, or why it cannot be started here."""

    system: SystemSpec
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    base_url: str = ""
    admin_url: str | None = None
    not_run: str | None = None


def resolve_model(model: str) -> str:
    if model == "tiny":
        from hicache.integration.models.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model("test"))
    return model


def _python(spec: SystemSpec) -> str:
    if spec.python is None:
        return sys.executable
    return str(Path(spec.python).expanduser())


def probe(python: str, module: str, needs_gpu: bool) -> str | None:
    """Why ``module`` cannot serve from ``python`` (None: it can, as far as a probe tells)."""
    if not Path(python).exists():
        return f"interpreter {python} not found"
    code = ("import importlib.util, sys\n"
            f"importlib.util.find_spec({module!r}) or sys.exit(3)\n")
    if needs_gpu:
        code += "import torch\ntorch.cuda.is_available() or sys.exit(4)\n"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}"
    if done.returncode == 3:
        return f"{module} is not installed for {python}"
    if done.returncode == 4:
        return "needs a CUDA GPU; this machine has none"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"probe failed in {python}: {last}"
    return None


def plan(cfg: CompareConfig, spec: SystemSpec, *, port: int, admin_port: int,
         workdir: Path) -> LaunchPlan:
    """The command line for ``spec`` (servers bind 127.0.0.1 only)."""
    lp = LaunchPlan(spec, base_url=f"http://127.0.0.1:{port}")
    python = _python(spec)
    lp.env = {**cfg.env, **spec.env}
    if spec.kind == "lmcache":  # LMCache reports usage unless told not to
        lp.env.update(NO_TELEMETRY)
    model = resolve_model(cfg.model)
    if spec.kind == "sglang":
        # SGLang's HiCache moves KV between device and host with sgl_kernel's
        # CUDA transfer kernels: there is no CPU path to try.
        lp.not_run = probe(python, "sglang", needs_gpu=True)
        if lp.not_run and lp.not_run.startswith("needs a CUDA GPU"):
            lp.not_run = ("SGLang HiCache needs a CUDA GPU (its host<->device transfers are "
                          "sgl_kernel CUDA kernels); this machine has none")
        lp.cmd = [python, "-m", "sglang.launch_server", "--model-path", model,
                  "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(cfg.seed),
                  "--page-size", str(cfg.page_size), "--enable-hierarchical-cache",
                  "--hicache-size", str(max(1, round(cfg.memory_budget_gb))),
                  "--context-length", str(cfg.max_model_len)]
        if cfg.l1_blocks is not None:  # SGLang sizes its device pool in tokens
            lp.cmd += ["--max-total-tokens", str(cfg.l1_blocks * cfg.block_size)]
        lp.cmd += list(spec.extra_args)
        return lp
    lp.not_run = probe(python, "vllm", spec.needs_gpu)
    if lp.not_run is None and spec.kind == "lmcache":
        lp.not_run = probe(python, "lmcache", spec.needs_gpu)
        if lp.not_run is not None:
            lp.not_run += (" (LMCache 0.5.6 pins numpy<=2.2.6 and prometheus_client<=0.24.1, "
                           "so it lives in its own venv; `make bench-peers` compares it at "
                           "component level)")
    cmd = [*_vllm_cli(python), "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--seed", str(cfg.seed), "--block-size", str(cfg.block_size),
           "--max-model-len", str(cfg.max_model_len), "--dtype", cfg.dtype,
           "--enable-prompt-tokens-details", *cfg.vllm_args]
    if cfg.l1_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(cfg.l1_blocks)]
    if spec.kind == "hicache":
        extra: dict[str, Any] = {
            "hicache_size": cfg.memory_budget_gb, "page_size": cfg.page_size,
            "hicache_write_policy": spec.write_policy, "hicache_admin_port": admin_port,
        }
        if spec.l3 is not None:
            # A new store per run (pages of an earlier run would be hits), in a new
            # directory: see remove_stores for why an earlier one is not emptied now.
            workdir.mkdir(parents=True, exist_ok=True)
            l3_dir = Path(tempfile.mkdtemp(prefix=f"{L3_DIR_PREFIX}{spec.name}-", dir=workdir))
            extra["hicache_storage_backend"] = spec.l3
            store: dict[str, Any] = {"path": str(l3_dir)}
            if spec.l3 == "file" and cfg.l3_read == "cold":
                store["direct_io"] = "on"  # reads from storage, not the page cache
            extra["hicache_storage_backend_extra_config"] = store
        extra.update(spec.extra_config)
        kv = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
        cmd += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
        lp.admin_url = f"http://127.0.0.1:{admin_port}"
        # A token of this run's own (in the environment, not on the command line): the
        # client's admin writes (an agent's POST /prefetch) need one.
        lp.env.setdefault("HICACHE_ADMIN_TOKEN", secrets.token_hex(16))
    elif spec.kind in ("vllm_offload", "lmcache"):
        backend = "native" if spec.kind == "vllm_offload" else "lmcache"
        cmd += ["--kv-offloading-size", str(cfg.memory_budget_gb),
                "--kv-offloading-backend", backend]
    lp.cmd = cmd + list(spec.extra_args)
    return lp


def _vllm_cli(python: str) -> list[str]:
    """``vllm`` for a CUDA install; our shim where the CPU build's script cannot start."""
    if python == sys.executable:
        from hicache.integration.vllm.cli_shim import vllm_distribution_missing

        if vllm_distribution_missing():
            return [python, "-m", "hicache.integration.vllm.cli_shim"]
    script = Path(python).parent / "vllm"
    return [str(script)] if script.exists() else [python, "-m", "vllm.entrypoints.cli.main"]


def remove_stores(workdir: Path) -> None:
    """Delete the L3 directories :func:`plan` made under ``workdir``: once, after the
    benchmark's last run, never between runs. On ext4 without a journal (this
    project's CI VM) the inodes of files deleted in the last minutes are skipped
    one by one when a new file is created (the kernel's ``recently_deleted``), so
    a run that starts right after an earlier run's store was deleted pays for
    every file of it: measured, a HiCache server's L3 thread spent 6-20 ms of CPU
    a step instead of 1-3 ms. A benchmark started within minutes of this call
    pays the same, in any directory of that file system (docs/benchmarks-trace.md)."""
    for path in sorted(workdir.glob(f"{L3_DIR_PREFIX}*")):
        shutil.rmtree(path, ignore_errors=True)


# Microseconds a new file may cost before the probe says the kernel is skipping
# recently deleted inodes (remove_stores); a settled file system is well below it.
SLOW_CREATE_US = 100.0


def create_cost_us(workdir: Path, files: int = 200) -> float:
    """Mean microseconds to create an empty file in a new directory under ``workdir``,
    where a run's file L3 would be made. Far above ``SLOW_CREATE_US``, a file
    system without a journal is skipping the inodes of files deleted in the last
    minutes (see :func:`remove_stores`), and an L3 that writes page files pays it
    on every page. The directory is one of :func:`remove_stores`'s: it goes with
    the benchmark's stores, not now."""
    workdir.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix=f"{L3_DIR_PREFIX}probe-", dir=workdir))
    start = time.perf_counter()
    for i in range(files):
        os.close(os.open(probe / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return (time.perf_counter() - start) / files * 1e6


def settled_create_us(workdir: Path, wait_s: float, every_s: float = 15.0,
                      probe: Callable[[Path], float] = create_cost_us,
                      sleep: Callable[[float], None] = time.sleep) -> tuple[float, float]:
    """``create_cost_us`` once it is at most ``SLOW_CREATE_US``, probing every
    ``every_s`` for up to ``wait_s`` seconds (the file system forgets deleted
    inodes within minutes): (the last cost, seconds waited)."""
    waited = 0.0
    cost = probe(workdir)
    while cost > SLOW_CREATE_US and waited + every_s <= wait_s:
        sleep(every_s)
        waited += every_s
        cost = probe(workdir)
    return cost, waited


_RPC_DIR: list[Path] = []  # this process's folder for vLLM's IPC sockets, once made


def rpc_dir() -> Path:
    """A folder for the ZMQ IPC sockets of the vLLM servers this process starts
    (``VLLM_RPC_BASE_PATH``, vLLM's default the temp folder): vLLM leaves them behind
    when a server stops, about eight per server; this folder is removed at exit."""
    if not _RPC_DIR:
        _RPC_DIR.append(Path(tempfile.mkdtemp(prefix="hicache-rpc-")))
        atexit.register(shutil.rmtree, _RPC_DIR[0], True)
    return _RPC_DIR[0]


def server_env(lp: LaunchPlan) -> dict[str, str]:
    """The server's environment: ours, ``rpc_dir()`` unless the operator named a
    ``VLLM_RPC_BASE_PATH``, then the plan's."""
    env = dict(os.environ)
    if "VLLM_RPC_BASE_PATH" not in env:
        env["VLLM_RPC_BASE_PATH"] = str(rpc_dir())
    env.update(lp.env)
    return env
