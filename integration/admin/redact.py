"""Which configuration keys are secret, and how secrets are kept out of admin responses and logs.

Contract
========

:func:`is_secret_key` decides whether a key names a secret. After
normalising the key (:func:`normalize_key`: camelCase split, lower case,
``-``/``.``/space -> ``_``), and unless it is listed in
:data:`NON_SECRET_KEYS` (``page_key``, ``key_suffix``,
``prefetch_timeout_per_ki_token``, ...), a key is secret when:

1. it is one of :data:`SECRET_KEYS` (``key``, ``api_key``, ``hf_token``, ...), or
2. it contains one of :data:`SECRET_SUBSTRINGS` (``secret``, ``password``,
   ``passwd``, ``passphrase``, ``credential``, ``apikey``, ``api_key``,
   ``access_key``, ``private_key``, ``auth_key``, ``authorization``), or
3. one of its ``_``-separated words is in :data:`SECRET_WORDS` (``token``,
   ``key``, ``auth``, ``bearer``, ``cookie``, ``session``) or ends in
   ``token`` (``authtoken``); plurals such as ``tokens``,
   ``max_num_batched_tokens`` or ``num_keys`` are not secrets.

:func:`redact` returns a copy of a JSON-like value in which a secret key's
value (whatever its type, unless ``None``: an unset secret stays visibly
unset) is :data:`REDACTED`; dicts, lists and tuples are walked recursively
(tuples come back as lists); a string holding a JSON object
(``hicache_storage_backend_extra_config`` may be one) is redacted inside and
re-serialised; every other string goes through :func:`scrub`. The input is
never modified.

:func:`scrub` replaces every string (keys included) that contains the admin
token by :data:`REDACTED`; :func:`scrub_text` replaces just the token's
occurrences inside a text (for log lines, so a traceback stays readable).

The token may be given as a :class:`pydantic.SecretStr`, a ``str`` or
``None`` (nothing to scrub); this module is one of the two places (with
``auth.py``) where its value is read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import SecretStr

REDACTED = "<redacted>"

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


def _plain(token: SecretStr | str | None) -> str | None:
    """The token's value for matching, or ``None`` when there is nothing to scrub."""
    if isinstance(token, SecretStr):
        token = token.get_secret_value()
    return token or None


def redact(value: Any, token: SecretStr | str | None = None) -> Any:
    """A copy of ``value`` with secret keys' values and the admin token replaced by ``<redacted>``."""
    return _redact(value, _plain(token))


def _redact(value: Any, token: str | None) -> Any:
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if isinstance(k, str) and is_secret_key(k) and v is not None:
                out[k] = REDACTED
            else:
                out[k] = _redact(v, token)
        return out
    if isinstance(value, (list, tuple)):
        return [_redact(v, token) for v in value]
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("{") and stripped.endswith("}"):
            try:
                parsed = json.loads(stripped)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                return json.dumps(_redact(parsed, token))
        return _scrub(value, token)
    return value


def scrub(value: Any, token: SecretStr | str | None) -> Any:
    """``value`` with every string containing ``token`` replaced (recursively)."""
    return _scrub(value, _plain(token))


def _scrub(value: Any, token: str | None) -> Any:
    if not token:
        return value
    if isinstance(value, str):
        return REDACTED if token in value else value
    if isinstance(value, dict):
        return {_scrub(k, token): _scrub(v, token) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, token) for v in value]
    return value


def scrub_text(text: str, token: SecretStr | str | None) -> str:
    """``text`` with each occurrence of ``token`` replaced by ``<redacted>`` (for log lines)."""
    plain = _plain(token)
    return text.replace(plain, REDACTED) if plain else text
