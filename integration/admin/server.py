"""The admin app served by uvicorn in a daemon thread of the engine-core process.

Contract
========

:class:`AdminServer` ``(target, token, require_token_for_reads=None)`` takes
the token as a :class:`pydantic.SecretStr`, a ``str`` or ``None`` and keeps it
as a ``SecretStr`` (never logged, never in its ``repr``).

* ``start(host, port)`` binds and listens before it returns (``port=0``
  picks a free port; :attr:`AdminServer.port` is the actual one), then serves
  :func:`~hicache.integration.admin.app.create_app` in a daemon thread, once
  uvicorn reports it started. A port outside 0..65535, a host that does not
  resolve, a port in use ("the port is in use; pick another"), or a server
  that does not start within :attr:`AdminServer.START_TIMEOUT_S` raise
  :class:`AdminServerError` naming the address and ``hicache_admin_port``;
  a second ``start`` while running raises it too ("already running").
* ``require_token_for_reads`` defaults to "``host`` is not loopback"
  (:func:`is_loopback_host`); passing it overrides that (tests). Serving
  beyond loopback with no token logs a warning: every endpoint but
  ``/healthz`` then answers 403.
* ``stop()`` asks uvicorn to exit, forces it after
  :attr:`AdminServer.STOP_TIMEOUT_S` (idle keep-alive connections do not
  hold it up), joins the thread and closes the socket, so the port is free
  when it returns; it is idempotent, and the server can be started again.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from typing import Any

from pydantic import SecretStr

from hicache.integration.admin.app import create_app
from hicache.integration.admin.auth import TOKEN_CONFIG_KEY, TOKEN_ENV, as_secret
from hicache.integration.admin.target import AdminTarget

logger = logging.getLogger(__name__)

PORT_CONFIG_KEY = "hicache_admin_port"


class AdminServerError(RuntimeError):
    """The admin server could not start (message names the address and hicache_admin_port)."""


def is_loopback_host(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine (unknown names: False)."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class AdminServer:
    """The admin app under uvicorn in a daemon thread (see the module docstring)."""

    START_TIMEOUT_S = 15.0
    STOP_TIMEOUT_S = 3.0

    def __init__(
        self,
        target: AdminTarget,
        token: SecretStr | str | None,
        *,
        require_token_for_reads: bool | None = None,
    ) -> None:
        self._target = target
        self._token: SecretStr | None = as_secret(token)
        self._require_reads_override = require_token_for_reads
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None
        self._host: str | None = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self.require_token_for_reads: bool | None = None

    def __repr__(self) -> str:
        where = f"{self._host}:{self._port}" if self._host is not None else "not started"
        token = "set" if self._token is not None else "not set"
        return f"AdminServer({where}, token {token}, running={self.running})"

    # ---- properties -----------------------------------------------------------

    @property
    def port(self) -> int:
        """The port actually bound by the last :meth:`start` (kept after :meth:`stop`)."""
        if self._port is None:
            raise AdminServerError("the HiCache admin server has not been started")
        return self._port

    @property
    def host(self) -> str:
        if self._host is None:
            raise AdminServerError("the HiCache admin server is not running")
        return self._host

    @property
    def url(self) -> str:
        host = self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- lifecycle ------------------------------------------------------------

    def start(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (``port=0``: a free port) and serve in a daemon thread."""
        import uvicorn

        with self._lock:
            if self._thread is not None:
                raise AdminServerError("the HiCache admin server is already running")
            if not 0 <= int(port) <= 65535:
                raise AdminServerError(
                    f"HiCache admin port {port} is out of range ({PORT_CONFIG_KEY}: 1..65535)"
                )
            sock = self._bind(host, int(port))
            require_reads = (
                self._require_reads_override
                if self._require_reads_override is not None
                else not is_loopback_host(host)
            )
            self.require_token_for_reads = require_reads
            if require_reads and self._token is None:
                logger.warning(
                    "HiCache admin server on %s with no token: every endpoint but /healthz "
                    "answers 403 (set %s or %s)", host, TOKEN_CONFIG_KEY, TOKEN_ENV,
                )
            app = create_app(self._target, self._token, require_token_for_reads=require_reads)
            config = uvicorn.Config(
                app,
                log_config=None,
                log_level="warning",
                access_log=False,
                lifespan="off",
                proxy_headers=False,
                server_header=False,
                ws="none",
                timeout_graceful_shutdown=int(self.STOP_TIMEOUT_S),
                timeout_keep_alive=5,
            )
            server = uvicorn.Server(config)
            self._server = server
            self._sock = sock
            self._host = host
            self._port = int(sock.getsockname()[1])
            self._error = None

            def run() -> None:
                try:
                    server.run(sockets=[sock])
                except BaseException as e:  # noqa: BLE001 - reported to start()
                    self._error = e

            thread = threading.Thread(target=run, name="hicache-admin", daemon=True)
            self._thread = thread
            thread.start()
            deadline = time.monotonic() + self.START_TIMEOUT_S
            while not server.started:
                if not thread.is_alive() or time.monotonic() > deadline:
                    err = self._error
                    self._cleanup(force=True)
                    raise AdminServerError(
                        f"the HiCache admin server did not start on {host}:{port} "
                        f"({PORT_CONFIG_KEY}): {err or 'timed out'}"
                    )
                time.sleep(0.01)
            logger.info(
                "HiCache admin server listening on %s (token for reads: %s)",
                self.url, "required" if require_reads else "not required",
            )

    def stop(self) -> None:
        """Shut down and free the port; returns within about ``2 * STOP_TIMEOUT_S`` seconds."""
        with self._lock:
            self._cleanup(force=False)

    def __enter__(self) -> AdminServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- internals --------------------------------------------------------------

    @staticmethod
    def _bind(host: str, port: int) -> socket.socket:
        where = f"{host}:{port}"
        try:
            infos = socket.getaddrinfo(
                host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except socket.gaierror as e:
            raise AdminServerError(
                f"cannot resolve the HiCache admin host {host!r}: {e.strerror}"
            ) from None
        family, socktype, proto, _, addr = infos[0]
        sock = socket.socket(family, socktype, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            reason = e.strerror or str(e)
            hint = "the port is in use; pick another" if e.errno in (98, 48) else reason
            raise AdminServerError(
                f"cannot bind the HiCache admin server to {where} ({PORT_CONFIG_KEY}): {hint}"
            ) from None
        return sock

    def _cleanup(self, *, force: bool) -> None:
        server, thread, sock = self._server, self._thread, self._sock
        if server is not None:
            server.should_exit = True
            if force:
                server.force_exit = True
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.STOP_TIMEOUT_S)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(self.STOP_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("HiCache admin server thread did not stop in time")
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        self._server = None
        self._thread = None
        self._sock = None


def serve_admin(target: Any, config: Any, dp_rank: int = 0) -> AdminServer | None:
    """The admin endpoint of one engine core (``HiCacheConfig``'s ``hicache_admin_*``
    keys; engine core ``dp_rank`` listens on port + rank), or None when the port is
    0 or the server could not start (logged: the cache serves without it)."""
    port = config.hicache_admin_port
    if not port:
        return None
    port += dp_rank
    token = config.hicache_admin_token
    if token is None and os.environ.get(TOKEN_ENV):
        token = SecretStr(os.environ[TOKEN_ENV])
    server = AdminServer(target, token)
    try:
        server.start(config.hicache_admin_host, port)
    except Exception:  # noqa: BLE001 - the cache serves without its admin endpoint
        logger.exception("HiCache: admin endpoint not started on %s:%d",
                         config.hicache_admin_host, port)
        return None
    logger.info("HiCache admin endpoint on http://%s:%d (token %s)",
                config.hicache_admin_host, server.port,
                "set" if token else "not set: POST endpoints refuse")
    return server
