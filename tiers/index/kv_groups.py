"""The engine's KV-cache groups as the cache sees them: which blocks a page has, which it needs.

See DESIGN.md "Hybrid models".

Contract:
- vLLM's hybrid KV cache manager gives each kind of layer its own group
  (full attention, sliding window, chunked local) with its own block table;
  ``KVGroups`` lists them in vLLM's group order. A one-group engine is
  ``KVGroups.single()``, and everything below reduces to what it was.
- A page's blocks, wherever a plan names them (``PagePlan.block_ids``,
  tiers/index/plans.py), are the groups' blocks for the page's tokens,
  concatenated in group order, every group contributing the same number.
  ``page_blocks`` builds that tuple, ``split`` takes it apart.
- Residency: a page is stored in L2 with every group's bytes, except that a
  windowed group whose blocks vLLM has already replaced by its null block
  (the window moved on) is stored *missing* for that page (``missing_mask``,
  bit ``g`` = group ``g`` missing). A full-attention group is never missing:
  a page without it is not stored.
- State groups (Mamba / linear attention, vLLM's ``MambaSpec``): a page
  carries the group's checkpoint (the state after the page's last token) at
  its last block offset, the block whose end it is the state after; the
  page's other entries for the group are the null block, and a page without
  a checkpoint has the group missing. ``Checkpoints`` names, per page and
  state group, the L1 block holding it:
  - vLLM's "none" Mamba cache mode (its prefix caching off): a request has
    one state block, the state after its last computed token, so it is the
    checkpoint of a page only at a step that ended exactly on the page's end
    (``state_blocks``);
  - "align" mode (``KVGroup.aligned``, vLLM's prefix caching on): vLLM hands
    each committed block-end state to the connector with its exact block
    in the step that computes it (``SchedulerOutput.kv_connector_block_state``),
    and ``handed_off`` keeps those on page ends; a block table cannot be read
    positionally for stores there (vLLM nulls interior states and moves
    speculative ones). Loads are positional: the state block at the hit's
    last position is where vLLM reads a new request's initial state from
    (``state_blocks``).
- A hit may end after page ``P`` only where every windowed group has its
  bytes in the pages vLLM keeps real blocks for at that point (the last
  ``window`` tokens before the hit's end, from vLLM's own skip rule) and
  every state group has its checkpoint in page ``P - 1``;
  ``usable_pages`` finds the longest such hit.
- L3 holds complete pages only, and with state groups every page's body
  (all groups but the state ones) under ``body_key`` too: ``l3_keys``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hicache.tiers.index.page_keys import PageKey, body_key
from hicache.tiers.index.plans import NULL_BLOCK_ID

# Per-group block ids of one request, in vLLM's group order.
GroupBlockIds = Sequence[Sequence[int]]

# Page -> state group -> the L1 block holding the state after the page's last
# token (see the module docstring).
Checkpoints = Mapping[int, Mapping[int, int]]

# vLLM's hand-off of "align" boundary states: (group, block id, boundary tokens).
StateHandoff = Sequence[tuple[int, int, int]]

GroupKind = Literal["full", "window", "state"]


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: what its layers need of a prefix."""

    kind: GroupKind
    # "full": every page's KV; "window": the KV of the last ``window`` tokens;
    # "state": a recurrent state checkpoint at the hit's end (Mamba).
    # Tokens before a position that its attention still reads (kind "window"):
    # vLLM's sliding window (plus any extra retained tokens), or the chunk of
    # chunked-local attention (which never reads further back).
    window: int = 0
    # KV layers of the engine in this group.
    num_layers: int = 1
    # Kind "state" in vLLM's "align" Mamba cache mode: a state block per block
    # position, not one per request (see the module docstring).
    aligned: bool = False


@dataclass(frozen=True)
class KVGroups:
    """The engine's KV-cache groups, in vLLM's order (see the module docstring)."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, num_layers: int = 1) -> KVGroups:
        return cls((KVGroup("full", num_layers=num_layers),))

    def __len__(self) -> int:
        return len(self.groups)

    def describe(self) -> str:
        """``full x1, window(384) x5`` for the log."""
        return ", ".join(f"{g.kind}{f'({g.window})' if g.kind == 'window' else ''} "
                         f"x{g.num_layers}" for g in self.groups)

    @functools.cached_property
    def plain(self) -> bool:
        """One full-attention group (most models): a page is its blocks, nothing else."""
        return len(self.groups) == 1 and self.groups[0].kind == "full"

    @functools.cached_property
    def hybrid(self) -> bool:
        """More than one group: vLLM's hybrid KV cache manager is on."""
        return len(self.groups) > 1

    @functools.cached_property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @functools.cached_property
    def windowed(self) -> bool:
        """Some group lacks bytes in some pages: hits end where they are complete."""
        return any(g.kind != "full" for g in self.groups)

    @functools.cached_property
    def has_state(self) -> bool:
        return any(g.kind == "state" for g in self.groups)

    @functools.cached_property
    def state_mask(self) -> int:
        """The bits of the state groups (a page without its checkpoint)."""
        return sum(1 << g for g, group in enumerate(self.groups) if group.kind == "state")

    def l3_page_keys(self, keys: Sequence[PageKey]) -> list[PageKey]:
        """Every L3 key pages ``keys`` may be stored under, each once: the keys, and
        with state groups their bodies too (page_keys.body_key)."""
        out = dict.fromkeys(keys)
        if self.has_state:
            out.update(dict.fromkeys(PageKey(body_key(k)) for k in keys))
        return list(out)

    def l3_keys(self, key: bytes, mask: int) -> tuple[bytes, ...]:
        """The L3 keys of a page stored with residency ``mask``: a complete page
        under its key; with state groups, every page whose other groups are
        complete under its body's key too (page_keys.body_key); else none."""
        if not self.has_state:
            return () if mask else (key,)
        if mask & ~self.state_mask:
            return ()
        return (body_key(key),) if mask else (key, body_key(key))

    def page_blocks(self, block_ids: GroupBlockIds, page: int, blocks_per_page: int,
                    lo: int = 0, hi: int | None = None, checkpoints: Checkpoints | None = None,
                    ) -> tuple[int, ...]:
        """Blocks ``[lo, hi)`` of page ``page`` (block offsets in the page), every
        group's, concatenated in group order; () when a group lacks them. A state
        group gives the null block but at the page's last offset: its block in
        ``checkpoints`` there (the null block when it has none)."""
        hi = blocks_per_page if hi is None else hi
        start = page * blocks_per_page
        if self.plain:  # a page is its blocks: the loop below without its costs
            part = block_ids[0][start + lo : start + hi]
            return tuple(part) if len(part) == hi - lo else ()
        last = blocks_per_page - 1
        own = (checkpoints or {}).get(page, {})
        out: list[int] = []
        for g, (group, ids) in enumerate(zip(self.groups, block_ids, strict=True)):
            if group.kind == "state":
                entries = [NULL_BLOCK_ID] * (hi - lo)
                if lo <= last < hi:
                    entries[last - lo] = own.get(g, NULL_BLOCK_ID)
                out.extend(entries)
                continue
            part = ids[start + lo : start + hi]
            if len(part) < hi - lo:
                return ()
            out.extend(part)
        return tuple(out)

    @property
    def aligned(self) -> bool:
        """State groups in vLLM's "align" Mamba cache mode (its prefix caching on)."""
        return any(g.aligned for g in self.groups if g.kind == "state")

    def state_blocks(self, block_ids: GroupBlockIds, computed: int, page_size: int,
                     blocks_per_page: int) -> dict[int, dict[int, int]]:
        """The request's state blocks as the checkpoint of the page whose end its
        ``computed`` tokens stop at (none unless that is a page end): its one state
        block per group, or in "align" mode the one at the page's last position
        (see the module docstring)."""
        if computed % page_size or not computed or not self.has_state:
            return {}
        page = computed // page_size - 1
        at = (page + 1) * blocks_per_page - 1
        own: dict[int, int] = {}
        for g, (group, ids) in enumerate(zip(self.groups, block_ids, strict=True)):
            if group.kind != "state":
                continue
            block = (ids[at] if at < len(ids) else NULL_BLOCK_ID) if group.aligned else \
                (ids[0] if ids else NULL_BLOCK_ID)
            if block != NULL_BLOCK_ID:
                own[g] = block
        return {page: own} if own else {}

    def handed_off(self, handoff: StateHandoff, page_size: int) -> dict[int, dict[int, int]]:
        """The checkpoints in vLLM's hand-off of "align" boundary states: those whose
        boundary is a page end, for a state group of this engine."""
        out: dict[int, dict[int, int]] = {}
        for g, block, boundary in handoff:
            if boundary > 0 and boundary % page_size == 0 and block != NULL_BLOCK_ID and \
                    0 <= g < len(self.groups) and self.groups[g].kind == "state":
                out.setdefault(boundary // page_size - 1, {})[g] = block
        return out

    def split(self, blocks: Sequence[int]) -> list[Sequence[int]]:
        """A page's concatenated blocks, one slice per group."""
        n = len(blocks) // len(self.groups)
        return [blocks[g * n : (g + 1) * n] for g in range(len(self.groups))]

    def missing_mask(self, blocks: Sequence[int]) -> int | None:
        """Residency of a page stored from ``blocks``: bit g set = group g's blocks
        are (partly) vLLM's null block; None = not storable (a full-attention
        group lacks blocks)."""
        if self.plain:
            return None if NULL_BLOCK_ID in blocks else 0
        mask = 0
        for g, (group, ids) in enumerate(zip(self.groups, self.split(blocks), strict=True)):
            if group.kind == "state":
                if not ids or ids[-1] == NULL_BLOCK_ID:
                    mask |= 1 << g
            elif NULL_BLOCK_ID in ids:
                if group.kind == "full":
                    return None
                mask |= 1 << g
        return mask

    def usable_pages(self, masks: Sequence[int], first_token: int, page_size: int) -> int:
        """The longest hit ``P <= len(masks)`` pages whose tokens ``[first_token, P *
        page_size)`` can be loaded: every windowed group present in the pages vLLM
        keeps real blocks for when the hit ends there. 0 when none is."""
        if not any(masks):
            return len(masks)
        for pages in range(len(masks), 0, -1):
            end = pages * page_size
            if end <= first_token:
                return 0
            if all(self._has_window(masks, g, group, first_token, end, page_size)
                   for g, group in enumerate(self.groups) if group.kind == "window") and \
                    all(not masks[pages - 1] & (1 << g)
                        for g, group in enumerate(self.groups) if group.kind == "state"):
                return pages
        return 0

    @staticmethod
    def _has_window(masks: Sequence[int], g: int, group: KVGroup, first_token: int,
                    end: int, page_size: int) -> bool:
        # vLLM's SlidingWindowManager skips blocks before end - window + 1.
        needed_from = max(first_token, end - group.window + 1, 0)
        return all(not masks[p] & (1 << g) for p in range(needed_from // page_size,
                                                           -(-end // page_size)))
