"""The ``hicache`` command line: ``hicache admin ...`` talks to a running engine's admin API.

Contract
========

``main()`` runs the top-level typer app :data:`app` (console script
``hicache = hicache.integration.cli.main:main``). Sub-apps: ``admin`` (here),
``bench`` and the ``simulate`` command (``hicache.integration.bench.cli``).

``hicache admin`` commands (each takes ``--url``, default
``http://127.0.0.1:8790`` or ``$HICACHE_ADMIN_URL``; ``--token``, default
``$HICACHE_ADMIN_TOKEN``; ``--timeout`` seconds)::

    stats   [--json]                              one table row per tier, then queues/policy
    config                                        effective config (secrets redacted by the server)
    flush   [--tier l2 --tier l3 | default all] [--prefix 1,2,3] [--cache-salt S] [--yes]
    attach  BACKEND [--config JSON | --config-file PATH]
    detach
    tree    [--prefix 1,2,3] [--depth N]

Exit codes: 0 success, 1 the server refused or failed the request (its
detail is printed), 2 usage error, 3 cannot reach the server, 4 401/403
(missing, wrong or unconfigured token). Errors go to stderr; the token is
never printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.table import Table

from hicache.integration.bench.cli import register as register_bench

DEFAULT_URL = "http://127.0.0.1:8790"
URL_ENV = "HICACHE_ADMIN_URL"
TOKEN_ENV = "HICACHE_ADMIN_TOKEN"

EXIT_SERVER = 1
EXIT_CONNECT = 3
EXIT_AUTH = 4

app = typer.Typer(
    name="hicache",
    help="HiCache for vLLM: operator tools.",
    no_args_is_help=True,
    add_completion=False,
)
admin_app = typer.Typer(
    help="Inspect and control a running engine's HiCache through its admin API.",
    no_args_is_help=True,
)
app.add_typer(admin_app, name="admin")

UrlOpt = Annotated[
    str,
    typer.Option("--url", envvar=URL_ENV, help="Admin API base URL (hicache_admin_port)."),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", envvar=TOKEN_ENV, show_default=False, help="Admin bearer token (hicache_admin_token)."
    ),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", min=0.1, help="Request timeout, seconds.")]
SaltOpt = Annotated[
    str | None, typer.Option("--cache-salt", help="The cache_salt its requests carry.")]
PromptOpt = Annotated[str, typer.Option(help="The prompt's comma-separated token ids.")]


def _out() -> Console:
    return Console(soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, soft_wrap=True)


def _fail(message: str, code: int) -> NoReturn:
    _err().print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        if isinstance(detail, list):  # FastAPI validation errors
            parts = []
            for d in detail:
                if isinstance(d, dict):
                    loc = ".".join(str(x) for x in d.get("loc", ()) if x not in ("body", "query"))
                    parts.append(f"{loc}: {d.get('msg', '')}" if loc else str(d.get("msg", "")))
            return "; ".join(parts) or json.dumps(detail)
        return str(detail)
    return json.dumps(body)[:500]


def request(
    method: str,
    url: str,
    path: str,
    token: str | None,
    timeout: float,
    *,
    params: dict[str, Any] | None = None,
    body: dict[str, Any] | None = None,
) -> httpx.Response:
    """One request to the admin API; exits with a clear message on connection or auth errors."""
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            resp = client.request(method, base + path, headers=headers, params=params, json=body)
    except httpx.ConnectError:
        _fail(
            f"cannot connect to the HiCache admin server at {base} (is the engine running with "
            f"hicache_admin_port set? pass --url or set {URL_ENV})",
            EXIT_CONNECT,
        )
    except httpx.TimeoutException:
        _fail(f"the HiCache admin server at {base} did not answer within {timeout:g} s", EXIT_CONNECT)
    except httpx.HTTPError as e:
        _fail(f"request to {base}{path} failed: {type(e).__name__}", EXIT_CONNECT)
    except ValueError as e:  # malformed URL
        _fail(f"bad --url {url!r}: {e}", 2)
    if resp.status_code == 401:
        if token:
            why = f"the server rejected the admin token (check --token / {TOKEN_ENV})"
        else:
            why = f"the server needs the admin token (pass --token or set {TOKEN_ENV})"
        _fail(f"authentication failed: {why}", EXIT_AUTH)
    if resp.status_code == 403:
        _fail(f"forbidden: {_detail(resp)}", EXIT_AUTH)
    if resp.status_code >= 400:
        _fail(f"{resp.status_code} from {path}: {_detail(resp)}", EXIT_SERVER)
    return resp


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        _fail("the admin server sent a response that is not JSON", EXIT_SERVER)


def parse_prefix_option(prefix: str | None) -> list[int] | None:
    if prefix is None or not prefix.strip():
        return None
    try:
        ids = [int(p) for p in prefix.split(",")]
    except ValueError:
        raise typer.BadParameter("expected comma-separated token ids, e.g. 1,2,3") from None
    if any(i < 0 for i in ids):
        raise typer.BadParameter("token ids are non-negative")
    return ids


# ---- formatting -------------------------------------------------------------------


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    return f"{value:.2f} TB"  # pragma: no cover


def _num(v: Any) -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return "-"
    return f"{v:,}" if isinstance(v, int) else f"{v:,.3f}"


def _of(used: Any, cap: Any, fmt: Any = _num) -> str:
    if used is None and cap is None:
        return "-"
    return f"{fmt(used)} / {fmt(cap)}"


def _hit_rate(t: dict[str, Any]) -> str:
    hits, misses = t.get("hits"), t.get("misses")
    if not isinstance(hits, int) or not isinstance(misses, int) or hits + misses == 0:
        return "-"
    return f"{100.0 * hits / (hits + misses):.1f}%"


def stats_table(stats: dict[str, Any]) -> Table:
    """One row per tier."""
    table = Table(title="HiCache tiers")
    for col in (
        "tier", "pages used/cap", "bytes used/cap", "hits", "misses", "hit rate", "evictions",
        "loaded pages", "loaded", "saved pages", "saved", "load GB/s", "save GB/s", "corrupt",
        "down ranks", "backlog",
    ):
        table.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    tiers = stats.get("tiers") or {}
    for name, t in tiers.items():
        t = t or {}
        table.add_row(
            str(name),
            _of(t.get("used_pages"), t.get("capacity_pages")),
            _of(t.get("used_bytes"), t.get("capacity_bytes"), human_bytes),
            _num(t.get("hits")),
            _num(t.get("misses")),
            _hit_rate(t),
            _num(t.get("evictions")),
            _num(t.get("pages_loaded")),
            human_bytes(t.get("bytes_loaded")),
            _num(t.get("pages_saved")),
            human_bytes(t.get("bytes_saved")),
            _num(t.get("recent_load_gbps")),
            _num(t.get("recent_save_gbps")),
            _num(t.get("corrupt_pages")),
            _num(t.get("unreachable_ranks")),
            _num(t.get("backlog_pages")),
        )
    return table


def _kv_table(title: str, data: dict[str, Any]) -> Table:
    table = Table(title=title)
    table.add_column("name")
    table.add_column("value", justify="right")
    for k, v in data.items():
        table.add_row(str(k), _num(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                      else json.dumps(v) if not isinstance(v, str) else v)
    return table


# ---- commands -------------------------------------------------------------------


@admin_app.command()
def stats(
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw JSON.")] = False,
) -> None:
    """Per-tier usage, hits, evictions and transfer counters."""
    data = _json(request("GET", url, "/stats", token, timeout))
    out = _out()
    if as_json:
        out.print_json(data=data)
        return
    out.print(stats_table(data))
    for section in ("queues", "policy"):
        body = data.get(section)
        if isinstance(body, dict) and body:
            out.print(_kv_table(section, body))


@admin_app.command()
def config(
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """The effective HiCache configuration (secrets redacted)."""
    _out().print_json(data=_json(request("GET", url, "/config", token, timeout)))


@admin_app.command()
def flush(
    tier: Annotated[
        list[str] | None,
        typer.Option("--tier", "-t", help="l1, l2, l3 or all (repeatable; default all)."),
    ] = None,
    prefix: Annotated[
        str | None, typer.Option(help="Only pages under these comma-separated token ids.")
    ] = None,
    cache_salt: Annotated[
        str | None, typer.Option("--cache-salt", help="Only pages with this cache_salt.")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 60.0,
) -> None:
    """Drop cached pages (all tiers unless --tier is given)."""
    tiers = list(tier) if tier else ["all"]
    ids = parse_prefix_option(prefix)
    if not yes:
        scope = "everything" if ids is None else f"the {len(ids)}-token prefix"
        if cache_salt is not None:
            scope += " with that cache_salt"
        typer.confirm(f"Flush {scope} from {', '.join(tiers)}?", abort=True)
    body = {"tiers": tiers, "prefix": ids, "cache_salt": cache_salt}
    _print_counts("flushed", _json(request("POST", url, "/flush", token, timeout, body=body)))


@admin_app.command()
def attach(
    backend: Annotated[str, typer.Argument(help="file, mooncake, nixl or dynamic.")],
    config_json: Annotated[
        str | None,
        typer.Option("--config", help="Backend extra config as a JSON object."),
    ] = None,
    config_file: Annotated[
        Path | None,
        typer.Option("--config-file", exists=True, dir_okay=False, help="Read it from a file."),
    ] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 60.0,
) -> None:
    """Attach an L3 storage backend to the running engine."""
    if config_json is not None and config_file is not None:
        raise typer.BadParameter("give --config or --config-file, not both")
    text = config_file.read_text() if config_file is not None else config_json
    extra: Any = {}
    if text:
        try:
            extra = json.loads(text)
        except ValueError as e:
            raise typer.BadParameter(f"not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise typer.BadParameter("the backend config must be a JSON object")
    body = {"backend": backend, "extra_config": extra}
    _out().print_json(data=_json(request("POST", url, "/storage/attach", token, timeout, body=body)))


@admin_app.command()
def detach(
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 60.0,
) -> None:
    """Detach the L3 storage backend."""
    _out().print_json(data=_json(request("POST", url, "/storage/detach", token, timeout)))


@admin_app.command()
def tree(
    prefix: Annotated[str | None, typer.Option(help="Comma-separated token ids.")] = None,
    depth: Annotated[int, typer.Option(min=1, max=8, help="Levels below the prefix.")] = 2,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """A bounded JSON view of the HiRadixTree."""
    ids = parse_prefix_option(prefix)
    params: dict[str, Any] = {"depth": depth}
    if ids:
        params["prefix"] = ",".join(str(i) for i in ids)
    _out().print_json(data=_json(request("GET", url, "/tree", token, timeout, params=params)))


@admin_app.command()
def lookup(
    prefix: PromptOpt,
    cache_salt: SaltOpt = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Tokens of a prompt each tier holds, and the expected load time per tier."""
    ids = _prompt_ids(prefix)
    params: dict[str, Any] = {"prefix": ",".join(str(i) for i in ids)}
    if cache_salt is not None:
        params["cache_salt"] = cache_salt
    _out().print_json(data=_json(request("GET", url, "/lookup", token, timeout, params=params)))


@admin_app.command()
def forget(
    prefix: Annotated[str, typer.Option(help="The conversation's comma-separated token ids.")],
    cache_salt: Annotated[
        str | None, typer.Option("--cache-salt", help="The cache_salt its requests carried.")
    ] = None,
    keep_tokens: Annotated[
        int, typer.Option("--keep-tokens", min=0, help="Leading tokens never removed.")
    ] = 0,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 60.0,
) -> None:
    """Remove a conversation from every tier (not what other cached prompts share)."""
    ids = _prompt_ids(prefix)
    if not yes:
        typer.confirm(f"Forget the {len(ids)}-token conversation in L2 and L3?", abort=True)
    body = {"prefix": ids, "cache_salt": cache_salt, "keep_tokens": keep_tokens}
    _print_counts("forgotten", _json(request("POST", url, "/forget", token, timeout,
                                             body=body)))


@admin_app.command()
def prefetch(
    prefix: PromptOpt,
    cache_salt: SaltOpt = None,
    op_id: Annotated[str | None, typer.Option(
        "--id", help="The operation's id (the same id and prompt again: the same one).")] = None,
    ttl_s: Annotated[float | None, typer.Option(
        "--ttl-s", min=0.001, help="Seconds the workers may read once they start.")] = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Bring what L3 holds of a prompt into L2 now (a session due back after a tool call)."""
    body = {"prefix": _prompt_ids(prefix), "cache_salt": cache_salt, "id": op_id,
            "ttl_s": ttl_s}
    _out().print_json(data=_json(request("POST", url, "/prefetch", token, timeout, body=body)))


@admin_app.command("prefetch-status")
def prefetch_status(
    op_id: Annotated[str, typer.Argument(help="The id POST /prefetch answered.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """A prefetch operation: queued, running, done, failed or cancelled."""
    _out().print_json(data=_json(request("GET", url, f"/prefetch/{quote(op_id, safe='')}",
                                         token, timeout)))


@admin_app.command("prefetch-cancel")
def prefetch_cancel(
    op_id: Annotated[str, typer.Argument(help="The id POST /prefetch answered.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Cancel a prefetch (a running one stops after the batch in flight)."""
    _out().print_json(data=_json(request("DELETE", url, f"/prefetch/{quote(op_id, safe='')}",
                                         token, timeout)))


@admin_app.command()
def session(
    session_id: Annotated[str, typer.Argument(help="The session_id its requests carried.")],
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """A session: open or closed, its turns and pages, the hints it carries."""
    _out().print_json(data=_json(request("GET", url, f"/sessions/{quote(session_id, safe='')}",
                                         token, timeout)))


@admin_app.command("session-close")
def session_close(
    session_id: Annotated[str, typer.Argument(help="The session_id its requests carried.")],
    forget: Annotated[bool, typer.Option(
        "--forget", help="Also remove its own pages from L2 and L3.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 60.0,
) -> None:
    """Close a session: its pins end and its own pages go before any open session's."""
    if forget and not yes:
        typer.confirm(f"Remove session {session_id!r}'s own pages from L2 and L3?", abort=True)
    path = f"/sessions/{quote(session_id, safe='')}/close"
    _out().print_json(data=_json(request("POST", url, path, token, timeout,
                                         body={"forget": forget})))


@admin_app.command()
def pin(
    prefix: PromptOpt,
    ttl_s: Annotated[float, typer.Option("--ttl-s", min=0.001,
                                         help="Seconds to keep its L2 pages ahead of LRU.")],
    cache_salt: SaltOpt = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Keep what L2 holds of a prompt ahead of LRU for a while (within the retain share)."""
    body = {"prefix": _prompt_ids(prefix), "cache_salt": cache_salt, "ttl_s": ttl_s}
    _out().print_json(data=_json(request("POST", url, "/pin", token, timeout, body=body)))


@admin_app.command()
def unpin(
    prefix: PromptOpt,
    cache_salt: SaltOpt = None,
    url: UrlOpt = DEFAULT_URL,
    token: TokenOpt = None,
    timeout: TimeoutOpt = 10.0,
) -> None:
    """Release a prompt's pin now."""
    body = {"prefix": _prompt_ids(prefix), "cache_salt": cache_salt}
    _out().print_json(data=_json(request("DELETE", url, "/pin", token, timeout, body=body)))


def _prompt_ids(prefix: str) -> list[int]:
    ids = parse_prefix_option(prefix)
    if not ids:
        raise typer.BadParameter("give at least one token id", param_hint="--prefix")
    return ids


def _print_counts(title: str, counts: Any) -> None:
    """A flush's or forget's page counts as a two-column table."""
    table = Table(title=title)
    table.add_column("what")
    table.add_column("count", justify="right")
    for k, v in (counts or {}).items():
        table.add_row(str(k), _num(v))
    _out().print(table)


register_bench(app)


def main() -> None:
    """Console-script entry point (``hicache``)."""
    app()


if __name__ == "__main__":
    main()
