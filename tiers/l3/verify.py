"""Where an L3 backend computes the checksums of the pages it reads and writes: on its
I/O thread, or on helper threads right beside it.

Contract:
- ``Verify``: the ``verify`` key of the file and Mooncake extra configs
  (``verify_field()`` documents it the same way in both). ``inline``: checksums on the
  thread that moves the bytes; ``helper``: on helper threads, overlapping the moves (the
  bytes are hashed while still in the shared CPU cache; it takes a second core while
  the I/O runs); ``auto``: ``helper`` where the host pool is pinned (a GPU host: its CPU
  does not compute the model) and the host has at least ``HELPER_MIN_CPUS`` cores, else
  ``inline`` (a CPU engine's cores compute the model).
- ``helpers(mode, pool)``: a ``ThreadPoolExecutor`` of ``THREADS`` threads named
  ``hicache-l3-verify`` where ``mode`` asks for helpers, else None. The backend owns
  it and shuts it down in ``close()``.
- Checksums are the same whichever thread computes them: stored pages stay valid.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import Field

from hicache.tiers.l2.host_pool import HostPagePool

Verify = Literal["auto", "inline", "helper"]
THREADS = 2
HELPER_MIN_CPUS = 4


def verify_field() -> Any:
    """The ``verify`` field of a backend's extra-config model."""
    return Field(
        "auto", description="where page checksums are computed: inline = on the thread that "
        "moves the bytes; helper = on helper threads overlapping the moves (one more core "
        "while I/O runs); auto = helper where the host pool is pinned (GPU hosts) and the "
        f"host has >= {HELPER_MIN_CPUS} cores, else inline")


def wants_helpers(mode: Verify, pool: HostPagePool) -> bool:
    if mode == "auto":
        return pool.memory.pinned and (os.cpu_count() or 1) >= HELPER_MIN_CPUS
    return mode == "helper"


def helpers(mode: Verify, pool: HostPagePool) -> ThreadPoolExecutor | None:
    if not wants_helpers(mode, pool):
        return None
    return ThreadPoolExecutor(THREADS, thread_name_prefix="hicache-l3-verify")
