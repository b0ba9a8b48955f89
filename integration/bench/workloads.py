"""Seeded benchmark workloads in token ids: what ``hicache bench run`` sends.

Contract
========

A :class:`WorkloadSpec` describes ``clients`` concurrent conversations of
``turns`` requests each; a client sends its next request only after the
previous one finished (plus ``think_time_s``), and at most ``max_in_flight``
requests (0: no limit) are outstanding at once, first come first served. Prompts are token ids drawn
uniformly from ``[token_low, token_high)``, so nothing depends on a
tokenizer round trip and two systems serving the same model get the same
prompts for the same ``seed``. Every turn generates exactly
``answer_tokens`` tokens (greedy, ``ignore_eos``).

Scenarios (``S`` = ``shared_prefix_tokens``, ``H`` = ``history_tokens``,
``Q`` = ``question_tokens``)::

    multiturn      turn 0: system[S] + own history[H - S]
                   turn t: prompt(t-1) + answer(t-1) + question[Q]   (history grows)
    shared_doc     every turn: doc[S] + fresh question[H - S]       (no growth)
                   client i reads doc (i % num_docs); docs differ from each other
    system_prompt  every turn: system[S] + fresh user message[H - S] (no growth)
    agent          as multiturn (the appended Q tokens are a tool's result), with a
                   tool-call pause before every later turn drawn from
                   [pause_min_s, pause_max_s] per (client, turn), seeded

So in ``shared_doc`` and ``system_prompt`` every prompt is exactly ``H``
tokens and only the shared part (``S`` tokens) can be reused across clients
and turns; ``question_tokens`` only applies to ``multiturn``, and only
``multiturn`` and ``agent`` need the answer's token ids
(:attr:`WorkloadSpec.needs_answer_ids`). An agent client may also tell the cache
what comes back: ``retain_s`` sends ``kv_transfer_params: {"hicache": {"retain_s"}}``
with every request, and ``prefetch_lead_s`` (> 0, with the admin endpoint) asks
``POST /prefetch`` for the session's history that long before its next turn.
In ``multiturn`` the system prompt is shared by all clients (``S`` may be 0);
``shared_doc`` and ``system_prompt`` need ``1 <= S < H``.

Randomness: each piece (the system prompt, document ``d``, the message of
client ``c`` at turn ``t``) comes from its own numpy generator seeded with
``(seed, kind, index...)``, so a piece never depends on how many others were
drawn before it, and prompts are identical across processes and machines.

:meth:`WorkloadSpec.from_dict` parses a config mapping (YAML/JSON/CLI) and
raises ``ValueError`` naming the key and the allowed values or range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCENARIOS = ("multiturn", "shared_doc", "system_prompt", "agent")
# Scenarios whose prompt is the whole history plus something new (they need answer ids).
_GROWING = ("multiturn", "agent")
# Keys whose values are seconds (numbers >= 0); every other key but scenario is an int.
_SECONDS = ("think_time_s", "pause_min_s", "pause_max_s", "retain_s", "prefetch_lead_s")

# Stream kinds of the seeded generators (part of the seed: never renumber).
_SYSTEM, _DOC, _USER, _PAUSE = 1, 2, 3, 4


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of one benchmark workload (see the module docstring for the scenarios)."""

    # One of SCENARIOS: multiturn, shared_doc or system_prompt.
    scenario: str = "multiturn"
    # Concurrent clients (conversations), each with its own sequential turns.
    clients: int = 4
    # Requests per client, sent one after the other.
    turns: int = 3
    # Tokens of a client's first prompt, shared prefix included.
    history_tokens: int = 1024
    # Tokens shared by all clients (system prompt; the document for shared_doc),
    # part of history_tokens.
    shared_prefix_tokens: int = 0
    # shared_doc: number of distinct documents; client i reads doc i % num_docs.
    num_docs: int = 1
    # multiturn: new user tokens appended on every later turn.
    question_tokens: int = 64
    # Tokens generated per request (max_tokens with ignore_eos: lengths are exact).
    answer_tokens: int = 32
    # Seconds a client pauses between receiving an answer and sending its next turn.
    think_time_s: float = 0.0
    # agent: a tool call's pause before each later turn, uniform in [min, max] seconds.
    pause_min_s: float = 0.0
    pause_max_s: float = 0.0
    # agent: retain_s sent with every request (0: none).
    retain_s: float = 0.0
    # agent: seconds before its next turn a session's history is prefetched through
    # the admin endpoint's POST /prefetch (0: never).
    prefetch_lead_s: float = 0.0
    # Requests in flight at once across all clients (0 = one per client): many
    # conversations returning through a server that runs a few at a time.
    max_in_flight: int = 0
    # Seed of every prompt; the same seed gives the same prompts on every system.
    seed: int = 0
    # Token ids are drawn from [token_low, token_high) (keep clear of special tokens).
    token_low: int = 8
    token_high: int = 2000

    def __post_init__(self) -> None:
        _validate(self)

    # ---- construction -------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkloadSpec:
        """A spec from a config mapping; unknown keys and bad values raise ``ValueError``."""
        if not isinstance(d, Mapping):
            raise ValueError(f"workload must be a mapping of keys to values, got {type(d).__name__}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in d if k not in allowed)
        if unknown:
            raise ValueError(f"unknown workload key {unknown[0]!r}; allowed: {', '.join(allowed)}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.name == "scenario":
                if not isinstance(v, str):
                    raise ValueError(_scenario_error(v))
            elif f.name in _SECONDS:
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"workload key {f.name!r} must be a number of seconds "
                                     f">= 0, got {v!r}")
                v = float(v)
            elif isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"workload key {f.name!r} must be an integer, got {v!r}")
            values[f.name] = v
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived ------------------------------------------------------------

    @property
    def total_requests(self) -> int:
        return self.clients * self.turns

    @property
    def needs_answer_ids(self) -> bool:
        """Whether the next prompt is built from the previous answer's token ids."""
        return self.scenario in _GROWING

    def pause_of(self, client: int, turn: int) -> float:
        """agent: seconds of tool call before turn ``turn`` of ``client`` (0 otherwise)."""
        if self.scenario != "agent" or turn < 1 or self.pause_max_s <= 0:
            return 0.0
        rng = np.random.default_rng([self.seed, _PAUSE, client, turn])
        return float(rng.uniform(self.pause_min_s, self.pause_max_s))

    def doc_of(self, client: int) -> int:
        """shared_doc: the document client ``client`` reads."""
        return client % self.num_docs

    # ---- prompts ------------------------------------------------------------

    def shared_prefix(self, client: int = 0) -> list[int]:
        """The shared part of ``client``'s prompts (system prompt, or its document)."""
        if self.scenario == "shared_doc":
            return self._draw(self.shared_prefix_tokens, _DOC, self.doc_of(client))
        return self._draw(self.shared_prefix_tokens, _SYSTEM, 0)

    def first_prompt(self, client: int) -> list[int]:
        """Turn 0 of ``client``: shared prefix + its own ``H - S`` tokens."""
        self._check_client(client)
        own = self.history_tokens - self.shared_prefix_tokens
        return self.shared_prefix(client) + self._draw(own, _USER, client, 0)

    def next_prompt(
        self,
        client: int,
        turn: int,
        previous_prompt: Sequence[int],
        previous_answer: Sequence[int] | None = None,
    ) -> list[int]:
        """Turn ``turn`` (>= 1) of ``client``, after ``previous_prompt`` was answered.

        ``previous_answer`` (the generated token ids) is required for
        ``multiturn``, whose prompt is the whole history plus a new question;
        the other scenarios ignore both previous arguments.
        """
        self._check_client(client)
        if not 1 <= turn < self.turns:
            raise ValueError(f"turn must be in 1..{self.turns - 1} for next_prompt, got {turn}")
        if self.scenario not in _GROWING:
            own = self.history_tokens - self.shared_prefix_tokens
            return self.shared_prefix(client) + self._draw(own, _USER, client, turn)
        if previous_answer is None:
            raise ValueError(f"{self.scenario} needs the previous answer's token ids to build "
                             "the next prompt (the history)")
        question = self._draw(self.question_tokens, _USER, client, turn)
        return [*previous_prompt, *previous_answer, *question]

    def _check_client(self, client: int) -> None:
        if not 0 <= client < self.clients:
            raise ValueError(f"client must be in 0..{self.clients - 1}, got {client}")

    def _draw(self, n: int, kind: int, *index: int) -> list[int]:
        if n <= 0:
            return []
        rng = np.random.default_rng([self.seed, kind, *index])
        return rng.integers(self.token_low, self.token_high, size=n).tolist()


def _scenario_error(v: object) -> str:
    return f"workload key 'scenario' must be one of {', '.join(SCENARIOS)}, got {v!r}"


def _validate(s: WorkloadSpec) -> None:
    if s.scenario not in SCENARIOS:
        raise ValueError(_scenario_error(s.scenario))

    def at_least(key: str, low: int) -> None:
        v = getattr(s, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"workload key {key!r} must be an integer >= {low}, got {v!r}")

    for key in ("clients", "turns", "history_tokens", "num_docs", "question_tokens",
                "answer_tokens"):
        at_least(key, 1)
    for key in ("shared_prefix_tokens", "seed", "token_low", "max_in_flight"):
        at_least(key, 0)
    at_least("token_high", s.token_low + 1)
    for key in _SECONDS:
        v = getattr(s, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"workload key {key!r} must be a number of seconds >= 0, "
                             f"got {v!r}")
    if s.pause_max_s < s.pause_min_s:
        raise ValueError(f"workload key 'pause_max_s' ({s.pause_max_s}) must be >= "
                         f"pause_min_s ({s.pause_min_s})")
    if s.scenario != "agent":
        agentic = [k for k in ("pause_min_s", "pause_max_s", "retain_s", "prefetch_lead_s")
                   if getattr(s, k)]
        if agentic:
            raise ValueError(f"workload key(s) {agentic} apply to scenario agent only, not "
                             f"{s.scenario}")
    h, sp = s.history_tokens, s.shared_prefix_tokens
    if s.scenario in _GROWING:
        if sp > h:
            raise ValueError(f"workload key 'shared_prefix_tokens' must be in 0..history_tokens "
                             f"({h}) for scenario {s.scenario}, got {sp}")
    elif not 1 <= sp < h:
        what = "the document length" if s.scenario == "shared_doc" else "the system prompt"
        raise ValueError(f"workload key 'shared_prefix_tokens' ({what}) must be in "
                         f"1..{h - 1} (below history_tokens={h}) for scenario {s.scenario}, "
                         f"got {sp}")
