"""HiCache's operator-facing HTTP admin API: FastAPI app, auth, and a background uvicorn server.

Contract
========

The connector implements :class:`AdminTarget`; this module never touches
the cache itself. Every target method is called from the server's worker
threads (the anyio thread pool, possibly several at once), never from the
event loop, so a slow ``flush`` does not stall ``/healthz``; the target
must be thread-safe.

A target reports a client error by raising :class:`AdminError`
``(status_code, message)``: the client gets ``status_code`` and
``{"detail": message}`` (the message is shown to the caller, so it must not
contain secrets; the admin token is scrubbed from it regardless). Any other
exception, and any return value that does not fit the response schema,
becomes ``500 {"detail": "internal error in the HiCache admin target; see the
server log"}``; the traceback is logged with the token scrubbed.

Endpoints (``create_app``)::

    GET  /healthz                     {"status": "ok"}                     never needs a token
    GET  /config                      effective config, secrets redacted   read
    GET  /stats                       {"tiers": {...}, "queues": {...}, "policy": {...}, ...}  read
    GET  /metrics                     Prometheus text 0.0.4, hicache_*     read
    GET  /tree?prefix=1,2,3&depth=N   bounded JSON view of the HiRadixTree read
    POST /flush                       {"tiers": [...], "prefix": [...]|null, "cache_salt": str|null}
    POST /storage/attach              {"backend": str, "extra_config": {...}}
    POST /storage/detach

Auth: ``Authorization: Bearer <token>``, compared in constant time.

* POST endpoints always need the token. With no token configured they answer
  403 telling the operator to set ``hicache_admin_token`` or
  ``HICACHE_ADMIN_TOKEN``.
* Reads need it only when ``require_token_for_reads`` (the server sets this
  when it binds anything but a loopback address); then, with no token
  configured, reads answer the same 403.
* A missing or wrong token: 401 with ``WWW-Authenticate: Bearer``.
* ``/healthz``, ``/docs`` and ``/openapi.json`` are open (no data in them).
* The token never appears in a response, a header or a log line.

Redaction (``/config``, and the results of attach/detach): see
:func:`redact`. A key is secret when, after normalising it (camelCase split,
lower case, ``-``/``.``/space -> ``_``) and unless it is listed in
:data:`NON_SECRET_KEYS` (``page_key``, ``key_suffix``,
``prefetch_timeout_per_ki_token``, ...):

1. it is one of :data:`SECRET_KEYS` (``key``, ``api_key``, ``hf_token``, ...), or
2. it contains one of :data:`SECRET_SUBSTRINGS` (``secret``, ``password``,
   ``passwd``, ``passphrase``, ``credential``, ``apikey``, ``api_key``,
   ``access_key``, ``private_key``, ``auth_key``, ``authorization``), or
3. one of its ``_``-separated words is ``token`` or ``key``, or ends in
   ``token`` (``authtoken``), or is ``auth``/``bearer``/``cookie``/``session``
   (plural counts such as ``tokens``, ``max_num_batched_tokens`` or
   ``num_keys`` are not secrets).

A secret key's value (whatever its type, unless ``None``) becomes
``"<redacted>"``; dicts and lists are walked recursively; a string value that
holds a JSON object (``hicache_storage_backend_extra_config`` may be one) is
redacted inside and re-serialised. Independently, any string equal to or
containing the admin token is replaced in every response.

:class:`AdminServer` runs the app with uvicorn in a daemon thread:
``start(host, port)`` returns once the socket listens (``port=0`` picks a
free port; :attr:`AdminServer.port` is the actual one) or raises
:class:`AdminServerError` naming the address and ``hicache_admin_port``;
``stop()`` returns within a few seconds and frees the port.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import re
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Annotated, Any, Protocol, TypeVar, runtime_checkable

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hicache.integration.admin.prometheus_text import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hicache.integration.admin.prometheus_text import render_metrics

logger = logging.getLogger(__name__)

TOKEN_CONFIG_KEY = "hicache_admin_token"
TOKEN_ENV = "HICACHE_ADMIN_TOKEN"
PORT_CONFIG_KEY = "hicache_admin_port"
REDACTED = "<redacted>"
MIN_TREE_DEPTH = 1
MAX_TREE_DEPTH = 8
DEFAULT_TREE_DEPTH = 2
MAX_PREFIX_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 63) - 1
INTERNAL_ERROR = "internal error in the HiCache admin target; see the server log"


# --------------------------------------------------------------------------- #
# The protocol the connector implements
# --------------------------------------------------------------------------- #


class AdminError(Exception):
    """A client error raised by an :class:`AdminTarget`: answered as ``status_code`` + message."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(message)
        self.status_code = int(status_code)
        self.message = str(message)


@runtime_checkable
class AdminTarget(Protocol):
    """What the admin app needs from the connector (thread-safe; see the module docstring)."""

    def config(self) -> dict[str, Any]:
        """Effective configuration (the app redacts secrets itself as well)."""
        ...

    def stats(self) -> dict[str, Any]:
        """``{"tiers": {"l1": {...}, "l2": {...}, "l3": {...}}, "queues": {...}, "policy": {...}, ...}``.

        Tier dicts may carry capacity_pages, used_pages, capacity_bytes,
        used_bytes, hits, misses, evictions, pages_loaded, bytes_loaded,
        pages_saved, bytes_saved, recent_load_gbps, recent_save_gbps,
        corrupt_pages (any may be absent or None), plus other numbers.
        """
        ...

    def flush(
        self, tiers: list[str], prefix: list[int] | None, cache_salt: str | None
    ) -> dict[str, int]:
        """Drop cached pages; counts per tier, e.g. ``{"l2_pages": 3, "l3_pages": 3, "skipped_locked": 0}``.

        ``tiers`` is what the client sent, lower-cased, stripped, de-duplicated
        (e.g. ``["l2", "l3"]`` or ``["all"]``); unknown names raise
        ``AdminError(400, ...)`` naming the allowed values.
        """
        ...

    def attach_storage(self, backend: str, extra_config: dict[str, Any]) -> dict[str, Any]:
        """Attach an L3 backend at run time (``AdminError(409)`` when one is attached)."""
        ...

    def detach_storage(self) -> dict[str, Any]:
        """Detach the L3 backend (``AdminError(409)`` when none is attached)."""
        ...

    def tree(self, prefix: list[int] | None, depth: int) -> dict[str, Any]:
        """A JSON view of the HiRadixTree below ``prefix``, at most ``depth`` levels deep."""
        ...


# --------------------------------------------------------------------------- #
# Redaction
# --------------------------------------------------------------------------- #

SECRET_KEYS: frozenset[str] = frozenset(
    {
        "key", "api_key", "apikey", "access_key", "access_key_id", "secret_access_key",
        "private_key", "ssh_key", "encryption_key", "master_key", "signing_key", "hmac_key",
        "sas_key", "auth", "authorization", "bearer", "cookie", "session", "pat",
        "token", "hf_token", "hicache_admin_token", "session_token", "access_token",
        "refresh_token", "id_token", "sas_token", "password", "passwd", "pwd",
        "client_secret", "credentials", "connection_string", "dsn",
    }
)
SECRET_SUBSTRINGS: tuple[str, ...] = (
    "secret", "password", "passwd", "passphrase", "credential", "apikey", "api_key",
    "access_key", "accesskey", "private_key", "privatekey", "auth_key", "authorization",
)
SECRET_WORDS: frozenset[str] = frozenset({"token", "key", "auth", "bearer", "cookie", "session"})
NON_SECRET_KEYS: frozenset[str] = frozenset(
    {
        "page_key", "page_keys", "key_suffix", "key_prefix", "key_namespace", "object_key",
        "cache_key", "cache_salt_key", "hash_key", "sort_key",
        "prefetch_timeout_per_ki_token", "per_ki_token", "token_ids", "first_token",
        "max_tokens_per_page", "tokens_per_page", "session_id", "auth_mode",
    }
)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEP = re.compile(r"[-.\s]+")


def normalize_key(key: str) -> str:
    """``"hfToken"`` / ``"HF-Token"`` -> ``"hf_token"``."""
    return _SEP.sub("_", _CAMEL.sub("_", str(key))).lower()


def is_secret_key(key: str) -> bool:
    """Whether a config key names a secret (rules in the module docstring)."""
    norm = normalize_key(key)
    if norm in NON_SECRET_KEYS:
        return False
    if norm in SECRET_KEYS:
        return True
    if any(s in norm for s in SECRET_SUBSTRINGS):
        return True
    for word in norm.split("_"):
        if word in SECRET_WORDS or (word.endswith("token") and word != "token"):
            return True
    return False


def redact(value: Any, token: str | None = None) -> Any:
    """A copy of ``value`` with secret keys' values and the admin token replaced by ``<redacted>``."""
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if isinstance(k, str) and is_secret_key(k) and v is not None:
                out[k] = REDACTED
            else:
                out[k] = redact(v, token)
        return out
    if isinstance(value, (list, tuple)):
        return [redact(v, token) for v in value]
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("{") and stripped.endswith("}"):
            try:
                parsed = json.loads(stripped)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                return json.dumps(redact(parsed, token))
        return scrub(value, token)
    return value


def scrub(value: Any, token: str | None) -> Any:
    """``value`` with every string containing ``token`` replaced (recursively)."""
    if not token:
        return value
    if isinstance(value, str):
        return REDACTED if token in value else value
    if isinstance(value, dict):
        return {scrub(k, token): scrub(v, token) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v, token) for v in value]
    return value


# --------------------------------------------------------------------------- #
# Request / response models
# --------------------------------------------------------------------------- #

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]


class HealthResponse(BaseModel):
    status: str = Field(description='Always "ok" while the server answers.')


class TierStats(BaseModel):
    """One tier's numbers; every field may be absent or null, extra numeric keys are kept."""

    model_config = ConfigDict(extra="allow")

    capacity_pages: int | None = None
    used_pages: int | None = None
    capacity_bytes: int | None = None
    used_bytes: int | None = None
    hits: int | None = None
    misses: int | None = None
    evictions: int | None = None
    pages_loaded: int | None = None
    bytes_loaded: int | None = None
    pages_saved: int | None = None
    bytes_saved: int | None = None
    recent_load_gbps: float | None = Field(None, description="GB/s (1e9 bytes/s), recent window")
    recent_save_gbps: float | None = Field(None, description="GB/s (1e9 bytes/s), recent window")
    corrupt_pages: int | None = None


class StatsResponse(BaseModel):
    """Statistics of every tier, the queues and the policies; further sections pass through."""

    model_config = ConfigDict(extra="allow")

    tiers: dict[str, TierStats] = Field(default_factory=dict, description='"l1", "l2", "l3"')
    queues: dict[str, Any] = Field(default_factory=dict)
    policy: dict[str, Any] = Field(default_factory=dict)


class FlushRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: list[Annotated[str, Field(min_length=1, max_length=32)]] = Field(
        ..., min_length=1, max_length=16, description='Tier names, e.g. ["l2", "l3"], or ["all"]'
    )
    prefix: list[TokenId] | None = Field(
        None,
        max_length=MAX_PREFIX_TOKENS,
        description="Only pages under this token-id prefix; null flushes everything",
    )
    cache_salt: str | None = Field(
        None, max_length=4096, description="Only pages of requests with this cache_salt"
    )


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        ..., min_length=1, max_length=256, description='"file", "mooncake", "nixl" or "dynamic"'
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="As hicache_storage_backend_extra_config"
    )


class ErrorResponse(BaseModel):
    detail: str


# --------------------------------------------------------------------------- #
# The app
# --------------------------------------------------------------------------- #

_bearer = HTTPBearer(
    auto_error=False,
    description=f"The admin token ({TOKEN_CONFIG_KEY} / {TOKEN_ENV}).",
)
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]

_AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorResponse, "description": "No admin token configured"},
}
_TARGET_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Rejected by the cache (detail says why)"},
    409: {"model": ErrorResponse, "description": "Conflicts with the cache's state"},
    500: {"model": ErrorResponse, "description": "Internal error (details only in the server log)"},
}

T = TypeVar("T")


class _Reply(Exception):
    """Internal: short-circuit an endpoint with a ready response."""

    def __init__(self, response: Response) -> None:
        super().__init__("reply")
        self.response = response


def _error(status_code: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status_code, content={"detail": detail}, headers=headers)


def _no_token_configured() -> JSONResponse:
    return _error(
        403,
        "the HiCache admin API has no token configured: set "
        f"{TOKEN_CONFIG_KEY} in kv_connector_extra_config or the {TOKEN_ENV} "
        "environment variable, then send it as 'Authorization: Bearer <token>'",
    )


def _unauthorized(detail: str) -> JSONResponse:
    return _error(401, detail, headers={"WWW-Authenticate": 'Bearer realm="hicache-admin"'})


def create_app(
    target: AdminTarget, token: str | None, *, require_token_for_reads: bool
) -> FastAPI:
    """The admin FastAPI app over ``target`` (see the module docstring for the contract)."""
    token = token or None
    token_bytes = token.encode("utf-8") if token else None

    def check(creds: HTTPAuthorizationCredentials | None, *, needed: bool) -> None:
        if not needed:
            return
        if token_bytes is None:
            raise _Reply(_no_token_configured())
        if creds is None or not creds.credentials:
            raise _Reply(_unauthorized("missing bearer token (Authorization: Bearer <token>)"))
        if not hmac.compare_digest(creds.credentials.encode("utf-8"), token_bytes):
            raise _Reply(_unauthorized("invalid bearer token"))

    def call(what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except AdminError as e:
            status = e.status_code if 400 <= e.status_code <= 599 else 500
            detail = scrub(e.message, token) if status != 500 else INTERNAL_ERROR
            raise _Reply(_error(status, detail)) from None
        except Exception:
            text = traceback.format_exc()
            if token:
                text = text.replace(token, REDACTED)
            logger.error("HiCache admin: %s failed:\n%s", what, text)
            raise _Reply(_error(500, INTERNAL_ERROR)) from None

    def validated(what: str, model: type[BaseModel], value: Any) -> Any:
        try:
            return model.model_validate(value).model_dump(mode="json", exclude_none=False)
        except ValidationError as e:
            text = str(e)
            if token:
                text = text.replace(token, REDACTED)
            logger.error("HiCache admin: %s returned an invalid value: %s", what, text)
            raise _Reply(_error(500, INTERNAL_ERROR)) from None

    def as_json_object(what: str, value: Any) -> dict[str, Any]:
        try:
            plain = to_json_value(value)
        except (TypeError, ValueError, RecursionError) as e:
            logger.error("HiCache admin: %s returned a value that is not JSON: %s", what, e)
            raise _Reply(_error(500, INTERNAL_ERROR)) from None
        if not isinstance(plain, dict):
            logger.error("HiCache admin: %s returned %s, not a dict", what, type(value).__name__)
            raise _Reply(_error(500, INTERNAL_ERROR))
        return plain

    app = FastAPI(
        title="HiCache admin",
        version="1",
        description=(
            "Operator API of the HiCache KV connector: statistics, metrics, flush, "
            "L3 attach/detach, tree view. POST endpoints need the bearer token "
            f"({TOKEN_CONFIG_KEY} / {TOKEN_ENV})."
        ),
    )

    @app.exception_handler(_Reply)
    async def _reply_handler(request: Request, exc: _Reply) -> Response:
        return exc.response

    @app.exception_handler(Exception)
    async def _fallback_handler(request: Request, exc: Exception) -> Response:  # pragma: no cover
        logger.error("HiCache admin: unhandled %s on %s", type(exc).__name__, request.url.path)
        return _error(500, INTERNAL_ERROR)

    def read_auth(creds: _Credentials) -> None:
        check(creds, needed=require_token_for_reads)

    def write_auth(creds: _Credentials) -> None:
        check(creds, needed=True)

    ReadAuth = Depends(read_auth)
    WriteAuth = Depends(write_auth)

    @app.get("/healthz", response_model=HealthResponse, tags=["read"])
    def healthz() -> dict[str, str]:
        """Liveness: answers while the server runs; needs no token."""
        return {"status": "ok"}

    @app.get(
        "/config",
        response_model=dict[str, Any],
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[ReadAuth],
        tags=["read"],
    )
    def get_config() -> Any:
        """Effective HiCache configuration, secrets redacted."""
        value = as_json_object("config()", call("config()", target.config))
        return redact(value, token)

    @app.get(
        "/stats",
        response_model=StatsResponse,
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[ReadAuth],
        tags=["read"],
    )
    def get_stats() -> Any:
        """Per-tier capacity, usage, hit/miss, eviction and transfer counters; queues; policies."""
        value = as_json_object("stats()", call("stats()", target.stats))
        return scrub(validated("stats()", StatsResponse, value), token)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            **_AUTH_RESPONSES,
            **_TARGET_RESPONSES,
            200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4"},
        },
        dependencies=[ReadAuth],
        tags=["read"],
    )
    def get_metrics() -> Response:
        """The /stats numbers in the Prometheus text exposition format (``hicache_*``)."""
        value = as_json_object("stats()", call("stats()", target.stats))
        data = scrub(validated("stats()", StatsResponse, value), token)
        try:
            text = render_metrics(data)
        except Exception:
            logger.error("HiCache admin: rendering metrics failed:\n%s", traceback.format_exc())
            return _error(500, INTERNAL_ERROR)
        return Response(content=text, media_type=METRICS_CONTENT_TYPE)

    @app.get(
        "/tree",
        response_model=dict[str, Any],
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[ReadAuth],
        tags=["read"],
    )
    def get_tree(
        prefix: Annotated[
            str | None,
            Query(
                max_length=64 * 1024,
                pattern=r"^\s*(\d+\s*(,\s*\d+\s*)*)?$",
                description="Comma-separated token ids, e.g. 1,2,3; empty or absent: the root",
            ),
        ] = None,
        depth: Annotated[
            int,
            Query(ge=MIN_TREE_DEPTH, le=MAX_TREE_DEPTH, description="Levels below the prefix"),
        ] = DEFAULT_TREE_DEPTH,
    ) -> Any:
        """A bounded JSON view of the HiRadixTree below ``prefix``."""
        ids = parse_prefix(prefix)
        value = as_json_object("tree()", call("tree()", lambda: target.tree(ids, depth)))
        return scrub(value, token)

    @app.post(
        "/flush",
        response_model=dict[str, int],
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[WriteAuth],
        tags=["write"],
    )
    def post_flush(body: FlushRequest) -> Any:
        """Drop cached pages from the given tiers (optionally only under a prefix / cache_salt)."""
        tiers: list[str] = []
        for t in body.tiers:
            name = t.strip().lower()
            if name and name not in tiers:
                tiers.append(name)
        if not tiers:
            raise RequestValidationError(
                [{"type": "value_error", "loc": ("body", "tiers"), "msg": "no tier named",
                  "input": body.tiers}]
            )
        prefix = list(body.prefix) if body.prefix is not None else None
        value = call("flush()", lambda: target.flush(tiers, prefix, body.cache_salt))
        counts = as_json_object("flush()", value)
        if not all(isinstance(k, str) and isinstance(v, int) for k, v in counts.items()):
            logger.error("HiCache admin: flush() returned non-integer counts")
            return _error(500, INTERNAL_ERROR)
        return counts

    @app.post(
        "/storage/attach",
        response_model=dict[str, Any],
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[WriteAuth],
        tags=["write"],
    )
    def post_attach(body: AttachRequest) -> Any:
        """Attach an L3 storage backend at run time."""
        extra = dict(body.extra_config)
        value = call("attach_storage()", lambda: target.attach_storage(body.backend, extra))
        return redact(as_json_object("attach_storage()", value), token)

    @app.post(
        "/storage/detach",
        response_model=dict[str, Any],
        responses={**_AUTH_RESPONSES, **_TARGET_RESPONSES},
        dependencies=[WriteAuth],
        tags=["write"],
    )
    def post_detach() -> Any:
        """Detach the L3 storage backend (pending backups are the connector's concern)."""
        value = call("detach_storage()", target.detach_storage)
        return redact(as_json_object("detach_storage()", value), token)

    return app


def to_json_value(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON data: numpy-style scalars unwrapped, NaN/inf -> None.

    Raises TypeError for anything else (sets, objects) or nesting deeper than 64.
    """
    if _depth > 64:
        raise ValueError("nested deeper than 64 levels")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_json_value(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, _depth + 1) for v in value]
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item) and getattr(value, "ndim", 0) == 0:
        return to_json_value(item(), _depth + 1)
    raise TypeError(f"{type(value).__name__} is not JSON data")


def parse_prefix(prefix: str | None) -> list[int] | None:
    """``"1, 2,3"`` -> ``[1, 2, 3]``; ``None``/``""`` -> ``None``; else a 422 naming ``prefix``."""
    if prefix is None or not prefix.strip():
        return None
    try:
        ids = [int(p) for p in prefix.split(",")]
    except ValueError:
        ids = None
    if ids is None or len(ids) > MAX_PREFIX_TOKENS or any(i < 0 or i > MAX_TOKEN_ID for i in ids):
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("query", "prefix"),
                    "msg": "prefix must be comma-separated token ids (0 <= id < 2**63), e.g. 1,2,3",
                    "input": prefix[:100],
                }
            ]
        )
    return ids


# --------------------------------------------------------------------------- #
# The server
# --------------------------------------------------------------------------- #


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
    """The admin app under uvicorn in a daemon thread.

    ``require_token_for_reads`` defaults to "``host`` is not loopback";
    pass it explicitly only to override that (tests).
    """

    START_TIMEOUT_S = 15.0
    STOP_TIMEOUT_S = 3.0

    def __init__(
        self,
        target: AdminTarget,
        token: str | None,
        *,
        require_token_for_reads: bool | None = None,
    ) -> None:
        self._target = target
        self._token = token or None
        self._require_reads_override = require_token_for_reads
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._error: BaseException | None = None
        self._host: str | None = None
        self._port: int | None = None
        self._lock = threading.Lock()
        self.require_token_for_reads: bool | None = None

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
