"""Sessions: a conversation's requests grouped by the ``session_id`` hint (an agent's session).

Contract:
- A request whose hints (hints.py) carry ``session_id`` opens that session,
  or reopens it when it was closed. ``hints_for`` gives the request its
  session's carried hints: ``retain_s`` and ``priority`` that the request
  does not set itself are its session's last ones; those it sets become the
  session's. So an agent framework sets them once per session.
- ``finished(session_id, keys)``: a finished request's page keys (prompt and
  answer) are the session's paths in the HiRadixTree; a path that extends
  one already known replaces it, and at most ``MAX_PATHS`` (the latest) are
  kept (a session that branches: a retried turn, a sub-agent).
- ``close(session_id)`` marks the session closed and returns it (its paths);
  the scheduler then ends its pins and either ranks its own pages (after the
  pages other cached prefixes share) below every open session's
  (``CLOSED_PRIORITY``: they are evicted first) or, with ``forget``, removes
  them from every tier (flush.py ``forget_keys``). An unknown id raises
  ``KeyError``.
- Bounded: at most ``max_sessions`` are remembered; beyond, the least
  recently used closed session is forgotten first, then the least recently
  used open one (its pages stay where they are, ranked as they were).
- ``stats()``: sessions open and closed. Engine-free; the clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.tiers.controller.hints import PRIORITY_RANKS, RequestHints
from hicache.tiers.index.page_keys import PageKey

# Below every class a client can name: a closed session's own pages go first.
CLOSED_PRIORITY = min(PRIORITY_RANKS.values()) - 1
# Paths (finished requests' page keys that extend no other) kept per session.
MAX_PATHS = 8
# Sessions remembered at once, by default.
MAX_SESSIONS = 1 << 16
# The hints a session carries from turn to turn.
CARRIED = ("retain_s", "priority")


@dataclass
class Session:
    """One conversation's state."""

    id: str
    open: bool = True
    turns: int = 0
    # The hints it carries (CARRIED), as its requests last set them.
    carried: dict[str, object] = field(default_factory=dict)
    paths: list[list[PageKey]] = field(default_factory=list)
    last_seen: float = 0.0

    def view(self, now: float) -> dict[str, object]:
        return {"session_id": self.id, "open": self.open, "turns": self.turns,
                "pages": max((len(p) for p in self.paths), default=0),
                "idle_s": round(now - self.last_seen, 3),
                **{k: v for k, v in self.carried.items() if v is not None}}


class Sessions:
    """The sessions this engine has seen (see the module docstring)."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._closed = 0

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def hints_for(self, hints: RequestHints) -> RequestHints:
        """``hints`` with what its session carries filled in (unchanged without one)."""
        sid = hints.session_id
        if sid is None:
            return hints
        session = self._touch(sid)
        if not session.open:
            session.open = True
            self._closed -= 1
        session.turns += 1
        missing = {}
        for name in CARRIED:
            if name in hints.model_fields_set:
                session.carried[name] = getattr(hints, name)
            elif session.carried.get(name) is not None:
                missing[name] = session.carried[name]
        return hints.model_copy(update=missing) if missing else hints

    def finished(self, session_id: str, keys: Sequence[PageKey]) -> None:
        """A request of the session finished with these page keys."""
        session = self._sessions.get(session_id)
        if session is None or not keys:
            return
        path = list(keys)
        kept = [p for p in session.paths if not _extends(path, p)]
        if any(_extends(p, path) for p in kept):
            session.paths = kept
            return
        session.paths = (kept + [path])[-MAX_PATHS:]

    def close(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        if session.open:
            session.open = False
            self._closed += 1
        session.last_seen = self.clock()
        return session

    def stats(self) -> dict[str, int]:
        return {"open": len(self._sessions) - self._closed, "closed": self._closed}

    def _touch(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id)
            self._trim()
        self._sessions.move_to_end(session_id)
        session.last_seen = self.clock()
        return session

    def _trim(self) -> None:
        while len(self._sessions) > self.max_sessions:
            if self._closed:
                sid = next(sid for sid, s in self._sessions.items() if not s.open)
                del self._sessions[sid]
                self._closed -= 1
            else:
                self._sessions.popitem(last=False)


def _extends(longer: Sequence[PageKey], shorter: Sequence[PageKey]) -> bool:
    """``shorter`` is a prefix of ``longer``."""
    return len(longer) >= len(shorter) and list(longer[:len(shorter)]) == list(shorter)
