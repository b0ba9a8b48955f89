"""Start and stop a stock LMCache multi-process server (``lmcache server``) on 127.0.0.1.

Contract:
- The server runs from its own venv (LMCache pins numpy and prometheus_client
  below what vLLM needs): ``lmcache_venv()`` is ``$HICACHE_LMCACHE_VENV`` or
  ``<repo>/.venv-peers/lmcache``, which ``make lmcache-venv`` builds
  (``integration/bench/peers/setup_venvs.sh lmcache``).
- Every LMCache process this project starts gets ``NO_TELEMETRY`` in its
  environment (LMCache reports usage otherwise); ``server_env()`` is the one
  place that builds that environment, and the peer benchmarks use it too.
- ``start_lmcache(l2_dir=...)`` binds the ZMQ and HTTP ports on 127.0.0.1
  (free ports, or the ones given), with a shared-memory pool named uniquely
  for this server, an LRU DRAM tier of ``l1_size_gb`` and, when ``l2_dir``
  is given, LMCache's ``fs`` L2 adapter there (``l2_adapter`` takes any
  other adapter's JSON). It returns once the HTTP API answers, or raises
  ``RuntimeError`` with the log tail.
- ``LMCacheService`` is a context manager: ``stop()`` sends SIGTERM, then
  SIGKILL after a grace period, and removes the log folder when
  ``start_lmcache`` made it (no ``log_dir``); ``kill()`` SIGKILLs it (fault tests) and
  ``restart()`` starts it again on the same ports and L2 (an empty DRAM
  tier, the same L2). ``extra_config()`` is the lmcache backend's extra
  config for it; ``command`` the command line, for the docs' recipe.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hicache.integration.bench.mooncake_service import HOST, free_port

REPO = Path(__file__).resolve().parents[2]
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
VENV_HINT = "build it with: make lmcache-venv"


def lmcache_venv() -> Path:
    return Path(os.environ.get("HICACHE_LMCACHE_VENV", REPO / ".venv-peers" / "lmcache"))


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an LMCache process: ours minus Python/venv settings, telemetry off."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(NO_TELEMETRY)
    env["LMCACHE_DISABLE_BANNER"] = "1"
    return env


@dataclass
class LMCacheService:
    """A running ``lmcache server`` started by ``start_lmcache``."""

    port: int
    http_port: int
    shm_name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    l2_dir: Path | None = None  # the fs adapter's folder, when it has one
    owns_log_dir: bool = False  # made by start_lmcache: removed by stop
    _stopped: bool = field(default=False, repr=False)

    @property
    def server_url(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    def extra_config(self, **overrides: Any) -> dict[str, Any]:
        """The lmcache backend's extra config for this server."""
        return {"server_url": self.server_url, "http_url": self.http_url, **overrides}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (fault injection)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        _unlink_shm(self.shm_name)

    def restart(self, timeout_s: float = 60.0) -> None:
        """Start the server again on the same ports and L2 after ``kill`` or ``stop``."""
        if self.proc.poll() is None:
            raise RuntimeError("the LMCache server is still running; kill() first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # stop may have removed it
        self.proc = _spawn(self.command, self.log_path)
        self._stopped = False
        _wait_ready(self, timeout_s)

    def stop(self, grace_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        _unlink_shm(self.shm_name)
        if self.owns_log_dir:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> LMCacheService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_lmcache(l2_dir: str | Path | None = None, *, l2_adapter: dict[str, Any] | None = None,
                  chunk_size: int = 16, l1_size_gb: float = 0.25, port: int | None = None,
                  http_port: int | None = None, log_dir: str | Path | None = None,
                  timeout_s: float = 60.0) -> LMCacheService:
    """Start ``lmcache server`` on 127.0.0.1 from ``lmcache_venv()``."""
    binary = lmcache_venv() / "bin" / "lmcache"
    if not binary.exists():
        raise RuntimeError(f"{binary} is missing ({VENV_HINT})")
    port = port or free_port()
    http_port = http_port or free_port()
    shm_name = f"hicache_{uuid.uuid4().hex[:12]}"
    if l2_adapter is None and l2_dir is not None:
        Path(l2_dir).mkdir(parents=True, exist_ok=True)
        l2_adapter = {"type": "fs", "base_path": str(l2_dir)}
    command = [str(binary), "server", "--host", HOST, "--port", str(port),
               "--http-host", HOST, "--http-port", str(http_port),
               "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb),
               "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
               "--shm-name", shm_name, "--disable-observability"]
    if l2_adapter is not None:
        command += ["--l2-adapter", json.dumps(l2_adapter)]
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="hicache-lmcache-"))
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"lmcache-{port}.log"
    service = LMCacheService(port, http_port, shm_name, command, log_path,
                             _spawn(command, log_path),
                             Path(l2_dir) if l2_dir is not None and l2_adapter is not None
                             and l2_adapter.get("type") == "fs" else None,
                             owns_log_dir=not log_dir)
    atexit.register(service.stop)
    try:
        _wait_ready(service, timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


def _spawn(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, env=server_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _wait_ready(service: LMCacheService, timeout_s: float) -> None:
    """Until the HTTP API answers (the server opens it after its ZMQ port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            break
        try:
            httpx.get(f"{service.http_url}/docs", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"lmcache server did not start (log {service.log_path}):\n"
                       f"{service.log_tail()}")


def _unlink_shm(name: str) -> None:
    """Remove a killed server's pool from /dev/shm (a clean stop removes it itself)."""
    path = Path("/dev/shm") / name.lstrip("/")
    for candidate in (path, path.with_name(f"lmcache_l1_pool_{name}")):
        try:
            candidate.unlink()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m hicache.integration.bench.lmcache_service``: run a server until Ctrl-C."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--l2-dir", default=str(REPO / ".cache" / "lmcache-l2"),
                        help="folder of LMCache's fs L2 adapter")
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument("--l1-size-gb", type=float, default=1.0)
    args = parser.parse_args(argv)
    with start_lmcache(args.l2_dir, port=args.port, http_port=args.http_port,
                       l1_size_gb=args.l1_size_gb) as service:
        print("lmcache server:", " ".join(service.command), flush=True)
        print("hicache_storage_backend_extra_config:", json.dumps(service.extra_config()),
              flush=True)
        try:
            service.proc.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
