"""Start `make serve`'s launcher (python -m hicache.integration.vllm.serve) for a test.

The process gets its own session (so stop_server can end the whole group)
and counts as one engine start in the suite's summary.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hicache.integration.vllm.engine import note_engine_start


def launch_serve(env: dict[str, str], log: Path) -> subprocess.Popen:
    """``make serve`` with ``env`` (MODEL, PORT, SERVE_ARGS, ...); output to ``log``."""
    note_engine_start("vllm serve")
    return subprocess.Popen(
        [sys.executable, "-m", "hicache.integration.vllm.serve"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
