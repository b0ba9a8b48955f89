"""KV cache events of L2: which of vLLM's blocks the host pool gained and lost.

Contract:
- ``PageEvents`` records, when ``enabled`` (vLLM's ``--kv-events-config``
  turns it on), one ``PageStored`` per page that enters the HiRadixTree
  (a store or an L3 fetch publishing it) and one ``PagesRemoved`` per batch
  of pages that leave it (eviction, flush, bad slots, reset). The connector
  hands them to vLLM (``take_events``), which publishes them beside its own
  GPU events, so a prefix-aware router (llm-d, Dynamo) learns what this
  engine's host memory holds.
- Events name vLLM's own block hashes (``request.block_hashes``, one per
  ``block_size`` tokens; a page is ``page_size // block_size`` of them),
  with the page's parent hash and token ids, as vLLM's ``BlockStored``
  does. The medium is ``MEDIUM_L2`` ("CPU", vLLM's name for host memory).
- Each resident page's hashes are kept by slot until it leaves, so a
  removal names exactly the hashes its store named. A slot that never
  entered the tree (a reservation freed unused) makes no event.
- L3 is not evented: it is asked on demand, not indexed (DESIGN.md), so
  this engine cannot know when another engine or the store's own eviction
  removes a page.
- Disabled (the default), nothing is recorded or kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

# vLLM's medium names (vllm.distributed.kv_events MEDIUM_*).
MEDIUM_L2 = "CPU"


class EventRequest(Protocol):
    """What an event reads of the request whose page it names."""

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class PageStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_name: str | None = None


@dataclass(frozen=True)
class PagesRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str


PageEvent = PageStored | PagesRemoved


class PageEvents:
    """L2's stored / removed events since the last ``take`` (module docstring)."""

    def __init__(self, *, page_size: int, hashes_per_page: int, enabled: bool = False) -> None:
        self.enabled = enabled
        self.page_size = page_size
        self.hashes_per_page = hashes_per_page
        self._events: list[PageEvent] = []
        self._resident: dict[int, tuple[bytes, ...]] = {}

    def added(self, request: EventRequest, pages: Iterable[tuple[int, int]]) -> None:
        """``pages``: (slot, page index in ``request``) of pages that entered L2."""
        if not self.enabled:
            return
        hpp, size = self.hashes_per_page, self.page_size
        lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
        for slot, page in pages:
            hashes = tuple(request.block_hashes[page * hpp : (page + 1) * hpp])
            if len(hashes) < hpp:
                continue  # not hashed yet (cannot happen for a stored page)
            self._resident[slot] = hashes
            parent = request.block_hashes[page * hpp - 1] if page else None
            self._events.append(PageStored(
                hashes, parent, tuple(request.all_token_ids[page * size : (page + 1) * size]),
                size // hpp, MEDIUM_L2, lora))

    def removed(self, slots: Iterable[int]) -> None:
        """Pages in ``slots`` left L2."""
        if not self.enabled:
            return
        hashes = [h for slot in slots for h in self._resident.pop(slot, ())]
        if hashes:
            self._events.append(PagesRemoved(tuple(hashes), MEDIUM_L2))

    def take(self) -> list[PageEvent]:
        events, self._events = self._events, []
        return events
