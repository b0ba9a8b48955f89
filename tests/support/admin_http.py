"""Calls to a live engine's admin endpoint over real HTTP, for the engine tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def post(client: httpx.Client, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return client.post(path, json=body or {}, headers=AUTH)


def tiers(client: httpx.Client) -> dict[str, Any]:
    r = client.get("/stats")
    assert r.status_code == 200
    return r.json()["tiers"]


def held(client: httpx.Client, prompt: list[int]) -> dict[str, int]:
    """The leading tokens of ``prompt`` L2 and L3 hold (``GET /lookup``)."""
    r = client.get("/lookup", params={"prefix": ",".join(map(str, prompt))}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def prefetch_status(client: httpx.Client, op_id: str) -> dict[str, Any]:
    """A prefetch operation's status (``GET /prefetch/{id}``)."""
    r = client.get(f"/prefetch/{op_id}", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(done: Callable[[], bool], what: str, limit_s: float = 120) -> None:
    """Poll ``done`` (a hang guard, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
