"""Per-request cache controls: what a client asks of HiCache for one request.

Contract:
- A request carries them in vLLM's per-request channel, ``kv_transfer_params``
  (the OpenAI body's ``kv_transfer_params``, offline ``SamplingParams.extra_args
  ["kv_transfer_params"]``), under ``HINTS_KEY``::

      {"hicache": {"store": false, "load_tiers": ["l2"], "max_load_tokens": 4096}}

  ``store`` (default true): false writes none of the request's pages to L2 (hence
  L3); pages another request stores are unaffected. ``load_tiers`` (default
  ``["l2", "l3"]``): the tiers that may serve the request; ``[]`` loads nothing,
  ``["l2"]`` never reads L3; L3 pages come through L2, so ``["l3"]`` alone is refused.
  ``max_load_tokens`` (default unlimited): at most that many prompt tokens from
  HiCache (vLLM's own prefix cache is not counted). ``retain_s``: when the request
  finishes, what L2 holds of its pages (prompt and answer) is pinned for that long
  (pins.py), within the operator's share of L2; the response says how many pages.
  ``priority`` (``low`` | ``normal`` | ``high``, default normal): the eviction class
  of the request's pages in L2 (``PRIORITY_RANKS``, the HiRadixTree's priorities):
  lower classes are evicted first, least recently used first within a class; pages
  the request stores get its class, pages it hits are raised to it (never lowered).
  E.g. ``high`` for a shared system prompt, ``low`` for one-off prompts.
  ``session_id`` (1-256 characters): the conversation (agent session) the request
  belongs to (sessions.py): a turn that does not set ``retain_s`` or ``priority``
  gets the values its session's last turn set; ``POST /sessions/{id}/close``
  ends its pins and ranks its own pages below every open session's (or, with
  ``forget``, removes them from every tier). ``return_in_s`` (seconds, with an
  L3): the conversation's next turn is expected then; what L3 holds of the
  request's prompt and answer is read into L2 shortly before (returns.py), and
  the response names that prefetch operation (``prefetch_id``).
- ``parse_hints(params)`` returns (hints, error). Bad hints never fail a request:
  the request is served with every hint at its default, and ``error`` names the key
  and what it allows (the connector returns it in the response's
  ``kv_transfer_params["hicache"]["error"]``). Keys HiCache writes into a response
  (``RESPONSE_KEYS``) are ignored, so a response's parameters passed on to the next
  engine (PD disaggregation proxies do) are no error.
- Engine-free: no vLLM import; pydantic validates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, ValidationError, field_validator

from hicache.tiers.index.tree_node import DEFAULT_PRIORITY
from hicache.tiers.settings import Settings, explain

HINTS_KEY = "hicache"
RESPONSE_KEYS = frozenset({"cached_tokens", "error", "retained_pages", "prefetch_id"})
TIERS = ("l2", "l3")
PriorityName = Literal["low", "normal", "high"]
# Eviction classes as the HiRadixTree ranks them (lower is evicted first).
PRIORITY_RANKS: dict[str, int] = {
    "low": DEFAULT_PRIORITY - 1, "normal": DEFAULT_PRIORITY, "high": DEFAULT_PRIORITY + 1}


class RequestHints(Settings):
    """``kv_transfer_params["hicache"]`` of one request."""

    store: bool = Field(True, description="write this request's pages to L2 (and L3)")
    load_tiers: list[str] = Field(
        default_factory=lambda: ["l2", "l3"],
        description="tiers that may serve this request's prompt: [] = none, "
        "['l2'] = never read L3; L3 pages come through L2, so 'l3' needs 'l2'")
    max_load_tokens: NonNegativeInt | None = Field(
        None, description="at most this many prompt tokens from HiCache (null = no limit)")
    retain_s: NonNegativeFloat | None = Field(
        None, description="keep this request's pages (prompt and answer) in L2 ahead of "
        "LRU for this many seconds after it finishes, within hicache_retain_max_share")
    priority: PriorityName = Field(
        "normal", description="eviction class of this request's pages in L2: low goes "
        "first, high last (LRU within a class); e.g. high for a shared system prompt, "
        "low for one-off prompts")
    session_id: str | None = Field(
        None, min_length=1, max_length=256, description="the conversation (agent session) "
        "this request belongs to: turns that do not set retain_s or priority carry its "
        "last ones; POST /sessions/{id}/close releases it")
    return_in_s: NonNegativeFloat | None = Field(
        None, le=86400, description="the conversation's next turn is expected in about "
        "this many seconds (an agent waiting on a tool): what L3 holds of this request's "
        "prompt and answer is read back into L2 shortly before (a prefetch operation; "
        "the response's prefetch_id names it for GET /prefetch/{id}); needs an L3")

    @field_validator("load_tiers")
    @classmethod
    def _tiers(cls, tiers: list[str]) -> list[str]:
        allowed = "allowed: [], ['l2'], ['l2', 'l3']"
        if not set(tiers) <= set(TIERS):
            raise ValueError(f"unknown tier(s) {sorted(set(tiers) - set(TIERS))}; {allowed}")
        if "l3" in tiers and "l2" not in tiers:
            raise ValueError(f"L3 pages are loaded through L2; {allowed}")
        return tiers

    @property
    def loads(self) -> bool:
        return bool(self.load_tiers) and self.max_load_tokens != 0

    @property
    def reads_l3(self) -> bool:
        return "l3" in self.load_tiers

    @property
    def rank(self) -> int:
        """The HiRadixTree priority of this request's pages."""
        return PRIORITY_RANKS[self.priority]


DEFAULT_HINTS = RequestHints()


def parse_hints(params: Mapping[str, Any] | None) -> tuple[RequestHints, str | None]:
    """The request's hints and, when they are bad, why (hints then all default)."""
    raw = (params or {}).get(HINTS_KEY) if isinstance(params, Mapping) else None
    if raw is None:
        return DEFAULT_HINTS, None
    if not isinstance(raw, Mapping):
        return DEFAULT_HINTS, (f"kv_transfer_params.{HINTS_KEY} must be an object with keys "
                               f"{sorted(RequestHints.model_fields)}")
    asked = {k: v for k, v in raw.items() if k not in RESPONSE_KEYS}
    try:
        return RequestHints.model_validate(asked), None
    except ValidationError as exc:
        return DEFAULT_HINTS, explain(exc, RequestHints,
                                      prefix=f"kv_transfer_params.{HINTS_KEY}.",
                                      unknown=f"kv_transfer_params.{HINTS_KEY} key(s):")
