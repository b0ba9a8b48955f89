"""The admin HTTP API against real uvicorn servers on 127.0.0.1 (real HTTP through httpx).

The target is a small in-memory :class:`AdminTarget` defined here; the
connector's real target is tested against a live engine elsewhere.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import HTTPException
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from hicache.integration.admin import auth
from hicache.integration.admin.app import create_app
from hicache.integration.admin.auth import TokenGuard, as_secret
from hicache.integration.admin.metrics import render_metrics
from hicache.integration.admin.redact import REDACTED, is_secret_key, redact, scrub, scrub_text
from hicache.integration.admin.server import AdminServer, AdminServerError, is_loopback_host
from hicache.integration.admin.target import AdminTarget
from hicache.tiers.controller.admin import AdminError, BadRequest, Conflict, NotFound

TOKEN = "s3cr3t-admin-token-XYZ"
ALLOWED_TIERS = ("l1", "l2", "l3", "all")
BACKENDS = ("file", "mooncake", "nixl", "dynamic")


class MemoryTarget:
    """An in-memory AdminTarget: pages are token-id tuples per tier."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fail: BaseException | None = None
        self.bad_return: Any = None
        self.backend: str | None = "file"
        self.pages: dict[str, set[tuple[int, ...]]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.ops: dict[str, dict[str, Any]] = {}
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.fail = None
            self.bad_return = None
            self.backend = "file"
            self.calls.clear()
            self.ops = {}
            self.pages = {
                "l2": {(1, 2), (1, 2, 3, 4), (5, 6)},
                "l3": {(1, 2), (1, 2, 3, 4), (5, 6), (7, 8)},
            }

    def _enter(self, name: str, args: Any = None) -> None:
        self.calls.append((name, args))
        if self.fail is not None:
            raise self.fail

    def config(self) -> dict[str, Any]:
        with self.lock:
            self._enter("config")
            return {
                "page_size": 64,
                "hicache_ratio": 2.0,
                "hicache_admin_token": TOKEN,
                "hicache_admin_port": 8790,
                "hicache_storage_backend": self.backend,
                "hicache_storage_prefetch_policy": "timeout",
                "hicache_storage_backend_extra_config": {
                    "path": "/mnt/kv",
                    "password": "hunter2",
                    "page_key": "abc123",
                    "prefetch_timeout_per_ki_token": 0.1,
                    "nested": [{"apiKey": "k-123"}, {"keep": 1}],
                },
                "mooncake_raw": json.dumps({"master_server_address": "m:1", "secret_key": "zz"}),
                "note": f"leaked {TOKEN} here",
            }

    def stats(self) -> dict[str, Any]:
        with self.lock:
            self._enter("stats")
            if self.bad_return is not None:
                return self.bad_return
            return {
                "tiers": {
                    "l1": {"capacity_pages": 72, "used_pages": 10, "hits": 5, "misses": 3},
                    "l2": {
                        "capacity_pages": 1000,
                        "used_pages": len(self.pages["l2"]),
                        "capacity_bytes": 1_000_000,
                        "used_bytes": 3000,
                        "hits": 40,
                        "misses": 2,
                        "evictions": 7,
                        "pages_loaded": 40,
                        "bytes_loaded": 40_000,
                        "pages_saved": 50,
                        "bytes_saved": 50_000,
                        "recent_load_gbps": 1.5,
                        "recent_save_gbps": None,
                    },
                    "l3": {
                        "used_pages": len(self.pages["l3"]),
                        "hits": 4,
                        "misses": 9,
                        "corrupt_pages": 1,
                        "pages_loaded": 4,
                        "errors": 2,
                    },
                },
                "queues": {"l3_backup_pages": 3, "l3_fetches": 0},
                "policy": {
                    "write_policy": "write_through",
                    "prefetch_policy": "timeout",
                    "prefetch_threshold": 256,
                    "layerwise": False,
                    "note": f"x{TOKEN}x",
                },
                "scheduler": {"lookups": 12, "hit_tokens": 640},
            }

    def flush(
        self, tiers: list[str], prefix: list[int] | None, cache_salt: str | None
    ) -> dict[str, int]:
        with self.lock:
            self._enter("flush", (tiers, prefix, cache_salt))
            bad = [t for t in tiers if t not in ALLOWED_TIERS]
            if bad:
                raise BadRequest(f"unknown tier {bad[0]!r}; allowed: {', '.join(ALLOWED_TIERS)}")
            chosen = {"l2", "l3"} if "all" in tiers else {t for t in tiers if t != "l1"}
            out = {"l2_pages": 0, "l3_pages": 0, "skipped_locked": 0}
            for tier in sorted(chosen):
                keep = set()
                for key in self.pages[tier]:
                    if prefix is None or key[: len(prefix)] == tuple(prefix):
                        out[f"{tier}_pages"] += 1
                    else:
                        keep.add(key)
                self.pages[tier] = keep
            return out

    def forget(self, prefix: list[int], cache_salt: str | None,
               keep_tokens: int) -> dict[str, int]:
        with self.lock:
            self._enter("forget", (prefix, cache_salt, keep_tokens))
            out = {"l2_pages": 0, "l3_pages": 0, "skipped_locked": 0, "kept_shared_pages": 0}
            for tier in ("l2", "l3"):
                gone = {k for k in self.pages[tier] if k[: len(prefix)] == tuple(prefix)}
                out[f"{tier}_pages"] = len(gone)
                self.pages[tier] -= gone
            return out

    def lookup(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        with self.lock:
            self._enter("lookup", (prefix, cache_salt))
            held = {tier: max((len(k) for k in self.pages[tier]
                               if tuple(prefix[: len(k)]) == k), default=0)
                    for tier in ("l2", "l3")}
            return {"prefix_tokens": len(prefix), "page_size": 2, "tokens": held,
                    "load_gbps": {"l2": 1.5, "l3": None},
                    "expected_load_s": {"l2": held["l2"] * 1e-6, "l3": None}}

    def prefetch(self, prefix: list[int], cache_salt: str | None, op_id: str | None = None,
                 ttl_s: float | None = None) -> dict[str, Any]:
        with self.lock:
            self._enter("prefetch", (prefix, cache_salt, op_id, ttl_s))
            if self.backend is None:
                raise Conflict("no L3 storage backend is attached")
            op = {"id": op_id or f"op-{len(self.ops)}", "status": "running",
                  "pages": len(prefix), "fetched_pages": None, "ttl_s": ttl_s, "age_s": 0.0}
            self.ops[op["id"]] = op
            return {"prefetch_tokens": len(prefix), "l3_tokens": len(prefix), "l2_tokens": 0,
                    **op}

    def prefetch_status(self, op_id: str) -> dict[str, Any]:
        with self.lock:
            self._enter("prefetch_status", (op_id,))
            if op_id not in self.ops:
                raise NotFound(f"no prefetch with id {op_id!r}")
            return dict(self.ops[op_id])

    def cancel_prefetch(self, op_id: str) -> dict[str, Any]:
        with self.lock:
            self._enter("cancel_prefetch", (op_id,))
            if op_id not in self.ops:
                raise NotFound(f"no prefetch with id {op_id!r}")
            self.ops[op_id]["status"] = "cancelled"
            return dict(self.ops[op_id])

    def session(self, session_id: str) -> dict[str, Any]:
        with self.lock:
            self._enter("session", (session_id,))
            if session_id != "agent-1":
                raise NotFound(f"session_id {session_id!r}: no such session")
            return {"session_id": session_id, "open": True, "turns": 3, "pages": 9,
                    "idle_s": 1.5, "retain_s": 30.0}

    def close_session(self, session_id: str, forget: bool) -> dict[str, Any]:
        with self.lock:
            self._enter("close_session", (session_id, forget))
            if session_id != "agent-1":
                raise NotFound(f"session_id {session_id!r}: no such session")
            if forget:
                return {"session_id": session_id, "released_pins": 1, "l2_pages": 7,
                        "l3_pages": 7, "skipped_locked": 0, "kept_shared_pages": 2}
            return {"session_id": session_id, "released_pins": 1, "demoted_pages": 7}

    def pin(self, prefix: list[int], cache_salt: str | None, ttl_s: float) -> dict[str, Any]:
        with self.lock:
            self._enter("pin", (prefix, cache_salt, ttl_s))
            if ttl_s > 1000:
                raise Conflict("pins would hold more than their share of L2")
            return {"pinned_pages": len(prefix), "ttl_s": ttl_s}

    def unpin(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        with self.lock:
            self._enter("unpin", (prefix, cache_salt))
            return {"unpinned_pages": len(prefix)}

    def attach_storage(self, backend: str, extra_config: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self._enter("attach", (backend, extra_config))
            if backend not in BACKENDS:
                raise BadRequest(f"unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}"
                )
            if self.backend is not None:
                raise Conflict(f"L3 backend {self.backend!r} is attached; detach it first")
            self.backend = backend
            return {"attached": backend, "extra_config": extra_config}

    def detach_storage(self) -> dict[str, Any]:
        with self.lock:
            self._enter("detach")
            if self.backend is None:
                raise Conflict("no L3 backend is attached")
            name, self.backend = self.backend, None
            return {"detached": name, "pending_backups_dropped": 0}

    def tree(self, prefix: list[int] | None, depth: int) -> dict[str, Any]:
        with self.lock:
            self._enter("tree", (prefix, depth))
            p = tuple(prefix or ())
            keys = sorted(k for k in self.pages["l2"] if k[: len(p)] == p)
            return {"prefix": list(p), "depth": depth, "nodes": [list(k) for k in keys]}


assert isinstance(MemoryTarget(), AdminTarget)


# --------------------------------------------------------------------------- #
# fixtures
# --------------------------------------------------------------------------- #


class Live:
    def __init__(self, token: str | None, require_reads: bool | None) -> None:
        self.target = MemoryTarget()
        self.server = AdminServer(self.target, token, require_token_for_reads=require_reads)
        self.server.start("127.0.0.1", 0)
        self.url = self.server.url
        self.client = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Live]]:
    lives = {
        # token set, bound to loopback: reads open, writes need the token
        "open": Live(TOKEN, None),
        # token set, reads need it too (as when bound beyond loopback)
        "closed": Live(TOKEN, True),
        # no token: writes always 403
        "notoken": Live(None, None),
        "notoken_closed": Live(None, True),
    }
    try:
        yield lives
    finally:
        for live in lives.values():
            live.close()


@pytest.fixture()
def live(servers: dict[str, Live]) -> Live:
    s = servers["open"]
    s.target.reset()
    return s


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def assert_no_token(resp: httpx.Response) -> None:
    assert TOKEN not in resp.text
    for k, v in resp.headers.items():
        assert TOKEN not in k and TOKEN not in v


# --------------------------------------------------------------------------- #
# happy paths and schemas
# --------------------------------------------------------------------------- #


def test_server_binds_ephemeral_port_on_loopback(live: Live) -> None:
    assert live.server.port > 0
    assert live.url == f"http://127.0.0.1:{live.server.port}"
    assert live.server.require_token_for_reads is False
    assert live.server.running


def test_healthz_needs_no_token(servers: dict[str, Live]) -> None:
    for s in servers.values():
        r = s.client.get("/healthz")
        assert r.status_code == 200
        assert r.json() == {"status": "ok"}


def test_config_is_redacted(live: Live) -> None:
    r = live.client.get("/config")
    assert r.status_code == 200, r.text
    cfg = r.json()
    assert_no_token(r)
    assert cfg["hicache_admin_token"] == REDACTED
    assert cfg["page_size"] == 64
    assert cfg["hicache_admin_port"] == 8790
    extra = cfg["hicache_storage_backend_extra_config"]
    assert extra["password"] == REDACTED
    assert extra["page_key"] == "abc123"
    assert extra["prefetch_timeout_per_ki_token"] == 0.1
    assert extra["path"] == "/mnt/kv"
    assert extra["nested"] == [{"apiKey": REDACTED}, {"keep": 1}]
    assert json.loads(cfg["mooncake_raw"]) == {"master_server_address": "m:1", "secret_key": REDACTED}
    assert cfg["note"] == REDACTED
    assert "hunter2" not in r.text and "k-123" not in r.text


def test_stats_shape(live: Live) -> None:
    r = live.client.get("/stats")
    assert r.status_code == 200, r.text
    s = r.json()
    assert set(s["tiers"]) == {"l1", "l2", "l3"}
    l2 = s["tiers"]["l2"]
    assert l2["used_pages"] == 3 and l2["evictions"] == 7 and l2["recent_load_gbps"] == 1.5
    assert l2["recent_save_gbps"] is None
    assert s["tiers"]["l3"]["corrupt_pages"] == 1 and s["tiers"]["l3"]["errors"] == 2
    assert s["queues"] == {"l3_backup_pages": 3, "l3_fetches": 0}
    assert s["policy"]["write_policy"] == "write_through"
    assert s["scheduler"] == {"lookups": 12, "hit_tokens": 640}
    assert_no_token(r)


def test_metrics_prometheus_text(live: Live) -> None:
    r = live.client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert_no_token(r)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert all(name.startswith("hicache_") for name in families)
    hits = families["hicache_tier_hits"]
    assert hits.type == "counter"
    samples = {(s.name, s.labels["tier"]): s.value for s in hits.samples}
    assert samples[("hicache_tier_hits_total", "l2")] == 40
    assert samples[("hicache_tier_hits_total", "l3")] == 4
    used = {s.labels["tier"]: s.value for s in families["hicache_tier_used_pages"].samples}
    assert used == {"l1": 10, "l2": 3, "l3": 4}
    assert families["hicache_tier_used_pages"].type == "gauge"
    load = families["hicache_tier_load_bytes_per_second"].samples
    assert [(s.labels, s.value) for s in load] == [({"tier": "l2"}, 1.5e9)]
    assert families["hicache_tier_corrupt_pages"].samples[0].labels == {"tier": "l3"}
    assert families["hicache_tier_evictions"].type == "counter"
    queues = {s.labels["queue"]: s.value for s in families["hicache_queue_depth"].samples}
    assert queues == {"l3_backup_pages": 3, "l3_fetches": 0}
    info = {(s.labels["key"], s.labels["value"]) for s in families["hicache_policy_info"].samples}
    assert ("write_policy", "write_through") in info and ("layerwise", "false") in info
    assert families["hicache_scheduler_lookups"].samples[0].value == 12
    assert families["hicache_tier_errors"].samples[0].labels == {"tier": "l3"}
    for fam in families.values():
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples)


def test_render_metrics_edge_cases() -> None:
    text = render_metrics(
        {
            "tiers": {'we"ird\n': {"hits": 1, "used_pages": float("nan"), "x-y": 2.5},
                      "l2": None, "l3": {"hits": None, "misses": "many"}},
            "queues": {"q": True},
            "policy": {"a": None, "b": 1.25},
            "7bad section": {"k": 1, "s": "str"},
            "scalar": 5,
        }
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["hicache_tier_hits"].samples[0].labels == {"tier": 'we"ird\n'}
    assert families["hicache_queue_depth"].samples[0].value == 1
    assert families["hicache_policy_value"].samples[0].value == 1.25
    assert "hicache__7bad_section_k" in families
    assert "hicache_tier_x_y" in families
    assert render_metrics({}) == ""


def test_flush(live: Live) -> None:
    r = live.client.post("/flush", json={"tiers": ["L2", "l2"], "prefix": [1, 2]}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"l2_pages": 2, "l3_pages": 0, "skipped_locked": 0}
    assert live.target.calls[-1] == ("flush", (["l2"], [1, 2], None))
    r = live.client.post(
        "/flush", json={"tiers": ["all"], "prefix": None, "cache_salt": "s"}, headers=AUTH
    )
    assert r.json() == {"l2_pages": 1, "l3_pages": 4, "skipped_locked": 0}
    assert live.target.calls[-1] == ("flush", (["all"], None, "s"))


def test_flush_rejects_bad_input(live: Live) -> None:
    r = live.client.post("/flush", json={"tiers": ["l9"]}, headers=AUTH)
    assert r.status_code == 400
    assert "l9" in r.json()["detail"] and "l1, l2, l3, all" in r.json()["detail"]
    for body in (
        {"tiers": []},
        {"tiers": ["l2"], "prefix": ["a"]},
        {"tiers": ["l2"], "prefix": [-1]},
        {"tiers": ["l2"], "prefix": [1.5]},
        {"tiers": ["l2"], "tier": "typo"},
        {},
    ):
        r = live.client.post("/flush", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)
    r = live.client.post("/flush", content=b"not json", headers=AUTH)
    assert r.status_code == 422
    r = live.client.post("/flush", json={"tiers": ["  "]}, headers=AUTH)
    assert r.status_code == 422 and "tiers" in r.text


def test_attach_detach_cycle(live: Live) -> None:
    r = live.client.post("/storage/detach", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"detached": "file", "pending_backups_dropped": 0}
    r = live.client.post("/storage/detach", headers=AUTH)
    assert r.status_code == 409 and "no L3 backend" in r.json()["detail"]
    r = live.client.post("/storage/attach", json={"backend": "s3"}, headers=AUTH)
    assert r.status_code == 400 and "file, mooncake, nixl, dynamic" in r.json()["detail"]
    body = {"backend": "mooncake", "extra_config": {"master_server_address": "h:1",
                                                    "password": "pw", "token": TOKEN}}
    r = live.client.post("/storage/attach", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "attached": "mooncake",
        "extra_config": {"master_server_address": "h:1", "password": REDACTED, "token": REDACTED},
    }
    assert live.target.calls[-1][1] == ("mooncake", body["extra_config"])
    r = live.client.post("/storage/attach", json={"backend": "file"}, headers=AUTH)
    assert r.status_code == 409
    for bad in ({}, {"backend": ""}, {"backend": "file", "extra_config": []},
                {"backend": "file", "oops": 1}):
        assert live.client.post("/storage/attach", json=bad, headers=AUTH).status_code == 422


def test_tree(live: Live) -> None:
    # (a prefix needs the token once one is set: test_routes_naming_a_prompt_...)
    r = live.client.get("/tree", headers=AUTH, params={"prefix": "1, 2", "depth": 3})
    assert r.status_code == 200, r.text
    assert r.json() == {"prefix": [1, 2], "depth": 3, "nodes": [[1, 2], [1, 2, 3, 4]]}
    r = live.client.get("/tree", headers=AUTH)
    assert r.json()["depth"] == 2 and r.json()["prefix"] == []
    assert live.client.get("/tree", headers=AUTH, params={"prefix": ""}).json()["prefix"] == []
    for params, name in (
        ({"depth": 0}, "depth"),
        ({"depth": 9}, "depth"),
        ({"depth": "x"}, "depth"),
        ({"prefix": "1,a"}, "prefix"),
        ({"prefix": "1,,2"}, "prefix"),
        ({"prefix": "-1"}, "prefix"),
        ({"prefix": str(1 << 64)}, "prefix"),
        ({"dpeth": 4}, "dpeth"),  # a typo is refused, not ignored
    ):
        r = live.client.get("/tree", headers=AUTH, params=params)
        assert r.status_code == 422, (params, r.text)
        locs = [d["loc"] for d in r.json()["detail"]]
        assert ["query", name] in locs, (params, locs)
    r = live.client.get("/tree", headers=AUTH, params={"depth": 2, "dpeth": 4})
    assert "allowed: prefix, depth" in r.json()["detail"][0]["msg"]


def test_openapi_documents_every_endpoint(live: Live) -> None:
    spec = live.client.get("/openapi.json").json()
    paths = spec["paths"]
    for path, method in (
        ("/healthz", "get"), ("/config", "get"), ("/stats", "get"), ("/metrics", "get"),
        ("/tree", "get"), ("/flush", "post"), ("/storage/attach", "post"),
        ("/storage/detach", "post"), ("/lookup", "get"), ("/forget", "post"),
        ("/pin", "post"), ("/pin", "delete"), ("/prefetch", "post"),
        ("/prefetch/{op_id}", "get"), ("/prefetch/{op_id}", "delete"),
    ):
        assert method in paths[path], path
    assert "FlushRequest" in spec["components"]["schemas"]
    assert "StatsResponse" in spec["components"]["schemas"]
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def _ref(content: dict[str, Any], media_type: str = "application/json") -> str:
    return str(content["content"][media_type]["schema"]["$ref"]).rsplit("/", 1)[-1]


def test_openapi_names_the_request_and_response_models(live: Live) -> None:
    spec = live.client.get("/openapi.json").json()
    paths = spec["paths"]
    ok = {
        ("/healthz", "get"): "HealthResponse",
        ("/config", "get"): "ConfigResponse",
        ("/stats", "get"): "StatsResponse",
        ("/tree", "get"): "TreeResponse",
        ("/flush", "post"): "FlushResponse",
        ("/forget", "post"): "ForgetResponse",
        ("/lookup", "get"): "LookupResponse",
        ("/pin", "post"): "PinResponse",
        ("/prefetch", "post"): "PrefetchResponse",
        ("/prefetch/{op_id}", "get"): "PrefetchStatus",
        ("/prefetch/{op_id}", "delete"): "PrefetchStatus",
        ("/pin", "delete"): "UnpinResponse",
        ("/storage/attach", "post"): "AttachResponse",
        ("/storage/detach", "post"): "DetachResponse",
    }
    for (path, method), model in ok.items():
        assert _ref(paths[path][method]["responses"]["200"]) == model, path
    assert _ref(paths["/metrics"]["get"]["responses"]["200"], "text/plain") == "MetricsText"
    for (path, method) in [*ok, ("/metrics", "get")]:
        if path == "/healthz":
            assert set(paths[path][method]["responses"]) == {"200"}
            continue
        for code in ("400", "401", "403", "409", "500"):
            assert _ref(paths[path][method]["responses"][code]) == "ErrorResponse", (path, code)
    assert _ref(paths["/flush"]["post"]["requestBody"]) == "FlushRequest"
    assert _ref(paths["/storage/attach"]["post"]["requestBody"]) == "AttachRequest"
    schemas = spec["components"]["schemas"]
    for name in ("FlushRequest", "AttachRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    assert schemas["ErrorResponse"]["required"] == ["detail"]
    assert schemas["AttachResponse"]["required"] == ["attached"]
    assert schemas["DetachResponse"]["required"] == ["detached"]
    assert schemas["FlushResponse"]["additionalProperties"] == {"type": "integer"}
    assert schemas["MetricsText"]["type"] == "string"
    assert "TierStats" in schemas

    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield str(v)
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    found = set(refs(spec))
    assert "#/components/schemas/ErrorResponse" in found
    for ref in found:  # every reference resolves
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[-1] in schemas, ref
    assert TOKEN not in json.dumps(spec)


# --------------------------------------------------------------------------- #
# auth
# --------------------------------------------------------------------------- #

WRITES = [
    ("/flush", {"tiers": ["l2"]}),
    ("/storage/attach", {"backend": "nixl"}),
    ("/storage/detach", None),
    ("/forget", {"prefix": [1, 2]}),
    ("/pin", {"prefix": [1, 2], "ttl_s": 5}),
    ("/prefetch", {"prefix": [1, 2]}),
]
READS = ["/config", "/stats", "/metrics", "/tree"]
HEADERS = {
    "missing": {},
    "wrong": {"Authorization": "Bearer not-the-token"},
    "prefix_of_right": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "basic": {"Authorization": f"Basic {TOKEN}"},
    "right": AUTH,
}


def _write(s: Live, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> httpx.Response:
    return s.client.post(path, json=body, headers=headers)


@pytest.mark.parametrize("path,body", WRITES)
@pytest.mark.parametrize("case", sorted(HEADERS))
def test_writes_need_token(servers: dict[str, Live], path: str, body: Any, case: str) -> None:
    for name in ("open", "closed"):
        s = servers[name]
        s.target.reset()
        r = _write(s, path, body, HEADERS[case])
        assert_no_token(r)
        if case == "right":
            assert r.status_code in (200, 409), r.text  # 409: attach while attached
        else:
            assert r.status_code == 401, (name, case, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert not [c for c in s.target.calls if c[0] != "config"]
    for name in ("notoken", "notoken_closed"):
        s = servers[name]
        r = _write(s, path, body, HEADERS[case])
        assert r.status_code == 403, (name, case, r.text)
        detail = r.json()["detail"]
        assert "hicache_admin_token" in detail and "HICACHE_ADMIN_TOKEN" in detail
        assert not s.target.calls
        assert_no_token(r)


@pytest.mark.parametrize("path", READS)
@pytest.mark.parametrize("case", sorted(HEADERS))
def test_reads_auth(servers: dict[str, Live], path: str, case: str) -> None:
    # Reads are open on loopback whatever is sent (a wrong token is not checked).
    for name in ("open", "notoken"):
        r = servers[name].client.get(path, headers=HEADERS[case])
        assert r.status_code == 200, (name, r.text)
        if name == "open":  # "notoken" does not know TOKEN, so cannot scrub it
            assert_no_token(r)
    r = servers["closed"].client.get(path, headers=HEADERS[case])
    assert_no_token(r)
    if case == "right":
        assert r.status_code == 200
    else:
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = servers["notoken_closed"].client.get(path, headers=HEADERS[case])
    assert r.status_code == 403 and "HICACHE_ADMIN_TOKEN" in r.json()["detail"]


@pytest.mark.parametrize("path", ["/tree?prefix=1,2", "/lookup?prefix=1,2"])
@pytest.mark.parametrize("case", sorted(HEADERS))
def test_routes_naming_a_prompt_need_the_token_once_one_is_set(
        servers: dict[str, Live], path: str, case: str) -> None:
    """Whether a prompt is cached tells about other users' prompts: with a token
    configured, asking about one needs it even on loopback; without one, loopback
    reads stay open (and /tree without a prefix too)."""
    for name in ("open", "closed"):
        r = servers[name].client.get(path, headers=HEADERS[case])
        assert_no_token(r)
        assert r.status_code == (200 if case == "right" else 401), (name, case, r.text)
    assert servers["notoken"].client.get(path, headers=HEADERS[case]).status_code == 200
    assert servers["open"].client.get("/tree", headers=HEADERS[case]).status_code == 200


def test_lookup_and_forget(live: Live) -> None:
    c = live.client
    r = c.get("/lookup", params={"prefix": "1,2,3,4,9", "cache_salt": "s"}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == {"l2": 4, "l3": 4} and body["prefix_tokens"] == 5
    assert body["expected_load_s"]["l3"] is None and body["load_gbps"]["l2"] == 1.5
    assert live.target.calls[-1] == ("lookup", ([1, 2, 3, 4, 9], "s"))
    r = c.post("/forget", json={"prefix": [1, 2, 3], "keep_tokens": 2}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["l2_pages"] == 1 and live.target.calls[-1] == ("forget", ([1, 2, 3], None, 2))
    for bad in ({}, {"prefix": []}, {"prefix": [1], "keep_tokens": -1},
                {"prefix": [1], "keep_tokens": "2"}, {"prefix": [1], "tiers": ["l2"]}):
        r = c.post("/forget", json=bad, headers=AUTH)
        assert r.status_code == 422, (bad, r.text)
    for bad in ("", "1,x", "-1"):
        assert c.get("/lookup", params={"prefix": bad}, headers=AUTH).status_code == 422, bad
    assert c.get("/lookup", headers=AUTH).status_code == 422
    assert c.get("/lookup", params={"prefix": "1", "depth": "2"},
                 headers=AUTH).status_code == 422


def test_prefetch(live: Live) -> None:
    c = live.client
    r = c.post("/prefetch", json={"prefix": [4, 5, 6], "id": "turn-7", "ttl_s": 2},
               headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"prefetch_tokens": 3, "l3_tokens": 3, "l2_tokens": 0, "id": "turn-7",
                        "status": "running", "pages": 3, "fetched_pages": None,
                        "ttl_s": 2.0, "age_s": 0.0}
    assert live.target.calls[-1] == ("prefetch", ([4, 5, 6], None, "turn-7", 2))
    r = c.get("/prefetch/turn-7", headers=AUTH)
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    assert c.delete("/prefetch/turn-7").status_code == 401  # a write: the token
    r = c.delete("/prefetch/turn-7", headers=AUTH)
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    r = c.get("/prefetch/nobody", headers=AUTH)
    assert r.status_code == 404 and "nobody" in r.json()["detail"]
    assert c.delete("/prefetch/nobody", headers=AUTH).status_code == 404
    for bad in ({}, {"prefix": []}, {"prefix": [1], "ttl_s": 0}, {"prefix": [1], "id": ""},
                {"prefix": [1], "id": "a b"}, {"prefix": [1], "bogus": 3}):
        assert c.post("/prefetch", json=bad, headers=AUTH).status_code == 422, bad
    live.target.backend = None
    r = live.client.post("/prefetch", json={"prefix": [4]}, headers=AUTH)
    assert r.status_code == 409 and "no L3" in r.json()["detail"]


def test_sessions(live: Live) -> None:
    c = live.client
    r = c.get("/sessions/agent-1", headers=AUTH)
    assert r.status_code == 200 and r.json()["turns"] == 3, r.text
    r = c.get("/sessions/nobody", headers=AUTH)
    assert r.status_code == 404 and "nobody" in r.json()["detail"]
    assert c.post("/sessions/agent-1/close").status_code == 401  # a write: the token
    r = c.post("/sessions/agent-1/close", headers=AUTH)  # no body: keep the pages
    assert r.status_code == 200 and r.json()["demoted_pages"] == 7, r.text
    assert live.target.calls[-1] == ("close_session", ("agent-1", False))
    r = c.post("/sessions/agent-1/close", json={"forget": True}, headers=AUTH)
    assert r.status_code == 200 and r.json()["l3_pages"] == 7, r.text
    assert live.target.calls[-1] == ("close_session", ("agent-1", True))
    assert c.post("/sessions/nobody/close", headers=AUTH).status_code == 404
    for bad in ({"forget": "yes"}, {"bogus": 1}):
        r = c.post("/sessions/agent-1/close", json=bad, headers=AUTH)
        assert r.status_code == 422 and ("forget" in r.text or "bogus" in r.text), bad
    assert c.get("/sessions/" + "x" * 257, headers=AUTH).status_code == 422


def test_pin_and_unpin(live: Live) -> None:
    c = live.client
    r = c.post("/pin", json={"prefix": [1, 2, 3], "ttl_s": 30}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"pinned_pages": 3, "ttl_s": 30.0}, r.text
    assert live.target.calls[-1] == ("pin", ([1, 2, 3], None, 30))
    r = c.request("DELETE", "/pin", json={"prefix": [1, 2, 3], "cache_salt": "s"},
                  headers=AUTH)
    assert r.status_code == 200 and r.json() == {"unpinned_pages": 3}, r.text
    assert c.request("DELETE", "/pin", json={"prefix": [1]}).status_code == 401
    r = c.post("/pin", json={"prefix": [1], "ttl_s": 5000}, headers=AUTH)
    assert r.status_code == 409 and "share of L2" in r.json()["detail"]
    for bad in ({"prefix": [1]}, {"prefix": [1], "ttl_s": 0}, {"prefix": [], "ttl_s": 1},
                {"prefix": [1], "ttl_s": 1, "tiers": ["l2"]}, {"ttl_s": 1}):
        assert c.post("/pin", json=bad, headers=AUTH).status_code == 422, bad


def test_secret_str_token_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server = AdminServer(MemoryTarget(), SecretStr(TOKEN), require_token_for_reads=True)
    assert TOKEN not in repr(server)
    server.start("127.0.0.1", 0)
    try:
        assert TOKEN not in repr(server)
        with httpx.Client(base_url=server.url, trust_env=False, timeout=10.0) as c:
            assert c.get("/stats").status_code == 401
            assert c.get("/stats", headers=HEADERS["wrong"]).status_code == 401
            r = c.get("/config", headers=AUTH)
            assert r.status_code == 200 and r.json()["hicache_admin_token"] == REDACTED
            assert r.json()["note"] == REDACTED  # the token's value is scrubbed, not its repr
            assert_no_token(r)
            r = c.post("/flush", json={"tiers": ["l2"]}, headers=AUTH)
            assert r.status_code == 200 and r.json()["l2_pages"] == 3
            r = c.post("/flush", json={"tiers": ["l2"]}, headers=HEADERS["prefix_of_right"])
            assert r.status_code == 401 and r.json() == {"detail": "invalid bearer token"}
            assert_no_token(r)
    finally:
        server.stop()
    assert caplog.records  # the server did log (start-up), and...
    assert TOKEN not in caplog.text  # ...no line carries the token


@pytest.mark.parametrize("token", [None, "", SecretStr("")])
def test_empty_token_is_no_token(token: SecretStr | str | None) -> None:
    assert as_secret(token) is None
    client = TestClient(create_app(MemoryTarget(), token, require_token_for_reads=False))
    r = client.post("/flush", json={"tiers": ["l2"]}, headers={"Authorization": "Bearer "})
    assert r.status_code == 403 and "HICACHE_ADMIN_TOKEN" in r.json()["detail"]
    assert client.get("/stats").status_code == 200


@pytest.mark.parametrize("token", [TOKEN, SecretStr(TOKEN)])
def test_create_app_takes_str_or_secret_str(token: SecretStr | str) -> None:
    secret = as_secret(token)
    assert isinstance(secret, SecretStr) and secret.get_secret_value() == TOKEN
    assert as_secret(secret) is secret
    client = TestClient(create_app(MemoryTarget(), token, require_token_for_reads=True))
    assert client.get("/tree", headers=AUTH).status_code == 200
    r = client.get("/tree", headers=HEADERS["wrong"])
    assert r.status_code == 401 and r.headers["www-authenticate"] == 'Bearer realm="hicache-admin"'
    assert client.get("/healthz").json() == {"status": "ok"}


def test_token_is_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []
    real = auth.secrets.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.secrets, "compare_digest", spy)
    guard = TokenGuard(SecretStr(TOKEN), require_token_for_reads=False)
    assert guard.configured and guard.token is not None
    guard.write(HTTPAuthorizationCredentials(scheme="Bearer", credentials=TOKEN))
    with pytest.raises(HTTPException) as exc:
        guard.write(HTTPAuthorizationCredentials(scheme="Bearer", credentials="nope"))
    assert exc.value.status_code == 401
    assert seen == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode())]
    guard.read(None)  # reads open: nothing compared
    assert len(seen) == 2
    with pytest.raises(HTTPException) as exc:
        guard.write(None)
    assert exc.value.status_code == 401 and exc.value.detail.startswith("missing bearer token")
    assert len(seen) == 2


def test_require_reads_follows_host() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1")
    assert is_loopback_host("localhost") and is_loopback_host("127.0.0.5")
    assert is_loopback_host("[::1]")
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com", ""):
        assert not is_loopback_host(host), host


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #


def test_unexpected_exception_is_a_generic_500(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    live.target.fail = RuntimeError(f"boom internal-detail {TOKEN}")
    caplog.set_level(logging.ERROR, logger="hicache.integration.admin")
    responses = [live.client.get(p) for p in READS]
    responses += [_write(live, p, b, AUTH) for p, b in WRITES]
    for r in responses:
        assert r.status_code == 500, r.text
        assert "boom" not in r.text and "internal-detail" not in r.text
        assert "RuntimeError" not in r.text and "Traceback" not in r.text
        assert r.json() == {"detail": "internal error in the HiCache admin target; see the server log"}
        assert_no_token(r)
    logged = caplog.text
    assert "boom internal-detail" in logged  # the operator gets the traceback...
    assert TOKEN not in logged  # ...without the token
    assert live.client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "bad", [{"tiers": {"l2": {"hits": "lots"}}}, {1, 2}, [1], {"tiers": [1, 2]}, {"x": object()}]
)
def test_malformed_target_output_is_a_500(live: Live, bad: Any) -> None:
    live.target.bad_return = bad
    for path in ("/stats", "/metrics"):
        r = live.client.get(path)
        assert r.status_code == 500 and r.json()["detail"].startswith("internal error"), r.text


def test_numpy_like_and_nan_values_are_served(live: Live) -> None:
    class Scalar:
        ndim = 0

        def item(self) -> int:
            return 9

    live.target.bad_return = {"tiers": {"l2": {"hits": Scalar(), "recent_load_gbps": float("nan")}}}
    r = live.client.get("/stats")
    assert r.status_code == 200, r.text
    assert r.json()["tiers"]["l2"]["hits"] == 9
    assert r.json()["tiers"]["l2"]["recent_load_gbps"] is None


def test_each_kind_of_admin_error_has_its_status_and_no_other_kind_shows(live: Live) -> None:
    """The core raises kinds, not HTTP codes; the app maps them (400, 409, 404) and
    scrubs the token from what it shows. A kind it does not know is a generic 500."""
    live.target.fail = Conflict(f"busy {TOKEN}")
    r = live.client.get("/stats")
    assert r.status_code == 409 and r.json()["detail"] == REDACTED  # it named the token
    live.target.fail = BadRequest("no such tier")
    assert live.client.get("/stats").status_code == 400
    live.target.fail = AdminError(f"db password {TOKEN}")  # no kind: not shown
    r = live.client.get("/stats")
    assert r.status_code == 500 and "password" not in r.text


def test_validation_errors_never_echo_the_token(live: Live) -> None:
    r = live.client.post("/flush", json={"tiers": ["l2"], "oops": TOKEN}, headers=AUTH)
    assert r.status_code == 422, r.text
    assert_no_token(r)
    assert [d["loc"] for d in r.json()["detail"]] == [["body", "oops"]]
    r = live.client.get("/tree", headers=AUTH, params={"prefix": TOKEN})
    assert r.status_code == 422 and ["query", "prefix"] in [d["loc"] for d in r.json()["detail"]]
    assert_no_token(r)
    r = live.client.post("/storage/attach", json={"backend": "file", "x": 1}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"][0]["input"] == 1  # other input is kept


def test_attach_detach_results_must_name_the_backend(live: Live) -> None:
    live.target.detach_storage = lambda: {"gone": True}  # type: ignore[method-assign]
    live.target.attach_storage = lambda b, e: {"attached": 7}  # type: ignore[method-assign]
    try:
        for path, body in (("/storage/detach", None), ("/storage/attach", {"backend": "file"})):
            r = live.client.post(path, json=body, headers=AUTH)
            assert r.status_code == 500, r.text
            assert r.json() == {"detail": "internal error in the HiCache admin target; see the server log"}
    finally:
        del live.target.detach_storage
        del live.target.attach_storage


def test_flush_counts_must_be_integers(live: Live) -> None:
    live.target.flush = lambda t, p, c: {"l2_pages": "three"}  # type: ignore[method-assign]
    try:
        r = live.client.post("/flush", json={"tiers": ["l2"]}, headers=AUTH)
        assert r.status_code == 500 and r.json()["detail"].startswith("internal error")
    finally:
        del live.target.flush


# --------------------------------------------------------------------------- #
# redaction rules
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "key",
    ["hicache_admin_token", "HF_TOKEN", "hfToken", "authToken", "api_key", "apiKey", "API-KEY",
     "password", "db_password", "secret", "client_secret", "aws_secret_access_key",
     "access_key_id", "private_key", "key", "ssh-key", "credentials", "Authorization",
     "bearer", "session_cookie", "passphrase", "sas_token", "encryption_key"],
)
def test_secret_keys(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key",
    ["page_key", "key_suffix", "prefetch_timeout_per_ki_token", "page_size", "tokenizer",
     "max_num_batched_tokens", "hit_tokens", "num_keys", "keys", "hicache_storage_backend",
     "hicache_storage_backend_extra_config", "path", "master_server_address", "monkey"],
)
def test_non_secret_keys(key: str) -> None:
    assert not is_secret_key(key)


def test_redact_walks_structures() -> None:
    value = {
        "a": [{"token": "t"}, {"x": ({"password": "p"},)}],
        "password": None,  # unset stays visible as unset
        "key": {"anything": "here"},
        "s": '{"api_key": "zz", "n": 1}',
        "raw": "{not json}",
        "t": "contains tok123 inside",
    }
    out = redact(value, "tok123")
    assert out == {
        "a": [{"token": REDACTED}, {"x": [{"password": REDACTED}]}],
        "password": None,
        "key": REDACTED,
        "s": json.dumps({"api_key": REDACTED, "n": 1}),
        "raw": "{not json}",
        "t": REDACTED,
    }
    assert value["a"][0]["token"] == "t"  # input untouched


def test_redact_and_scrub_take_a_secret_str() -> None:
    value = {"note": "has tok123", "n": [1, "tok123"], "api_key": "x", "ok": "fine"}
    assert redact(value, SecretStr("tok123")) == redact(value, "tok123") == {
        "note": REDACTED, "n": [1, REDACTED], "api_key": REDACTED, "ok": "fine",
    }
    assert scrub({"tok123": ("a", "tok123")}, SecretStr("tok123")) == {REDACTED: ["a", REDACTED]}
    assert scrub(value, SecretStr("")) is value and scrub(value, None) is value
    assert scrub_text("x tok123 y tok123", SecretStr("tok123")) == f"x {REDACTED} y {REDACTED}"
    assert scrub_text("x tok123", None) == "x tok123"


# --------------------------------------------------------------------------- #
# server lifecycle
# --------------------------------------------------------------------------- #


def _can_bind(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _new_admin_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name == "hicache-admin"]


def test_stop_frees_the_port_and_ends_the_thread() -> None:
    before = set(threading.enumerate())
    server = AdminServer(MemoryTarget(), TOKEN)
    server.start("127.0.0.1", 0)
    port = server.port
    threads = _new_admin_threads(before)
    assert len(threads) == 1 and threads[0].daemon and threads[0].is_alive()
    assert server.running
    assert not _can_bind(port)
    # An idle keep-alive connection must not keep the server (or the port) alive.
    client = httpx.Client(base_url=server.url, trust_env=False, timeout=10.0)
    assert client.get("/stats").status_code == 200
    server.stop()
    assert not server.running
    assert not threads[0].is_alive()
    assert _can_bind(port)
    with pytest.raises(httpx.TransportError):
        client.get("/healthz")  # the kept-alive connection was closed with the server
    client.close()
    assert server.port == port  # kept after stop
    # ...and the same port can be served again, by another server...
    again = AdminServer(MemoryTarget(), TOKEN)
    again.start("127.0.0.1", port)
    try:
        assert again.port == port
        assert httpx.get(f"{again.url}/healthz", trust_env=False).status_code == 200
    finally:
        again.stop()
    assert _can_bind(port)
    server.stop()  # idempotent
    assert not server.running
    # ...or by the stopped one.
    server.start("127.0.0.1", port)
    try:
        assert server.running and server.port == port
        assert httpx.get(f"{server.url}/healthz", trust_env=False).status_code == 200
    finally:
        server.stop()
    assert _can_bind(port)
    assert not _new_admin_threads(before)


def test_port_in_use_is_a_clear_error(live: Live) -> None:
    other = AdminServer(MemoryTarget(), TOKEN)
    with pytest.raises(AdminServerError) as exc:
        other.start("127.0.0.1", live.server.port)
    msg = str(exc.value)
    assert str(live.server.port) in msg and "hicache_admin_port" in msg and "in use" in msg
    assert not other.running
    with pytest.raises(AdminServerError, match="hicache_admin_port"):
        other.start("127.0.0.1", 70000)
    with pytest.raises(AdminServerError, match="already running"):
        live.server.start("127.0.0.1", 0)


def test_slow_target_does_not_block_healthz(live: Live) -> None:
    entered = threading.Event()
    gate = threading.Event()
    original = live.target.tree
    results: list[int] = []

    def slow_tree(prefix: list[int] | None, depth: int) -> dict[str, Any]:
        entered.set()
        gate.wait(60)
        return original(prefix, depth)

    live.target.tree = slow_tree  # type: ignore[method-assign]
    worker = threading.Thread(target=lambda: results.append(live.client.get("/tree").status_code))
    try:
        worker.start()
        assert entered.wait(30)  # the target call is now in progress, and blocked
        with httpx.Client(base_url=live.url, trust_env=False, timeout=30.0) as c2:
            assert c2.get("/healthz").status_code == 200
        assert worker.is_alive() and not results  # answered while /tree was still blocked
    finally:
        gate.set()
        worker.join(30)
        del live.target.tree
    assert results == [200]


# --------------------------------------------------------------------------- #
# property-based fuzzing from the OpenAPI schema
# --------------------------------------------------------------------------- #

# schemathesis's own pytest plugin (from_fixture/parametrize) reads a private
# pytest attribute that pytest 9 removed, so the operations are driven here.


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_no_server_errors(servers: dict[str, Live], mode: str) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import given
    from schemathesis.checks import not_a_server_error

    live = servers["open"]
    api = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    generation_mode = schemathesis.GenerationMode(mode)
    operations = [r.ok() for r in api.get_all_operations()]
    assert len(operations) == 17
    if mode == "negative":  # only operations with inputs have invalid ones
        operations = [op for op in operations if op.path in (
            "/tree", "/lookup", "/flush", "/forget", "/pin", "/prefetch", "/prefetch/{op_id}",
            "/storage/attach")]
    for op in operations:

        @given(case=op.as_strategy(generation_mode=generation_mode))
        @settings(
            max_examples=15,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def run(case: Any) -> None:
            headers = dict(case.headers or {})
            headers.update(AUTH)  # writes and prompts need it (auth has its own tests)
            response = case.call(headers=headers, timeout=10)
            case.validate_response(response, checks=[not_a_server_error])
            assert TOKEN not in response.text

        live.target.reset()
        run()
