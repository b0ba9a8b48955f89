"""What the admin app needs from the cache (:class:`AdminTarget`), and calling it safely.

Contract
========

The connector implements :class:`AdminTarget`; the admin app never touches
the cache itself. Every target method is called from the server's worker
threads (the anyio thread pool, possibly several at once), never from the
event loop, so a slow ``flush`` does not stall ``/healthz``; the target must
be thread-safe.

:class:`TargetCalls` wraps each call and what it returns:

* A target reports a client error by raising a kind of
  :class:`~hicache.tiers.controller.admin.AdminError` (the engine-free core
  knows no HTTP): ``BadRequest`` is answered 400, ``Conflict`` 409,
  ``NotFound`` 404 (``STATUS``), each with ``{"detail": message}`` and the
  admin token scrubbed from the message (it is shown to the caller, so it must
  not contain secrets); any other kind becomes the generic 500 below.
* Any other exception becomes ``500 {"detail": INTERNAL_ERROR}``; the
  traceback is logged (logger ``hicache.integration.admin.target``) with the
  token scrubbed.
* A return value that is not plain JSON data (after :func:`to_json_value`:
  numpy-style scalars unwrapped, NaN/inf -> ``None``), not a JSON object, or
  that does not fit its response model, is the same generic 500, logged
  without the token.

Failures are raised as :class:`fastapi.HTTPException`.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from fastapi import HTTPException
from pydantic import BaseModel, SecretStr, ValidationError

from hicache.integration.admin.models import ErrorResponse
from hicache.integration.admin.redact import scrub, scrub_text
from hicache.tiers.controller.admin import AdminError, BadRequest, Conflict, NotFound

logger = logging.getLogger(__name__)
# The HTTP status of each kind of client error the core raises.
STATUS: dict[type[AdminError], int] = {BadRequest: 400, Conflict: 409, NotFound: 404}

INTERNAL_ERROR = "internal error in the HiCache admin target; see the server log"
MAX_JSON_DEPTH = 64

# OpenAPI: what a route that calls the target may answer besides its own responses.
TARGET_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Rejected by the cache (detail says why)"},
    404: {"model": ErrorResponse, "description": "No such session or operation"},
    409: {"model": ErrorResponse, "description": "Conflicts with the cache's state"},
    500: {"model": ErrorResponse, "description": "Internal error (details only in the server log)"},
}

T = TypeVar("T")


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
        ``BadRequest`` naming the allowed values.
        """
        ...

    def forget(self, prefix: list[int], cache_salt: str | None,
               keep_tokens: int) -> dict[str, int]:
        """Remove a conversation's own pages from every tier (not what other cached
        prefixes share with it); counts like ``flush``'s plus ``kept_shared_pages``."""
        ...

    def session(self, session_id: str) -> dict[str, Any]:
        """A session's state (``SessionStatus``); ``NotFound`` for an unknown id."""
        ...

    def close_session(self, session_id: str, forget: bool) -> dict[str, Any]:
        """Close a session (``SessionCloseResponse``); ``NotFound`` for an unknown id."""
        ...

    def lookup(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        """Tokens of ``prefix`` each tier holds and the expected load time per tier
        (``LookupResponse``)."""
        ...

    def prefetch(self, prefix: list[int], cache_salt: str | None, op_id: str | None = None,
                 ttl_s: float | None = None) -> dict[str, Any]:
        """Plan the prompt's L3 pages into L2 as the operation ``op_id``
        (``PrefetchResponse``); ``Conflict`` with no L3, no room in L2, an id that
        names another prompt, or too many running."""
        ...

    def prefetch_status(self, op_id: str) -> dict[str, Any]:
        """The operation (``PrefetchStatus``); ``NotFound`` for an unknown id."""
        ...

    def cancel_prefetch(self, op_id: str) -> dict[str, Any]:
        """Cancel the operation (``PrefetchStatus``); ``NotFound`` for an unknown id."""
        ...

    def pin(self, prefix: list[int], cache_salt: str | None, ttl_s: float) -> dict[str, Any]:
        """Keep the prefix's L2 pages ahead of LRU for ``ttl_s`` (``PinResponse``);
        ``Conflict`` when pins would pass their share of L2."""
        ...

    def unpin(self, prefix: list[int], cache_salt: str | None) -> dict[str, Any]:
        """Release the prefix's pin now (``UnpinResponse``)."""
        ...

    def attach_storage(self, backend: str, extra_config: dict[str, Any]) -> dict[str, Any]:
        """Attach an L3 backend at run time: ``{"attached": backend, ...}``.

        ``Conflict`` when one is attached.
        """
        ...

    def detach_storage(self) -> dict[str, Any]:
        """Detach the L3 backend: ``{"detached": name, ...}`` (``Conflict`` when none)."""
        ...

    def tree(self, prefix: list[int] | None, depth: int) -> dict[str, Any]:
        """A JSON view of the HiRadixTree below ``prefix``, at most ``depth`` levels deep."""
        ...


def internal_error() -> HTTPException:
    """The generic 500 (details go to the server log only)."""
    return HTTPException(500, INTERNAL_ERROR)


def to_json_value(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON data: numpy-style scalars unwrapped, NaN/inf -> None.

    Raises TypeError for anything else (sets, objects), ValueError for
    nesting deeper than :data:`MAX_JSON_DEPTH`.
    """
    if _depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
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


class TargetCalls:
    """Calls into one :class:`AdminTarget`, turning failures into HTTP errors (see module doc)."""

    def __init__(self, target: AdminTarget, token: SecretStr | None) -> None:
        self.target = target
        self._token = token

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``; an ``AdminError`` or any other exception becomes an ``HTTPException``."""
        try:
            return fn()
        except AdminError as e:
            status = next((STATUS[k] for k in type(e).__mro__ if k in STATUS), None)
            if status is None:
                raise internal_error() from None
            raise HTTPException(status, scrub(e.message, self._token)) from None
        except Exception:
            text = scrub_text(traceback.format_exc(), self._token)
            logger.error("HiCache admin: %s failed:\n%s", what, text)
            raise internal_error() from None

    def json_object(self, what: str, fn: Callable[[], Any]) -> dict[str, Any]:
        """``fn()``'s result as a plain JSON object (else the generic 500, logged)."""
        value = self.call(what, fn)
        try:
            plain = to_json_value(value)
        except (TypeError, ValueError, RecursionError) as e:
            logger.error("HiCache admin: %s returned a value that is not JSON: %s", what, e)
            raise internal_error() from None
        if not isinstance(plain, dict):
            logger.error("HiCache admin: %s returned %s, not a dict", what, type(value).__name__)
            raise internal_error()
        return plain

    def validated(self, what: str, model: type[BaseModel], value: Any) -> Any:
        """``value`` validated by ``model`` and dumped as JSON data (else the generic 500)."""
        try:
            return model.model_validate(value).model_dump(mode="json", exclude_none=False)
        except ValidationError as e:
            text = scrub_text(str(e), self._token)
            logger.error("HiCache admin: %s returned an invalid value: %s", what, text)
            raise internal_error() from None
