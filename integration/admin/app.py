"""HiCache's operator-facing HTTP admin API: the FastAPI app (routes and error handlers).

Contract
========

:func:`create_app` ``(target, token, *, require_token_for_reads)`` builds the
app over an :class:`~hicache.integration.admin.target.AdminTarget`; ``token``
is a :class:`pydantic.SecretStr`, a ``str`` or ``None`` and is kept as a
``SecretStr``. :class:`~hicache.integration.admin.server.AdminServer` serves
it. Its endpoints (request and response models in ``models.py``) are the
routes below, all in the OpenAPI schema at ``/openapi.json`` (browsable at
``/docs``); docs/reference/admin-api.md is generated from that schema.
``GET /healthz`` never needs a token; the ``read`` routes need one only with
``require_token_for_reads``; the ``write`` routes always do.

Where each rule lives:

* auth (``read``/``write`` above, 401/403): ``auth.py``;
* calling the target, ``AdminError`` -> 4xx, anything else -> a generic
  500 whose details go only to the server log: ``target.py``;
* secret keys and the token kept out of responses and logs: ``redact.py``.
  ``/config`` and the attach/detach results are :func:`redact`-ed; every
  other response, and every error detail (422s included), has the token
  :func:`scrub`-bed. The token never appears in a response, a header or a
  log line.
* ``/metrics`` is rendered by ``metrics.py`` from the validated ``/stats``.

``POST /flush`` passes the tier names lower-cased, stripped and
de-duplicated; names that are all blank are a 422 located at
``["body", "tiers"]``. A flush result that is not string -> int counts is
the generic 500.

Error handlers: ``HTTPException`` -> ``{"detail": message}`` (FastAPI's
own); request validation -> FastAPI's 422 shape with the token scrubbed; a
response that does not fit its model, or any unhandled exception -> the
generic 500, logged without data or token.
"""

from __future__ import annotations

import logging
import traceback
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError, ResponseValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import SecretStr

from hicache.integration.admin.auth import (
    AUTH_RESPONSES,
    TOKEN_CONFIG_KEY,
    TOKEN_ENV,
    TokenGuard,
)
from hicache.integration.admin.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from hicache.integration.admin.metrics import render_metrics
from hicache.integration.admin.models import (
    DEFAULT_TREE_DEPTH,
    MAX_TREE_DEPTH,
    MIN_TREE_DEPTH,
    PREFIX_QUERY_MAX_LENGTH,
    PREFIX_QUERY_PATTERN,
    AttachRequest,
    AttachResponse,
    ConfigResponse,
    DetachResponse,
    FlushRequest,
    FlushResponse,
    ForgetRequest,
    ForgetResponse,
    HealthResponse,
    LookupResponse,
    MetricsText,
    PinRequest,
    PinResponse,
    PrefetchRequest,
    PrefetchResponse,
    PrefetchStatus,
    SessionCloseRequest,
    SessionCloseResponse,
    SessionId,
    SessionStatus,
    StatsResponse,
    TreeResponse,
    UnpinRequest,
    UnpinResponse,
    parse_prefix,
)
from hicache.integration.admin.redact import redact, scrub
from hicache.integration.admin.target import (
    INTERNAL_ERROR,
    TARGET_RESPONSES,
    AdminTarget,
    TargetCalls,
    internal_error,
)

logger = logging.getLogger(__name__)

_GUARDED: dict[int | str, dict[str, Any]] = {**AUTH_RESPONSES, **TARGET_RESPONSES}


def _as_json(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """``responses`` documented as JSON on a route whose own media type is not JSON.

    FastAPI puts a ``"model"`` under the route's media type (``text/plain``
    for ``/metrics``), but errors are JSON; the models are in the schema's
    components through the other routes.
    """
    out: dict[int | str, dict[str, Any]] = {}
    for code, spec in responses.items():
        rest = {k: v for k, v in spec.items() if k != "model"}
        ref = {"$ref": f"#/components/schemas/{spec['model'].__name__}"}
        out[code] = {**rest, "content": {"application/json": {"schema": ref}}}
    return out


def _only_query(*allowed: str) -> Any:
    """A dependency refusing query parameters other than ``allowed`` (a typo such
    as ``?dpeth=4`` would otherwise be ignored silently), naming both."""

    def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - set(allowed))
        if unknown:
            raise RequestValidationError([{
                "type": "extra_forbidden", "loc": ("query", name),
                "msg": f"unknown query parameter {name!r}; allowed: {', '.join(allowed)}",
                "input": request.query_params[name]} for name in unknown])

    return check


def create_app(
    target: AdminTarget, token: SecretStr | str | None, *, require_token_for_reads: bool
) -> FastAPI:
    """The admin FastAPI app over ``target`` (see the module docstring for the contract)."""
    guard = TokenGuard(token, require_token_for_reads=require_token_for_reads)
    secret = guard.token
    calls = TargetCalls(target, secret)

    app = FastAPI(
        title="HiCache admin",
        version="1",
        description=(
            "Operator API of the HiCache KV connector: statistics, metrics, flush, "
            "L3 attach/detach, tree view. POST endpoints need the bearer token "
            f"({TOKEN_CONFIG_KEY} / {TOKEN_ENV})."
        ),
    )

    # ---- error handlers ---------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
        detail = scrub(jsonable_encoder(exc.errors()), secret)
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(ResponseValidationError)
    async def _invalid_response(request: Request, exc: ResponseValidationError) -> Response:
        logger.error(
            "HiCache admin: the response of %s does not fit its model (%d errors)",
            request.url.path, len(exc.errors()),
        )
        return JSONResponse(status_code=500, content={"detail": INTERNAL_ERROR})

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> Response:  # pragma: no cover
        logger.error("HiCache admin: unhandled %s on %s", type(exc).__name__, request.url.path)
        return JSONResponse(status_code=500, content={"detail": INTERNAL_ERROR})

    read_auth = Depends(guard.read)
    prefix_auth = Depends(guard.prefix_read)
    write_auth = Depends(guard.write)

    # ---- reads --------------------------------------------------------------------

    @app.get("/healthz", response_model=HealthResponse, tags=["read"])
    def healthz() -> HealthResponse:
        """Liveness: answers while the server runs; needs no token."""
        return HealthResponse(status="ok")

    @app.get(
        "/config",
        response_model=ConfigResponse,
        responses=_GUARDED,
        dependencies=[read_auth],
        tags=["read"],
    )
    def get_config() -> Any:
        """Effective HiCache configuration, secrets redacted."""
        return redact(calls.json_object("config()", target.config), secret)

    @app.get(
        "/stats",
        response_model=StatsResponse,
        responses=_GUARDED,
        dependencies=[read_auth],
        tags=["read"],
    )
    def get_stats() -> Any:
        """Per-tier capacity, usage, hit/miss, eviction and transfer counters; queues; policies."""
        value = calls.json_object("stats()", target.stats)
        return scrub(calls.validated("stats()", StatsResponse, value), secret)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            **_as_json(_GUARDED),
            200: {"model": MetricsText, "description": "Prometheus text format 0.0.4"},
        },
        dependencies=[read_auth],
        tags=["read"],
    )
    def get_metrics() -> Response:
        """The /stats numbers in the Prometheus text exposition format (``hicache_*``)."""
        value = calls.json_object("stats()", target.stats)
        data = scrub(calls.validated("stats()", StatsResponse, value), secret)
        try:
            text = render_metrics(data)
        except Exception:
            logger.error("HiCache admin: rendering metrics failed:\n%s", traceback.format_exc())
            raise internal_error() from None
        return Response(content=text, media_type=METRICS_CONTENT_TYPE)

    @app.get(
        "/tree",
        response_model=TreeResponse,
        responses=_GUARDED,
        dependencies=[prefix_auth, Depends(_only_query("prefix", "depth"))],
        tags=["read"],
    )
    def get_tree(
        prefix: Annotated[
            str | None,
            Query(
                max_length=PREFIX_QUERY_MAX_LENGTH,
                pattern=PREFIX_QUERY_PATTERN,
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
        return scrub(calls.json_object("tree()", lambda: target.tree(ids, depth)), secret)

    @app.get(
        "/lookup",
        response_model=LookupResponse,
        responses=_GUARDED,
        dependencies=[prefix_auth, Depends(_only_query("prefix", "cache_salt"))],
        tags=["read"],
    )
    def get_lookup(
        prefix: Annotated[
            str,
            Query(
                min_length=1,
                max_length=PREFIX_QUERY_MAX_LENGTH,
                pattern=PREFIX_QUERY_PATTERN,
                description="Comma-separated token ids of the prompt, e.g. 1,2,3",
            ),
        ],
        cache_salt: Annotated[str | None, Query(max_length=4096)] = None,
    ) -> Any:
        """Leading tokens of a prompt each tier holds, and the expected load time per
        tier from the bandwidth measured so far (what a router needs to cost a hit)."""
        ids = parse_prefix(prefix)
        if not ids:
            raise RequestValidationError([{
                "type": "value_error", "loc": ("query", "prefix"),
                "msg": "a prompt of at least one token id is needed", "input": prefix}])
        value = calls.json_object("lookup()", lambda: target.lookup(ids, cache_salt))
        return calls.validated("lookup()", LookupResponse, value)

    # ---- writes -------------------------------------------------------------------

    @app.post(
        "/forget",
        response_model=ForgetResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def post_forget(body: ForgetRequest) -> Any:
        """Remove a conversation from every tier: its own pages and its later turns, not
        the pages other cached prefixes share with it (e.g. a system prompt)."""
        counts = calls.json_object("forget()", lambda: target.forget(
            list(body.prefix), body.cache_salt, body.keep_tokens))
        if not all(isinstance(v, int) for v in counts.values()):
            logger.error("HiCache admin: forget() returned non-integer counts")
            raise internal_error()
        return counts

    @app.post(
        "/flush",
        response_model=FlushResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
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
        counts = calls.json_object(
            "flush()", lambda: target.flush(tiers, prefix, body.cache_salt)
        )
        if not all(isinstance(v, int) for v in counts.values()):
            logger.error("HiCache admin: flush() returned non-integer counts")
            raise internal_error()
        return counts

    @app.post(
        "/prefetch",
        response_model=PrefetchResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def post_prefetch(body: PrefetchRequest) -> Any:
        """Bring what L3 holds of a prompt into L2 now (with the next engine step, which
        an idle engine takes at once), so the session's next turn (after a tool call, a
        user's pause) is an L2 hit."""
        value = calls.json_object("prefetch()", lambda: target.prefetch(
            list(body.prefix), body.cache_salt, body.id, body.ttl_s))
        return calls.validated("prefetch()", PrefetchResponse, value)

    @app.get(
        "/prefetch/{op_id}",
        response_model=PrefetchStatus,
        responses=_GUARDED,
        dependencies=[read_auth],
        tags=["read"],
    )
    def get_prefetch(op_id: str) -> Any:
        """A prefetch operation's status: queued, running, done, failed or cancelled."""
        value = calls.json_object("prefetch_status()", lambda: target.prefetch_status(op_id))
        return calls.validated("prefetch_status()", PrefetchStatus, value)

    @app.delete(
        "/prefetch/{op_id}",
        response_model=PrefetchStatus,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def delete_prefetch(op_id: str) -> Any:
        """Cancel a prefetch: a queued one reads nothing, a running one stops after the
        batch in flight (the pages it read stay in L2)."""
        value = calls.json_object("cancel_prefetch()", lambda: target.cancel_prefetch(op_id))
        return calls.validated("cancel_prefetch()", PrefetchStatus, value)

    @app.get(
        "/sessions/{session_id}",
        response_model=SessionStatus,
        responses=_GUARDED,
        dependencies=[read_auth],
        tags=["read"],
    )
    def get_session(session_id: SessionId) -> Any:
        """A session: open or closed, its turns and pages, the hints it carries."""
        value = calls.json_object("session()", lambda: target.session(session_id))
        return calls.validated("session()", SessionStatus, value)

    @app.post(
        "/sessions/{session_id}/close",
        response_model=SessionCloseResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def close_session(session_id: SessionId,
                      body: SessionCloseRequest | None = None) -> Any:
        """Close a session: its pins end and its own pages are evicted before any open
        session's; with ``forget`` they leave L2 and L3 (not what others share)."""
        forget = body.forget if body is not None else False
        value = calls.json_object("close_session()",
                                  lambda: target.close_session(session_id, forget))
        return calls.validated("close_session()", SessionCloseResponse, value)

    @app.post(
        "/pin",
        response_model=PinResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def post_pin(body: PinRequest) -> Any:
        """Keep what L2 holds of a prompt ahead of LRU for ``ttl_s`` seconds (a session
        that will come back), within hicache_retain_max_share of L2."""
        value = calls.json_object("pin()", lambda: target.pin(
            list(body.prefix), body.cache_salt, body.ttl_s))
        return calls.validated("pin()", PinResponse, value)

    @app.delete(
        "/pin",
        response_model=UnpinResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def delete_pin(body: UnpinRequest) -> Any:
        """Release a prompt's pin now."""
        value = calls.json_object("unpin()", lambda: target.unpin(
            list(body.prefix), body.cache_salt))
        return calls.validated("unpin()", UnpinResponse, value)

    @app.post(
        "/storage/attach",
        response_model=AttachResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def post_attach(body: AttachRequest) -> Any:
        """Attach an L3 storage backend at run time."""
        extra = dict(body.extra_config)
        value = calls.json_object(
            "attach_storage()", lambda: target.attach_storage(body.backend, extra)
        )
        return redact(calls.validated("attach_storage()", AttachResponse, value), secret)

    @app.post(
        "/storage/detach",
        response_model=DetachResponse,
        responses=_GUARDED,
        dependencies=[write_auth],
        tags=["write"],
    )
    def post_detach() -> Any:
        """Detach the L3 storage backend (pending backups are the connector's concern)."""
        value = calls.json_object("detach_storage()", target.detach_storage)
        return redact(calls.validated("detach_storage()", DetachResponse, value), secret)

    return app

