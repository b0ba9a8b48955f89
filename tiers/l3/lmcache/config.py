"""The lmcache backend's extra config: the server's addresses, timeouts and heartbeat.

Contract: ``LMCacheExtraConfig`` is the lmcache backend's
``hicache_storage_backend_extra_config``; anything else is a
``StorageConfigError`` naming the key and the allowed keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hicache.tiers.settings import Settings


class LMCacheExtraConfig(Settings):
    """The lmcache backend's ``hicache_storage_backend_extra_config``."""

    server_url: str = Field(
        "tcp://127.0.0.1:5555", pattern=r"^tcp://[^\s:/]+:\d{1,5}$",
        description="ZMQ address of the LMCache server: 'tcp://<--host>:<--port>'")
    http_url: str | None = Field(
        None, pattern=r"^https?://[^\s/]+(:\d{1,5})?/?$",
        description="the server's HTTP API, 'http://<--http-host>:<--http-port>'; "
        "deleting pages (prefix flushes, corrupt pages) needs it")
    transfer_mode: Literal["shm"] = Field(
        "shm", description="data path: the server's shared-memory pool (its pickle "
        "path unpickles client bytes and is never used)")
    request_timeout_s: float = Field(
        5.0, gt=0, le=600, description="bound on every round trip to the server, in s")
    heartbeat_interval_s: float = Field(
        30.0, gt=0, le=110, description="seconds between heartbeats; the server forgets "
        "a client silent for 120 s")
