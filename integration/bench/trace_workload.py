"""A recorded trace as the workload of ``hicache bench compare``: a config whose
``workload`` names a ``trace`` replays it against every system instead of a
synthetic scenario.

Contract
========

``TraceWorkload.from_dict(mapping)`` reads the workload keys (the config's
``workload`` with a system's ``workload`` keys on top): ``trace`` (a file; a
relative path is looked up under ``$HICACHE_TRACE_DIR`` when that is set, else
under the working directory), ``format`` (``claude-code``: agent sessions,
session_replay.py), the session keys (``sessions``, ``max_turns``,
``block_tokens``, ``max_output_tokens``, ``output_tokens``, ``token_high``),
the replay keys (``concurrency`` sessions at once, ``session_gap_s``
between session starts, ``time_scale`` and ``max_think_s`` for the recorded
think times) and the agent's hints (``hints``, ``retain_s``,
``prefetch_lead_s``, ``return_in``). An unknown key or a bad value raises
``ValueError`` naming the key and what it allows; a missing file is reported
by :meth:`TraceWorkload.missing` before any server starts.

:meth:`TraceWorkload.run` replays it against one server and returns
session_replay's result mapping (``summary``, ``tiers``, ``requests`` with
their turn numbers: what compare.py tabulates), recording the served
requests as a trace for ``hicache simulate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hicache.integration.bench.session_replay import (
    AgentHints,
    SessionSpec,
    load_claude_code_file,
    replay_sessions_sync,
)

TRACE_DIR_ENV = "HICACHE_TRACE_DIR"


class TraceWorkload(BaseModel):
    """``workload:`` of a compare config that replays a recorded trace."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trace: str = Field(min_length=1)
    format: Literal["claude-code"] = "claude-code"
    sessions: int = Field(8, ge=1)
    max_turns: int = Field(0, ge=0)
    block_tokens: int = Field(1, ge=1)
    max_output_tokens: int = Field(16, ge=1)
    output_tokens: int | None = Field(None, ge=1)
    token_high: int = Field(2000, gt=10)
    concurrency: int = Field(4, ge=1)
    time_scale: float = Field(1.0, ge=0)
    max_think_s: float | None = Field(None, ge=0)
    session_gap_s: float = Field(0.0, ge=0)
    hints: bool = False
    retain_s: float = Field(0.0, ge=0)
    prefetch_lead_s: float = Field(0.0, ge=0)
    return_in: bool = False
    seed: int = Field(0, ge=0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceWorkload:
        try:
            w = cls.model_validate(d)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(p) for p in err["loc"]) or "workload"
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(cls.model_fields)
                raise ValueError(f"unknown workload key {key!r} for a trace replay; allowed: "
                                 f"{allowed}") from None
            raise ValueError(f"workload key {key!r}: {err['msg']} (got {err.get('input')!r})"
                             ) from None
        if not w.hints and (w.retain_s or w.prefetch_lead_s or w.return_in):
            raise ValueError("workload keys 'retain_s', 'prefetch_lead_s' and 'return_in' are "
                             "agent hints: set 'hints: true' too")
        return w

    def path(self) -> Path:
        p = Path(self.trace).expanduser()
        base = os.environ.get(TRACE_DIR_ENV)
        return p if p.is_absolute() or not base else Path(base) / p

    def missing(self) -> str | None:
        """Why the trace cannot be read, or None."""
        p = self.path()
        if p.is_file():
            return None
        return (f"workload key 'trace': {p} is not a file (a relative path is looked up under "
                f"${TRACE_DIR_ENV} when set, else the working directory; the Claude Code "
                f"sessions are the WEKA corpus in its compact form, cc_traces_compact.jsonl.gz)")

    def run(self, base_url: str, *, max_model_len: int, admin_url: str | None = None,
            admin_token: str | None = None, record_path: str | Path | None = None,
            progress: bool = True) -> dict[str, Any]:
        spec = SessionSpec(block_tokens=self.block_tokens, max_model_len=max_model_len,
                           sessions=self.sessions, max_turns=self.max_turns,
                           max_output_tokens=self.max_output_tokens,
                           output_tokens=self.output_tokens, token_high=self.token_high,
                           seed=self.seed)
        loaded = load_claude_code_file(self.path(), spec)
        hints = (AgentHints(retain_s=self.retain_s, prefetch_lead_s=self.prefetch_lead_s,
                            return_in=self.return_in) if self.hints else None)
        return replay_sessions_sync(
            base_url, loaded, concurrency=self.concurrency, time_scale=self.time_scale,
            max_think_s=self.max_think_s, session_gap_s=self.session_gap_s, hints=hints,
            admin_url=admin_url, admin_token=admin_token, record_path=record_path,
            progress=progress)


def is_trace_workload(workload: dict[str, Any]) -> bool:
    """Whether a config's workload replays a trace (it names one)."""
    return "trace" in workload


__all__ = ["TRACE_DIR_ENV", "TraceWorkload", "is_trace_workload"]
