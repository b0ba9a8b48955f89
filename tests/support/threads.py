"""Test helpers for code that changes the calling thread's state (its CPU affinity)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread (its affinity changes die with it); its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]
