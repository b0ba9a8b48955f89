"""The read path into L1: which blocks of a hit are filled from which L2 slots.

Contract:
- ``hit_pages`` maps the external tokens vLLM granted, ``[start, end)``,
  onto pages: one ``PagePlan`` per page that has blocks in that range, the
  first one possibly starting mid-page (vLLM's own prefix cache already
  holds its head). Granted tokens that no matched page covers are returned
  as ``unloadable`` blocks, which the worker reports as load errors so vLLM
  recomputes them.
- L2 loads are synchronous: they finish before the step's forward pass.
  ``StepLoads`` holds this step's loads with their matched tree prefix
  locked, and releases the locks when the plan is taken: the worker runs
  steps in order, so no later step can overwrite those slots first.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tiers.index.kv_groups import GroupBlockIds, KVGroups
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.plans import PagePlan, RequestLoad
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.tree_node import TreeNode


def hit_pages(keys: Sequence[PageKey], slots: Sequence[int], start: int, end: int,
              block_ids: GroupBlockIds, page_size: int, block_size: int,
              groups: KVGroups | None = None,
              ) -> tuple[list[PagePlan], tuple[int, ...]]:
    """(copies filling tokens ``[start, end)`` of a request from the pages in
    ``slots`` (page i in ``slots[i]``), the blocks of that range no page covers);
    ``block_ids`` are the request's blocks per KV-cache group."""
    groups = groups or KVGroups.single()
    blocks_per_page = page_size // block_size
    # State groups (Mamba): the request's state block gets the checkpoint of the
    # hit's last page (in "align" mode, the one at the hit's last position).
    checkpoints = groups.state_blocks(block_ids, end, page_size, blocks_per_page)
    matched_tokens = len(slots) * page_size
    first_block = start // block_size
    end_block = -(-min(end, matched_tokens) // block_size)
    pages = []
    for page in range(start // page_size, len(slots)):
        lo = max(first_block, page * blocks_per_page)
        hi = min(end_block, (page + 1) * blocks_per_page)
        if lo >= hi:
            break
        first = page * blocks_per_page
        pages.append(PagePlan(slot=slots[page], key=keys[page], first_offset=lo - first,
                              block_ids=groups.page_blocks(block_ids, page, blocks_per_page,
                                                           lo - first, hi - first, checkpoints)))
    unloadable = tuple(b for ids in block_ids for b in ids[end_block : -(-end // block_size)])
    return pages, unloadable


class StepLoads:
    """This step's L2 -> L1 loads, each with its tree prefix locked until taken."""

    def __init__(self, tree: HiRadixTree) -> None:
        self._tree = tree
        self._loads: list[RequestLoad] = []
        self._locks: list[TreeNode] = []

    def pending(self) -> bool:
        """Any load (hence a locked prefix) waits for the next plan."""
        return bool(self._locks)

    def add(self, node: TreeNode, load: RequestLoad) -> None:
        """Queue ``load`` of the pages ending at ``node`` and lock them."""
        self._tree.lock(node)
        self._locks.append(node)
        self._loads.append(load)

    def take(self) -> list[RequestLoad]:
        """The loads for this step's plan; their pages may be evicted from now on."""
        for node in self._locks:
            self._tree.unlock(node)
        loads, self._loads, self._locks = self._loads, [], []
        return loads
