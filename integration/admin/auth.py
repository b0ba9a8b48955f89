"""Bearer-token auth of the admin API: which requests need the token, and checking it.

Contract
========

The token is configured as ``hicache_admin_token`` (``kv_connector_extra_config``)
or the ``HICACHE_ADMIN_TOKEN`` environment variable and reaches the app as a
:class:`pydantic.SecretStr`, a ``str`` or ``None``; :func:`as_secret` turns it
into a ``SecretStr`` or ``None`` (an empty token is no token). Clients send
``Authorization: Bearer <token>``; it is compared with
:func:`secrets.compare_digest` (constant time), which is the only place
(with ``redact.py``'s scrubbing) where the token's value is read.

:class:`TokenGuard` provides three FastAPI dependencies:

* :meth:`TokenGuard.write` (POST endpoints) always needs the token. With no
  token configured it answers 403 telling the operator to set
  ``hicache_admin_token`` or ``HICACHE_ADMIN_TOKEN``.
* :meth:`TokenGuard.read` needs it only when ``require_token_for_reads``
  (the server sets this when it binds anything but a loopback address);
  then, with no token configured, reads answer the same 403. Otherwise a
  read passes whatever ``Authorization`` header it carries.
* :meth:`TokenGuard.prefix_read` (``GET /lookup``, ``GET /tree?prefix=``):
  like ``read``, and also needs the token whenever one is configured and
  the request names a prompt: whether a prompt is cached tells something
  about other users' prompts.
* A missing token (no header, or a scheme other than ``Bearer``): 401
  ``missing bearer token ...``; a wrong one: 401 ``invalid bearer token``;
  both with ``WWW-Authenticate: Bearer realm="hicache-admin"``.

Errors are raised as :class:`fastapi.HTTPException`, answered as
``{"detail": message}``; neither the message nor any header carries the
token, and nothing here logs.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from hicache.integration.admin.models import ErrorResponse

TOKEN_CONFIG_KEY = "hicache_admin_token"
TOKEN_ENV = "HICACHE_ADMIN_TOKEN"

NO_TOKEN_CONFIGURED = (
    "the HiCache admin API has no token configured: set "
    f"{TOKEN_CONFIG_KEY} in kv_connector_extra_config or the {TOKEN_ENV} "
    "environment variable, then send it as 'Authorization: Bearer <token>'"
)
MISSING_TOKEN = "missing bearer token (Authorization: Bearer <token>)"
INVALID_TOKEN = "invalid bearer token"
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="hicache-admin"'}

# OpenAPI: what a guarded route may answer besides its own responses.
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorResponse, "description": "No admin token configured"},
}

bearer_scheme = HTTPBearer(
    auto_error=False,
    description=f"The admin token ({TOKEN_CONFIG_KEY} / {TOKEN_ENV}).",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def as_secret(token: SecretStr | str | None) -> SecretStr | None:
    """``token`` as a ``SecretStr``; ``None`` for no token or an empty one."""
    if token is None:
        return None
    secret = token if isinstance(token, SecretStr) else SecretStr(str(token))
    return secret if secret.get_secret_value() else None


class TokenGuard:
    """The read and write auth rules over one configured token (see the module docstring)."""

    def __init__(self, token: SecretStr | str | None, *, require_token_for_reads: bool) -> None:
        self._token = as_secret(token)
        self.require_token_for_reads = bool(require_token_for_reads)

    @property
    def token(self) -> SecretStr | None:
        """The configured token (for scrubbing responses and logs), or ``None``."""
        return self._token

    @property
    def configured(self) -> bool:
        return self._token is not None

    def check(self, creds: HTTPAuthorizationCredentials | None, *, needed: bool) -> None:
        """Pass, or raise the 403/401 ``HTTPException`` the rules call for."""
        if not needed:
            return
        if self._token is None:
            raise HTTPException(403, NO_TOKEN_CONFIGURED)
        if creds is None or not creds.credentials:
            raise HTTPException(401, MISSING_TOKEN, headers=dict(CHALLENGE))
        sent = creds.credentials.encode("utf-8")
        expected = self._token.get_secret_value().encode("utf-8")
        if not secrets.compare_digest(sent, expected):
            raise HTTPException(401, INVALID_TOKEN, headers=dict(CHALLENGE))

    def read(self, creds: Credentials) -> None:
        """Dependency of the GET endpoints (all but ``/healthz``)."""
        self.check(creds, needed=self.require_token_for_reads)

    def prefix_read(self, creds: Credentials, request: Request) -> None:
        """Dependency of the GET endpoints that take a prompt (``prefix``): whether a
        prompt is cached is the prompt's secret, so they need the token whenever one
        is configured, on loopback too."""
        asks = bool(request.query_params.get("prefix", "").strip())
        self.check(creds, needed=self.require_token_for_reads or (asks and self.configured))

    def write(self, creds: Credentials) -> None:
        """Dependency of the POST endpoints."""
        self.check(creds, needed=True)
