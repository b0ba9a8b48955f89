"""KV cache events of L2 and L3: which of vLLM's blocks the host pool and the store
gained and lost.

Contract:
- ``PageEvents`` records, when ``enabled`` (vLLM's ``--kv-events-config``
  turns it on), one ``PageStored`` per page that enters a tier and one
  ``PagesRemoved`` per batch of pages that leave it. The connector hands
  them to vLLM (``take_events``), which publishes them beside its own GPU
  events, so a prefix-aware router (llm-d, Dynamo) learns what this
  engine's host memory and storage hold.
- Events name vLLM's own block hashes (``request.block_hashes``, one per
  ``block_size`` tokens; a page is ``page_size // block_size`` of them),
  with the page's parent hash and token ids, as vLLM's ``BlockStored``
  does.
- L2 (medium ``MEDIUM_L2``, vLLM's "CPU"): a page is stored when it enters
  the HiRadixTree's L2 (a store planned, an L3 fetch published) and removed
  when it leaves L2 (eviction, flush, bad slots, reset). Each resident
  page's event is kept by slot until it leaves, so a removal names exactly
  the hashes its store named. A slot that never entered the tree (a
  reservation freed unused) makes no event.
- L3 (medium ``MEDIUM_L3``, vLLM's "STORAGE"): a page is stored when the
  tree learns that L3 holds it (every writing rank backed it up while it
  was still in L2, ``l3_added``; a lookup found it, ``l3_found``) and
  removed when this engine learns that L3 no longer holds it (a flush
  deleted it, a fetch could not read it: ``l3_removed``). What this engine
  cannot see (another engine's flush, the store's own eviction) makes no
  event; the first failed fetch of such a page does. Forgetting a page
  from the tree's L3 index is not a removal (the store still holds it).
  The hashes of pages stored in L3 are kept for their removal, at most
  ``L3_EVENT_MEMORY`` pages (least recently stored forgotten first).
- Disabled (the default), nothing is recorded or kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

# vLLM's medium names (vllm.distributed.kv_events MEDIUM_*).
MEDIUM_L2 = "CPU"
MEDIUM_L3 = "STORAGE"
# Pages of L3 whose hashes are kept for their removal events.
L3_EVENT_MEMORY = 1 << 20


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
    """L2's and L3's stored / removed events since the last ``take`` (module docstring)."""

    def __init__(self, *, page_size: int, hashes_per_page: int, enabled: bool = False) -> None:
        self.enabled = enabled
        self.page_size = page_size
        self.hashes_per_page = hashes_per_page
        self._events: list[PageEvent] = []
        # L2: slot -> (page key, its stored event).
        self._resident: dict[int, tuple[bytes, PageStored]] = {}
        self._by_key: dict[bytes, PageStored] = {}
        # L3: page key -> hashes, least recently stored first.
        self._l3: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()

    def _event(self, request: EventRequest, page: int, medium: str) -> PageStored | None:
        hpp, size = self.hashes_per_page, self.page_size
        hashes = tuple(request.block_hashes[page * hpp : (page + 1) * hpp])
        if len(hashes) < hpp:
            return None  # not hashed yet (cannot happen for a stored page)
        lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
        parent = request.block_hashes[page * hpp - 1] if page else None
        return PageStored(hashes, parent,
                          tuple(request.all_token_ids[page * size : (page + 1) * size]),
                          size // hpp, medium, lora)

    def added(self, request: EventRequest, pages: Iterable[tuple[int, int, bytes]]) -> None:
        """``pages``: (slot, page index in ``request``, page key) of pages that entered L2."""
        if not self.enabled:
            return
        for slot, page, key in pages:
            event = self._event(request, page, MEDIUM_L2)
            if event is None:
                continue
            self._resident[slot] = (key, event)
            self._by_key[key] = event
            self._events.append(event)

    def removed(self, slots: Iterable[int]) -> None:
        """Pages in ``slots`` left L2."""
        if not self.enabled:
            return
        hashes: list[bytes] = []
        for slot in slots:
            key, event = self._resident.pop(slot, (b"", None))
            if event is not None:
                self._by_key.pop(key, None)
                hashes.extend(event.block_hashes)
        if hashes:
            self._events.append(PagesRemoved(tuple(hashes), MEDIUM_L2))

    def l3_added(self, keys: Iterable[bytes]) -> None:
        """The tree learnt that L3 holds these pages, which are in L2 (a backup)."""
        if not self.enabled:
            return
        for key in keys:
            event = self._by_key.get(key)
            if event is not None:
                self._store_l3(key, PageStored(event.block_hashes, event.parent_block_hash,
                                               event.token_ids, event.block_size, MEDIUM_L3,
                                               event.lora_name))

    def l3_found(self, request: EventRequest, pages: Iterable[tuple[int, bytes]]) -> None:
        """``pages``: (page index in ``request``, page key) that a lookup found in L3."""
        if not self.enabled:
            return
        for page, key in pages:
            event = self._event(request, page, MEDIUM_L3)
            if event is not None:
                self._store_l3(key, event)

    def _store_l3(self, key: bytes, event: PageStored) -> None:
        self._l3[key] = event.block_hashes
        self._l3.move_to_end(key)
        while len(self._l3) > L3_EVENT_MEMORY:
            self._l3.popitem(last=False)
        self._events.append(event)

    def l3_removed(self, keys: Iterable[bytes] | None) -> None:
        """These pages (None: every page) are no longer in L3."""
        if not self.enabled:
            return
        if keys is None:
            keys = list(self._l3)
        hashes = [h for key in keys for h in self._l3.pop(key, ())]
        if hashes:
            self._events.append(PagesRemoved(tuple(hashes), MEDIUM_L3))

    def take(self) -> list[PageEvent]:
        events, self._events = self._events, []
        return events
