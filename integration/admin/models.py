"""The admin API's request and response models (pydantic), and the limits they enforce.

Contract
========

Requests (``extra="forbid"``: an unknown field is a 422 naming it):

* :class:`FlushRequest` - ``POST /flush``: 1..16 tier names of 1..32
  characters, an optional ``prefix`` of at most :data:`MAX_PREFIX_TOKENS`
  strict integer token ids in ``0..MAX_TOKEN_ID``, an optional ``cache_salt``.
* :class:`AttachRequest` - ``POST /storage/attach``: a backend name of
  1..256 characters and an ``extra_config`` object.
* ``GET /tree`` takes query parameters, not a body: ``prefix`` is parsed by
  :func:`parse_prefix` (a 422 located at ``["query", "prefix"]``), ``depth``
  is bounded by :data:`MIN_TREE_DEPTH`..:data:`MAX_TREE_DEPTH`.

Responses (each is the ``response_model`` of its route, so it is named in
the OpenAPI schema; the JSON is exactly the model's dump):

=====================  ================================================
``GET /healthz``       :class:`HealthResponse` ``{"status": "ok"}``
``GET /config``        :class:`ConfigResponse` (any object, secrets redacted)
``GET /stats``         :class:`StatsResponse` (``tiers`` of :class:`TierStats`,
                       ``queues``, ``policy``, further sections pass through)
``GET /metrics``       :class:`MetricsText` (Prometheus text, not JSON)
``GET /tree``          :class:`TreeResponse` (the target's view, any object)
``POST /flush``        :class:`FlushResponse` (page counts: string -> int)
``POST /forget``       :class:`ForgetResponse` (page counts: string -> int)
``GET /lookup``        :class:`LookupResponse` (tokens per tier, expected load time)
``POST /prefetch``     :class:`PrefetchResponse`; ``GET`` / ``DELETE /prefetch/{id}``:
                       :class:`PrefetchStatus`
``POST /pin``          :class:`PinResponse`; ``DELETE /pin``: :class:`UnpinResponse`
``GET /sessions/{id}`` :class:`SessionStatus`; ``POST /sessions/{id}/close``
                       (:class:`SessionCloseRequest`): :class:`SessionCloseResponse`
``POST /storage/...``  :class:`AttachResponse` (``attached`` + more) /
                       :class:`DetachResponse` (``detached`` + more)
errors                 :class:`ErrorResponse` ``{"detail": str}`` (401, 403,
                       4xx from the target, 500); 422 is FastAPI's own
                       ``HTTPValidationError``
=====================  ================================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, RootModel

MIN_TREE_DEPTH = 1
MAX_TREE_DEPTH = 8
DEFAULT_TREE_DEPTH = 2
MAX_PREFIX_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 63) - 1
# What ``GET /tree?prefix=`` accepts before parse_prefix checks the ranges.
PREFIX_QUERY_PATTERN = r"^\s*(\d+\s*(,\s*\d+\s*)*)?$"
PREFIX_QUERY_MAX_LENGTH = 64 * 1024

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]


# --------------------------------------------------------------------------- #
# Requests
# --------------------------------------------------------------------------- #


class FlushRequest(BaseModel):
    """Which cached pages ``POST /flush`` drops."""

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


class ForgetRequest(BaseModel):
    """Which conversation ``POST /forget`` removes from every tier."""

    model_config = ConfigDict(extra="forbid")

    prefix: list[TokenId] = Field(
        ..., min_length=1, max_length=MAX_PREFIX_TOKENS,
        description="The conversation's token ids (any turn of it: its later turns go too)")
    cache_salt: str | None = Field(
        None, max_length=4096, description="The cache_salt its requests carried")
    keep_tokens: int = Field(
        0, ge=0, le=MAX_PREFIX_TOKENS, strict=True,
        description="Leading tokens never removed (a system prompt other engines' "
        "conversations share); pages another cached prefix on this engine shares are "
        "kept anyway")


class PinRequest(BaseModel):
    """Which prefix ``POST /pin`` keeps in L2, and for how long."""

    model_config = ConfigDict(extra="forbid")

    prefix: list[TokenId] = Field(
        ..., min_length=1, max_length=MAX_PREFIX_TOKENS, description="The prompt's token ids")
    ttl_s: float = Field(..., gt=0, le=30 * 24 * 3600,
                         description="Seconds to keep its L2 pages ahead of LRU")
    cache_salt: str | None = Field(None, max_length=4096)


class PrefetchRequest(BaseModel):
    """Which prompt ``POST /prefetch`` brings from L3 into L2, as which operation."""

    model_config = ConfigDict(extra="forbid")

    prefix: list[TokenId] = Field(
        ..., min_length=1, max_length=MAX_PREFIX_TOKENS, description="The prompt's token ids")
    cache_salt: str | None = Field(None, max_length=4096)
    id: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
        description="The operation's id (one is made when absent): the same id and "
                    "prompt again is the same operation; the same id with another "
                    "prompt is refused (409)")
    ttl_s: float | None = Field(
        None, gt=0, le=86400,
        description="Seconds the workers may read once they start; what they read by "
                    "then stays in L2")


PrefetchState = Literal["booked", "queued", "running", "done", "failed", "cancelled"]


class PrefetchStatus(BaseModel):
    """One prefetch operation (``GET`` / ``DELETE /prefetch/{id}``): ``booked`` (a
    request's ``return_in_s`` prefetch, not due yet: ``due_in_s``), ``queued`` (not yet
    handed to the workers), ``running``, ``done`` (every planned page reached L2),
    ``failed`` (fewer did: an L3 read failed or ``ttl_s`` passed), ``cancelled``."""

    model_config = ConfigDict(extra="allow")

    id: str
    status: PrefetchState
    pages: int = Field(description="Pages planned (0: L2 held them, or L3 held no more)")
    fetched_pages: int | None = Field(description="Pages that reached L2, once ended")
    ttl_s: float | None
    age_s: float


class PrefetchResponse(PrefetchStatus):
    """``POST /prefetch``: tokens of the prompt L3 holds, L2 holds now, and this call
    planned to come from L3 into L2 with the next engine step, and the operation."""

    prefetch_tokens: int
    l3_tokens: int
    l2_tokens: int


SessionId = Annotated[str, PathParam(min_length=1, max_length=256,
                                 description="The session_id its requests carried")]


class SessionStatus(BaseModel):
    """``GET /sessions/{id}``: a session (its requests' ``kv_transfer_params.hicache.
    session_id``), with the hints it carries to turns that do not set them."""

    model_config = ConfigDict(extra="allow")

    session_id: str
    open: bool
    turns: int = Field(description="Requests that named it")
    pages: int = Field(description="Pages of its longest finished request")
    idle_s: float = Field(description="Seconds since its last request arrived or it closed")
    retain_s: float | None = None
    priority: str | None = None


class SessionCloseRequest(BaseModel):
    """How ``POST /sessions/{id}/close`` ends a session."""

    model_config = ConfigDict(extra="forbid")

    forget: bool = Field(
        False, strict=True, description="Also remove its own pages (not what other cached "
        "prefixes share with it) from L2 and L3, as POST /forget does")


class SessionCloseResponse(BaseModel):
    """``POST /sessions/{id}/close``: pins ended, and its own pages ranked below every
    open session's (``demoted_pages``) or, with ``forget``, removed (``l2_pages``,
    ``l3_pages``, ``skipped_locked``, ``kept_shared_pages`` as ``POST /forget``)."""

    model_config = ConfigDict(extra="allow")

    session_id: str
    released_pins: int
    demoted_pages: int | None = None
    l2_pages: int | None = None
    l3_pages: int | None = None


class UnpinRequest(BaseModel):
    """Which prefix ``DELETE /pin`` releases now."""

    model_config = ConfigDict(extra="forbid")

    prefix: list[TokenId] = Field(..., min_length=1, max_length=MAX_PREFIX_TOKENS)
    cache_salt: str | None = Field(None, max_length=4096)


class AttachRequest(BaseModel):
    """The L3 backend ``POST /storage/attach`` attaches."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field(
        ..., min_length=1, max_length=256, description='"file", "mooncake", "nixl", "lmcache" or "dynamic"'
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="As hicache_storage_backend_extra_config"
    )


def parse_prefix(prefix: str | None) -> list[int] | None:
    """``"1, 2,3"`` -> ``[1, 2, 3]``; ``None``/``""`` -> ``None``; else a 422 naming ``prefix``."""
    if prefix is None or not prefix.strip():
        return None
    try:
        ids: list[int] | None = [int(p) for p in prefix.split(",")]
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
# Responses
# --------------------------------------------------------------------------- #


class HealthResponse(BaseModel):
    """``GET /healthz``."""

    status: str = Field(description='Always "ok" while the server answers.')


class ConfigResponse(RootModel[dict[str, Any]]):
    """``GET /config``: the effective HiCache configuration, secrets redacted."""


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
    unreachable_ranks: int | None = Field(
        None, description="L3: TP ranks whose circuit breaker is open (the store stopped "
        "answering; their L3 hits are recomputed)")
    indexed_pages: int | None = Field(
        None, description="L3: pages the HiRadixTree records in L3 (what this engine "
        "knows it holds)")
    backlog_pages: int | None = Field(
        None, description="L3: pages L2 holds and L3 lacks that the catch-up will back "
        "up (as of its last scan, those in flight included)")
    catch_up_pages: int | None = Field(
        None, description="L3: pages the catch-up queued for backup since start (after "
        "an L3 flush or attach, a failed backup)")


class StatsResponse(BaseModel):
    """Statistics of every tier, the queues and the policies; further sections pass through."""

    model_config = ConfigDict(extra="allow")

    tiers: dict[str, TierStats] = Field(default_factory=dict, description='"l1", "l2", "l3"')
    queues: dict[str, Any] = Field(default_factory=dict)
    policy: dict[str, Any] = Field(default_factory=dict)


class MetricsText(RootModel[str]):
    """``GET /metrics``: the /stats numbers as Prometheus text format 0.0.4 (``hicache_*``)."""


class TreeResponse(RootModel[dict[str, Any]]):
    """``GET /tree``: a bounded JSON view of the HiRadixTree below the prefix."""


class FlushResponse(RootModel[dict[str, int]]):
    """``POST /flush``: pages dropped per tier, e.g. ``{"l2_pages": 3, "l3_pages": 3}``."""


class ForgetResponse(RootModel[dict[str, int]]):
    """``POST /forget``: ``{"l2_pages", "l3_pages", "skipped_locked", "kept_shared_pages"}``."""


class LookupResponse(BaseModel):
    """``GET /lookup``: what each tier holds of a prompt and what loading it should take."""

    prefix_tokens: int
    page_size: int
    tokens: dict[str, int] = Field(
        description='Leading tokens of the prefix each tier holds: {"l2": n, "l3": n}')
    load_gbps: dict[str, float | None] = Field(
        description="Bandwidth measured so far per tier, GB/s (null: nothing loaded yet)")
    expected_load_s: dict[str, float | None] = Field(
        description="Seconds to load what L2 holds from L2, and what L2 lacks from L3, "
        "per rank at that bandwidth (null: not measured yet)")


class PinResponse(BaseModel):
    """``POST /pin``: pages of the prefix now kept in L2 (0: none of it is in L2)."""

    pinned_pages: int
    ttl_s: float


class UnpinResponse(BaseModel):
    """``DELETE /pin``: pages released (0: that prefix was not pinned)."""

    unpinned_pages: int


class AttachResponse(BaseModel):
    """``POST /storage/attach``: the attached backend, plus what the cache reports."""

    model_config = ConfigDict(extra="allow")

    attached: str = Field(description="Name of the backend now attached")


class DetachResponse(BaseModel):
    """``POST /storage/detach``: the detached backend, plus what the cache reports."""

    model_config = ConfigDict(extra="allow")

    detached: str = Field(description="Name of the backend now detached")


class ErrorResponse(BaseModel):
    """Every error but 422: a message for the operator (never secrets, never internals)."""

    detail: str
