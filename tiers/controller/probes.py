"""Background L3 lookups: vLLM's scheduling thread never waits on a store.

Contract:
- ``L3Probes.result(req_id, keys, store)`` answers how many leading ``keys``
  ``store`` holds (its ``exists_prefix``), as ``(found, failed)``, or None
  while that is not known yet. The first call for a request starts a probe
  on a small thread pool. The first call with ``wait`` (the lookup at
  admission; an arrival passes ``wait=False``) waits at most ``fast_wait_s``
  for it, once per probe, so a fast store still answers in the step that
  admits the request; a slow or dead one costs vLLM one
  retry per step (``get_num_new_matched_tokens`` returns None), never a
  stalled step. Probes of different requests run side by side, so a batch
  of new requests pays about one lookup latency, not one each.
- A probe answers for the run it was asked about and for any tail of it
  (the L2 match grew while the request waited: the store holds ``found - d``
  of a run that starts ``d`` pages later). A call with another run or store
  (the admin swapped it) drops the old probe and starts a new one. The answer
  stays until ``forget`` (the request was admitted, finished or aborted), so
  a request vLLM cannot admit yet is not looked up again at every step.
- A store that raises is a miss: ``(0, True)``, logged.
- ``forget(req_id)`` drops a request's probe (finished or aborted);
  ``close()`` stops the pool. Only stores whose ``capabilities.concurrent_lookups`` is
  true are probed here (tiers/l3/base.py); the caller looks others up inline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from hicache.tiers.index.page_keys import PageKey

logger = logging.getLogger(__name__)

# Lookups in flight at once (one thread each).
LOOKUP_THREADS = 8
# How long the first call waits for its probe before answering "not known yet".
FAST_WAIT_S = 0.001


@dataclass
class _Probe:
    keys: Sequence[PageKey]
    store: object
    future: Future[int]
    # A caller that wants the answer now waited up to fast_wait_s for it (once).
    waited: bool = False

    def offset_of(self, keys: Sequence[PageKey], store: object) -> int | None:
        """Where ``keys`` start in this probe's run, when they are a tail of it."""
        d = len(self.keys) - len(keys)
        if (store is not self.store or d < 0 or not keys
                or self.keys[-1] != keys[-1] or self.keys[d] != keys[0]):
            return None
        return d


class L3Probes:
    """Lookups in flight, one per waiting request (see the module docstring)."""

    def __init__(self, threads: int = LOOKUP_THREADS, fast_wait_s: float = FAST_WAIT_S) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hicache-probe")
        self.fast_wait_s = fast_wait_s
        self._probes: dict[str, _Probe] = {}
        self.started = 0

    def result(self, req_id: str, keys: Sequence[PageKey], store: object,
               ask: Callable[[], int] | None = None, wait: bool = True,
               ) -> tuple[int, bool] | None:
        """``ask``: how the run is counted (default: ``store.exists_prefix`` of
        ``keys``), e.g. through span objects (tiers/index/spans.py). ``wait``
        False: the probe is not waited for at all (a request's arrival: its
        answer is needed only when vLLM tries to admit it, which waits once)."""
        probe = self._probes.get(req_id)
        offset = probe.offset_of(keys, store) if probe is not None else None
        if probe is None or offset is None:
            self.forget(req_id)
            if ask is None:
                hex_keys = [k.hex() for k in keys]
                future = self._pool.submit(
                    store.exists_prefix, hex_keys)  # type: ignore[attr-defined]
            else:
                future = self._pool.submit(ask)
            probe = self._probes[req_id] = _Probe(list(keys), store, future)
            offset = 0
            self.started += 1
        if wait and not probe.waited and not probe.future.done():
            # Once per probe: the first caller that needs the answer (the lookup at
            # admission, not the arrival) gives a fast store the time to answer.
            probe.waited = True
            if self.fast_wait_s > 0:
                futures_wait([probe.future], timeout=self.fast_wait_s)
        if not probe.future.done():
            return None
        try:
            return max(0, int(probe.future.result()) - offset), False
        except Exception:  # noqa: BLE001 - a failing L3 is a miss, never an engine error
            logger.exception("HiCache: L3 lookup failed; treating as a miss")
            self._probes.pop(req_id, None)  # logged once; a later call asks again
            return 0, True

    def pending(self) -> int:
        return len(self._probes)

    def forget(self, req_id: str) -> None:
        probe = self._probes.pop(req_id, None)
        if probe is not None:
            probe.future.cancel()

    def close(self) -> None:
        for req_id in list(self._probes):
            self.forget(req_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
