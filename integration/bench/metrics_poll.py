"""A reader of a vLLM server's ``/metrics`` on a thread, for benchmarks.

Contract:
- ``MetricsPoller(base_url, interval_s)`` is a context manager: entering starts
  a daemon thread that GETs ``<base_url>/metrics`` every ``interval_s`` seconds
  and hands each response to ``read`` (a subclass's); leaving stops and joins
  it. A request that fails (``httpx.HTTPError``, raised by the GET or by
  ``read``) is skipped: the next poll tries again.
- ``timeout_s``: each GET's timeout (a class attribute subclasses may set).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import httpx

P = TypeVar("P", bound="MetricsPoller")


class MetricsPoller:
    """Polls ``/metrics`` while entered (see the module docstring)."""

    timeout_s = 10.0
    thread_name = "metrics-poller"

    def __init__(self, base_url: str, interval_s: float) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def __enter__(self: P) -> P:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def read(self, response: httpx.Response) -> None:
        """One poll's response."""

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    self.read(client.get(self.url))
                except httpx.HTTPError:
                    continue
