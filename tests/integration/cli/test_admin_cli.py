"""``hicache admin ...`` (typer's CliRunner) against real admin servers on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hicache.integration.admin.server import AdminServer
from hicache.integration.cli.main import (
    EXIT_AUTH,
    EXIT_CONNECT,
    EXIT_SERVER,
    app,
    main,
)
from hicache.tiers.controller.admin import BadRequest, Conflict

TOKEN = "cli-t0ken-ABCDEF-123"


class Target:
    """A minimal in-memory AdminTarget."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.backend: str | None = "file"
        self.calls: list[tuple[str, Any]] = []

    def config(self) -> dict[str, Any]:
        return {"page_size": 64, "hicache_admin_token": TOKEN, "hicache_storage_backend": self.backend}

    def stats(self) -> dict[str, Any]:
        return {
            "tiers": {
                "l1": {"capacity_pages": 72, "used_pages": 10, "hits": 5, "misses": 5},
                "l2": {"capacity_pages": 1000, "used_pages": 321, "capacity_bytes": 4_000_000_000,
                       "used_bytes": 1_284_000_000, "hits": 77, "misses": 23, "evictions": 4,
                       "recent_load_gbps": 2.5},
                "l3": {"used_pages": 999, "hits": 1, "misses": 0, "corrupt_pages": 2},
            },
            "queues": {"l3_backup_pages": 6},
            "policy": {"write_policy": "write_through"},
        }

    def flush(
        self, tiers: list[str], prefix: list[int] | None, cache_salt: str | None
    ) -> dict[str, int]:
        with self.lock:
            self.calls.append(("flush", (tiers, prefix, cache_salt)))
            if any(t not in ("l1", "l2", "l3", "all") for t in tiers):
                raise BadRequest("unknown tier; allowed: l1, l2, l3, all")
            return {"l2_pages": 3, "l3_pages": 5, "skipped_locked": 0}

    def attach_storage(self, backend: str, extra_config: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.calls.append(("attach", (backend, extra_config)))
            if self.backend is not None:
                raise Conflict(f"L3 backend {self.backend!r} is attached; detach it first")
            self.backend = backend
            return {"attached": backend}

    def detach_storage(self) -> dict[str, Any]:
        with self.lock:
            self.calls.append(("detach", None))
            if self.backend is None:
                raise Conflict("no L3 backend is attached")
            name, self.backend = self.backend, None
            return {"detached": name}

    def forget(self, prefix: list[int], cache_salt: str | None,
               keep_tokens: int) -> dict[str, int]:
        self.calls.append(("forget", (prefix, cache_salt, keep_tokens)))
        return {"l2_pages": 0, "l3_pages": 0, "skipped_locked": 0, "kept_shared_pages": 0}

    def lookup(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        self.calls.append(("lookup", (prefix, cache_salt)))
        return {"prefix_tokens": len(prefix), "page_size": 2, "tokens": {"l2": 0, "l3": 0},
                "load_gbps": {"l2": None, "l3": None},
                "expected_load_s": {"l2": None, "l3": None}}

    def prefetch(self, prefix: list[int], cache_salt: str | None, op_id: str | None = None,
                 ttl_s: float | None = None) -> dict[str, Any]:
        self.calls.append(("prefetch", (prefix, cache_salt, op_id, ttl_s)))
        return {"prefetch_tokens": 0, "l3_tokens": 0, "l2_tokens": 0, **self._op(op_id or "x")}

    def _op(self, op_id: str, status: str = "done") -> dict[str, Any]:
        return {"id": op_id, "status": status, "pages": 0, "fetched_pages": 0,
                "ttl_s": None, "age_s": 0.0}

    def prefetch_status(self, op_id: str) -> dict[str, Any]:
        self.calls.append(("prefetch_status", (op_id,)))
        return self._op(op_id)

    def cancel_prefetch(self, op_id: str) -> dict[str, Any]:
        self.calls.append(("cancel_prefetch", (op_id,)))
        return self._op(op_id, "cancelled")

    def pin(self, prefix: list[int], cache_salt: str | None, ttl_s: float) -> dict[str, Any]:
        self.calls.append(("pin", (prefix, cache_salt, ttl_s)))
        return {"pinned_pages": 0, "ttl_s": ttl_s}

    def unpin(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        self.calls.append(("unpin", (prefix, cache_salt)))
        return {"unpinned_pages": 0}

    def tree(self, prefix: list[int] | None, depth: int) -> dict[str, Any]:
        self.calls.append(("tree", (prefix, depth)))
        return {"prefix": prefix or [], "depth": depth, "children": []}


class Live:
    def __init__(self, token: str | None) -> None:
        self.target = Target()
        self.server = AdminServer(self.target, token)
        self.server.start("127.0.0.1", 0)
        self.url = self.server.url


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Live]]:
    lives = {"token": Live(TOKEN), "notoken": Live(None)}
    try:
        yield lives
    finally:
        for live in lives.values():
            live.server.stop()


@pytest.fixture()
def live(servers: dict[str, Live]) -> Live:
    s = servers["token"]
    s.target.backend = "file"
    s.target.calls.clear()
    return s


@pytest.fixture(scope="module")
def dead_url() -> str:
    """A URL nothing listens on (a stopped server's port)."""
    server = AdminServer(Target(), None)
    server.start("127.0.0.1", 0)
    server.stop()
    return server.url


def run(args: list[str], *, url: str | None = None, token: str | None = None,
        input: str | None = None) -> Any:
    env = {"COLUMNS": "200", "HICACHE_ADMIN_URL": None, "HICACHE_ADMIN_TOKEN": None}
    if url is not None:
        env["HICACHE_ADMIN_URL"] = url
    if token is not None:
        env["HICACHE_ADMIN_TOKEN"] = token
    result = CliRunner().invoke(app, args, env=env, input=input)
    assert TOKEN not in result.output
    return result


def test_stats_table(live: Live) -> None:
    r = run(["admin", "stats"], url=live.url)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    rows = {ln.split("│")[1].strip(): ln for ln in lines if ln.count("│") > 2}
    assert {"l1", "l2", "l3"} <= set(rows)
    assert "321 / 1,000" in rows["l2"] and "77.0%" in rows["l2"]
    assert "1.28 GB / 4.00 GB" in rows["l2"] and "2.500" in rows["l2"]
    assert "999" in rows["l3"]
    assert "l3_backup_pages" in r.output and "write_through" in r.output


def test_stats_json_and_url_option(live: Live) -> None:
    r = run(["admin", "stats", "--json", "--url", live.url + "/"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["tiers"]["l2"]["used_pages"] == 321


def test_config_is_redacted(live: Live) -> None:
    r = run(["admin", "config"], url=live.url)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["hicache_admin_token"] == "<redacted>"


def test_flush(live: Live) -> None:
    r = run(["admin", "flush", "--tier", "l2", "-t", "l3", "--prefix", "1,2,3",
             "--cache-salt", "abc", "--yes"], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert live.target.calls == [("flush", (["l2", "l3"], [1, 2, 3], "abc"))]
    assert "l3_pages" in r.output and "5" in r.output
    r = run(["admin", "flush", "--yes", "--token", TOKEN], url=live.url)
    assert r.exit_code == 0, r.output
    assert live.target.calls[-1] == ("flush", (["all"], None, None))


def test_flush_confirmation(live: Live) -> None:
    r = run(["admin", "flush"], url=live.url, token=TOKEN, input="n\n")
    assert r.exit_code != 0
    assert live.target.calls == []
    r = run(["admin", "flush", "-t", "l2"], url=live.url, token=TOKEN, input="y\n")
    assert r.exit_code == 0, r.output
    assert live.target.calls == [("flush", (["l2"], None, None))]


def test_flush_server_rejects(live: Live) -> None:
    r = run(["admin", "flush", "-t", "l7", "-y"], url=live.url, token=TOKEN)
    assert r.exit_code == EXIT_SERVER
    assert "400" in r.output and "allowed: l1, l2, l3, all" in r.output


def test_flush_bad_prefix_is_a_usage_error(live: Live) -> None:
    r = run(["admin", "flush", "--prefix", "1,x", "-y"], url=live.url, token=TOKEN)
    assert r.exit_code == 2
    assert live.target.calls == []


def test_attach_detach(live: Live, tmp_path: Path) -> None:
    r = run(["admin", "detach"], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"detached": "file"}
    r = run(["admin", "detach"], url=live.url, token=TOKEN)
    assert r.exit_code == EXIT_SERVER and "409" in r.output and "no L3 backend" in r.output
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"path": "/mnt/kv", "capacity_gb": 5}))
    r = run(["admin", "attach", "file", "--config-file", str(cfg)], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert live.target.calls[-1] == ("attach", ("file", {"path": "/mnt/kv", "capacity_gb": 5}))
    r = run(["admin", "attach", "nixl", "--config", '{"path": "/x"}'], url=live.url, token=TOKEN)
    assert r.exit_code == EXIT_SERVER and "detach it first" in r.output
    r = run(["admin", "attach", "nixl", "--config", "[1]"], url=live.url, token=TOKEN)
    assert r.exit_code == 2 and "JSON object" in r.output
    r = run(["admin", "attach", "nixl", "--config", "{bad"], url=live.url, token=TOKEN)
    assert r.exit_code == 2


def test_tree(live: Live) -> None:
    r = run(["admin", "tree", "--prefix", "4,5", "--depth", "3"], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"prefix": [4, 5], "depth": 3, "children": []}
    r = run(["admin", "tree", "--depth", "9"], url=live.url)
    assert r.exit_code == 2


def test_lookup_and_forget(live: Live) -> None:
    r = run(["admin", "lookup", "--prefix", "4,5,6", "--cache-salt", "s"], url=live.url,
            token=TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["prefix_tokens"] == 3
    assert live.target.calls[-1] == ("lookup", ([4, 5, 6], "s"))
    r = run(["admin", "forget", "--prefix", "4,5", "--keep-tokens", "1", "-y"], url=live.url,
            token=TOKEN)
    assert r.exit_code == 0, r.output
    assert "kept_shared_pages" in r.output
    assert live.target.calls[-1] == ("forget", ([4, 5], None, 1))
    assert run(["admin", "forget", "--prefix", "", "-y"], url=live.url,
               token=TOKEN).exit_code == 2


def test_prefetch_pin_and_unpin(live: Live) -> None:
    r = run(["admin", "prefetch", "--prefix", "7,8,9", "--cache-salt", "s"], url=live.url,
            token=TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["prefetch_tokens"] == 0
    assert live.target.calls[-1] == ("prefetch", ([7, 8, 9], "s", None, None))
    r = run(["admin", "prefetch", "--prefix", "7", "--id", "t:1", "--ttl-s", "2"],
            url=live.url, token=TOKEN)
    assert r.exit_code == 0 and json.loads(r.output)["id"] == "t:1", r.output
    assert live.target.calls[-1] == ("prefetch", ([7], None, "t:1", 2.0))
    r = run(["admin", "prefetch-status", "t:1"], url=live.url, token=TOKEN)
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "done", r.output
    r = run(["admin", "prefetch-cancel", "t:1"], url=live.url, token=TOKEN)
    assert r.exit_code == 0 and json.loads(r.output)["status"] == "cancelled", r.output
    assert live.target.calls[-1] == ("cancel_prefetch", ("t:1",))
    r = run(["admin", "pin", "--prefix", "7,8", "--ttl-s", "90"], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"pinned_pages": 0, "ttl_s": 90.0}
    assert live.target.calls[-1] == ("pin", ([7, 8], None, 90.0))
    r = run(["admin", "unpin", "--prefix", "7,8"], url=live.url, token=TOKEN)
    assert r.exit_code == 0, r.output
    assert live.target.calls[-1] == ("unpin", ([7, 8], None))
    calls = len(live.target.calls)
    assert run(["admin", "pin", "--prefix", "7"], url=live.url, token=TOKEN).exit_code == 2
    assert run(["admin", "pin", "--prefix", "7", "--ttl-s", "0"], url=live.url,
               token=TOKEN).exit_code == 2
    assert run(["admin", "prefetch", "--prefix", ""], url=live.url, token=TOKEN).exit_code == 2
    assert len(live.target.calls) == calls


@pytest.mark.parametrize(
    "args",
    [["flush", "-y"], ["attach", "file"], ["detach"], ["forget", "--prefix", "1", "-y"],
     ["lookup", "--prefix", "1"], ["prefetch", "--prefix", "1"],
     ["pin", "--prefix", "1", "--ttl-s", "5"], ["unpin", "--prefix", "1"]],
)
def test_missing_or_wrong_token(live: Live, args: list[str]) -> None:
    r = run(["admin", *args], url=live.url)
    assert r.exit_code == EXIT_AUTH
    assert "authentication failed" in r.output and "HICACHE_ADMIN_TOKEN" in r.output
    r = run(["admin", *args], url=live.url, token="wrong")
    assert r.exit_code == EXIT_AUTH and "rejected" in r.output
    assert live.target.calls == []


def test_no_token_configured_on_server(servers: dict[str, Live]) -> None:
    s = servers["notoken"]
    r = run(["admin", "flush", "-y"], url=s.url, token=TOKEN)
    assert r.exit_code == EXIT_AUTH
    assert "forbidden" in r.output and "hicache_admin_token" in r.output
    assert s.target.calls == []
    # reads on loopback need no token
    assert run(["admin", "stats"], url=s.url).exit_code == 0


def test_connection_refused(dead_url: str) -> None:
    for args in (["stats"], ["flush", "-y"], ["detach"], ["tree"]):
        r = run(["admin", *args], url=dead_url, token=TOKEN)
        assert r.exit_code == EXIT_CONNECT, r.output
        assert "cannot connect" in r.output and dead_url in r.output


def test_bad_url() -> None:
    r = run(["admin", "stats", "--url", "notaurl"])
    assert r.exit_code != 0


def test_help_lists_commands_and_hides_token() -> None:
    r = run(["admin", "--help"], token=TOKEN)
    assert r.exit_code == 0
    for cmd in ("stats", "flush", "attach", "detach", "tree", "config"):
        assert cmd in r.output
    r = run(["admin", "stats", "--help"], token=TOKEN)
    assert r.exit_code == 0 and "HICACHE_ADMIN_TOKEN" in r.output


def test_main_is_the_console_entry(monkeypatch: pytest.MonkeyPatch, live: Live,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["hicache", "admin", "stats", "--json", "--url", live.url])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 0
    assert json.loads(capsys.readouterr().out)["tiers"]["l1"]["hits"] == 5
