"""Start and stop a real Mooncake Store master on 127.0.0.1 for tests and benchmarks.

Contract:
- ``start_mooncake()`` launches ``mooncake_master`` (from the installed
  ``mooncake`` package) with its RPC and metrics servers on 127.0.0.1 free
  ports and the built-in HTTP metadata server left off (it would bind
  0.0.0.0). It returns once the RPC port accepts connections (~0.2-1.5 s),
  or raises ``RuntimeError`` with the log tail.
- ``metadata="P2PHANDSHAKE"`` (default) needs no metadata server;
  ``metadata="http"`` also starts the Python ``mooncake_http_metadata_server
  --host 127.0.0.1`` on a free port. Every process started here binds
  loopback only. (Store clients still bind their transfer ports on 0.0.0.0;
  ``client_env()`` makes them advertise 127.0.0.1.)
- ``MooncakeService`` is a context manager; ``stop()`` sends SIGTERM to the
  PIDs it started, then SIGKILL after a grace period, and removes the log
  folder when ``start_mooncake`` made it (no ``log_dir``); ``kill_master()``
  SIGKILLs the master and ``restart_master()`` starts an empty one on the
  same ports, for fault tests. Processes are also stopped at
  interpreter exit.
- ``start_segment_holder(size)`` starts a process that only contributes
  store memory (as a standalone Mooncake store would), so pages outlive the
  engines that wrote them; it is SIGKILLed by ``stop``.
- ``extra_config()`` gives the MooncakeBackend extra-config for this master;
  ``apply_client_env()`` sets ``MC_TCP_BIND_ADDRESS=127.0.0.1`` in this
  process (needed before any Mooncake client is set up).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
HOST = "127.0.0.1"


# Ports free_port draws from start here (below them: well-known and registered ones).
FREE_PORT_FLOOR = 10_000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, drawn below the kernel's ephemeral range.

    A port the kernel hands out for port 0 is an ephemeral one: any outgoing
    connection (an HTTP client, vLLM's own sockets) may be given it before the
    caller binds it, and the caller's server then cannot bind while its clients
    talk to whatever holds the port. Below the range nobody is given a port
    unasked; the race left is with another process that picks explicit ports
    the same way."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200 if low > FREE_PORT_FLOOR + 1000 else 0):
        port = draw.randrange(FREE_PORT_FLOOR, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_open(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def mooncake_master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mooncake package is not installed "
                           "(pip install mooncake-transfer-engine-non-cuda)")
    path = Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the mooncake package")
    return path


def apply_client_env() -> None:
    """Make Mooncake clients of this process advertise 127.0.0.1."""
    os.environ.update(CLIENT_ENV)


@dataclass
class MooncakeService:
    """A running master (and optional metadata server) started by ``start_mooncake``."""

    rpc_port: int
    metrics_port: int
    metadata_server: str
    log_dir: Path
    master: subprocess.Popen[bytes]
    master_cmd: list[str]
    metadata: subprocess.Popen[bytes] | None = None
    holder: subprocess.Popen[bytes] | None = None
    owns_log_dir: bool = False  # made by start_mooncake: removed by stop
    _stopped: bool = field(default=False, repr=False)

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.metadata, self.holder) if p is not None]

    def start_segment_holder(self, size: int, timeout_s: float = 30.0) -> None:
        """Start a process that contributes ``size`` bytes of store memory and
        outlives the engines: the pages engines put (with ``global_segment_size``
        0) survive an engine restart, as with a standalone Mooncake store."""
        env = {**os.environ, **CLIENT_ENV}
        ready = self.log_dir / f"holder-{time.monotonic_ns()}.ready"
        code = (
            "import sys, time, pathlib\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "s = MooncakeDistributedStore()\n"
            f"rc = s.setup({HOST!r}, {self.metadata_server!r}, {int(size)}, 16 << 20, 'tcp', '',"
            f" {self.master_address!r})\n"
            "if rc != 0: sys.exit(f'setup failed: {rc}')\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "while True: time.sleep(3600)\n"
        )
        with open(self.log_dir / "segment_holder.log", "ab") as log:
            self.holder = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.holder.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mooncake segment holder did not start; log in "
                                   f"{self.log_dir / 'segment_holder.log'}")
            time.sleep(0.05)

    def client_env(self) -> dict[str, str]:
        """Environment a client process needs (merge into ``os.environ`` / subprocess env)."""
        return dict(CLIENT_ENV)

    def extra_config(self, global_segment_size: int | str = 256 << 20,
                     **overrides: Any) -> dict[str, Any]:
        """MooncakeBackend extra-config for this master."""
        cfg: dict[str, Any] = {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": HOST,
            "protocol": "tcp",
            "global_segment_size": global_segment_size,
        }
        cfg.update(overrides)
        return cfg

    def master_alive(self) -> bool:
        return self.master.poll() is None

    def kill_master(self) -> None:
        """SIGKILL the master (fault injection); ``stop`` still cleans up the rest."""
        if self.master.poll() is None:
            os.kill(self.master.pid, signal.SIGKILL)
            self.master.wait(timeout=10)

    def restart_master(self, start_timeout_s: float = 15.0) -> None:
        """Start a fresh (empty) master on the same ports after ``kill_master``."""
        if self.master.poll() is None:
            raise RuntimeError("the master is still running; kill_master() first")
        self.master = _spawn_master(self.master_cmd, self.log_dir)
        if not _wait_port(self.master, self.rpc_port, start_timeout_s):
            raise RuntimeError(f"mooncake_master did not restart:\n{self.log_tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.holder is not None and self.holder.poll() is None:
            os.kill(self.holder.pid, signal.SIGKILL)  # its client would wait on the master
            self.holder.wait(timeout=10)
        for proc in (self.master, self.metadata):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in (self.master, self.metadata):
            if proc is None:
                continue
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self.owns_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        path = self.log_dir / "mooncake_master.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> MooncakeService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn_master(cmd: list[str], logs: Path) -> subprocess.Popen[bytes]:
    with open(logs / "mooncake_master.log", "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_port(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if _port_open(port):
            return True
        time.sleep(0.05)
    return False


def start_mooncake(
    *,
    metadata: str = "P2PHANDSHAKE",
    log_dir: str | os.PathLike[str] | None = None,
    master_args: tuple[str, ...] = (),
    start_timeout_s: float = 15.0,
    attempts: int = 3,
) -> MooncakeService:
    """Start a master on 127.0.0.1 (``metadata``: "P2PHANDSHAKE" or "http")."""
    if metadata not in ("P2PHANDSHAKE", "http"):
        raise ValueError(f"metadata={metadata!r}; allowed values: 'P2PHANDSHAKE', 'http'")
    owned = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="mooncake-") if log_dir is None else log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    binary = mooncake_master_binary()
    last_error = ""
    for _ in range(attempts):  # a free port can be taken between probe and bind: retry
        rpc_port, metrics_port = free_port(), free_port()
        cmd = [
            str(binary),
            f"--rpc_address={HOST}", f"--rpc_port={rpc_port}",
            f"--metrics_host={HOST}", f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
            "--logtostderr=1",
            *master_args,
        ]
        master = _spawn_master(cmd, logs)
        if not _wait_port(master, rpc_port, start_timeout_s):
            if master.poll() is None:
                master.kill()
            master.wait(timeout=10)
            last_error = (logs / "mooncake_master.log").read_text(errors="replace")[-2000:]
            continue
        service = MooncakeService(rpc_port, metrics_port, "P2PHANDSHAKE", logs, master, cmd,
                                  owns_log_dir=owned)
        atexit.register(service.stop)
        if metadata == "http":
            meta_port = free_port()
            with open(logs / "metadata_server.log", "ab") as log:
                service.metadata = subprocess.Popen(
                    [sys.executable, "-m", "mooncake.http_metadata_server",
                     "--host", HOST, "--port", str(meta_port)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            if not _wait_port(service.metadata, meta_port, start_timeout_s):
                service.stop()
                raise RuntimeError("mooncake_http_metadata_server did not start; log in "
                                   f"{logs / 'metadata_server.log'}")
            service.metadata_server = f"http://{HOST}:{meta_port}/metadata"
        return service
    raise RuntimeError(f"mooncake_master did not start after {attempts} attempts:\n{last_error}")
