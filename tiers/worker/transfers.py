"""The copies of one set of pages, per KV-cache group, and one step's stores from queued to published.

Contract:
- ``group_transfer(pages, group_rows)`` splits each page's block ids by
  group (a page names every group's blocks, tiers/index/kv_groups.py) into
  one ``BlockTransfer`` per group; vLLM's null block (a token out of a
  sliding window) is never copied.
- ``PendingStore`` is one plan's L1 -> L2 stores from queued to published
  (tiers/worker/store_queue.py, "stores across steps"): its copy checkpoint, the
  finished requests vLLM keeps the blocks of until it is done, the pages'
  checksums when the copy thread took them.
- ``l3_keys(page)`` are the keys a stored page is backed up under.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hicache.kernels.block_copy import BlockTransfer
from hicache.kernels.layer_pipeline import Checkpoint
from hicache.tiers.index.plans import NULL_BLOCK_ID, PagePlan, StepPlan
from hicache.tiers.worker.stats import CopyClock


@dataclass(frozen=True)
class GroupTransfer:
    """One set of page copies, as a ``BlockTransfer`` per KV-cache group."""

    groups: tuple[BlockTransfer, ...]
    # Pool rows (layers) of each group.
    rows: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(t) for t in self.groups)

    def num_bytes(self, block_bytes: int) -> int:
        return sum(len(t) * n for t, n in zip(self.groups, self.rows, strict=True)) * block_bytes


def group_transfer(pages: Sequence[PagePlan], group_rows: Sequence[Sequence[int]]
                   ) -> GroupTransfer:
    """The copies of ``pages``, one ``BlockTransfer`` per KV-cache group."""
    lists: list[tuple[list[int], list[int], list[int]]] = [([], [], []) for _ in group_rows]
    for page in pages:
        n = len(page.block_ids) // len(lists)
        for g, (block_ids, slots, offsets) in enumerate(lists):
            for i, block_id in enumerate(page.block_ids[g * n : (g + 1) * n]):
                if block_id == NULL_BLOCK_ID:
                    continue  # out of a sliding window: vLLM's null block, never touched
                block_ids.append(block_id)
                slots.append(page.slot)
                offsets.append(page.first_offset + i)
    return GroupTransfer(tuple(BlockTransfer.from_lists(*lst) for lst in lists),
                         tuple(len(rows) for rows in group_rows))


def l3_keys(page: PagePlan) -> tuple[bytes, ...]:
    """The L3 keys a stored page is backed up under: the plan's, else its key, except
    that a page stored without some group's blocks (vLLM's null block) stays in L2."""
    if page.l3_keys is not None:
        return page.l3_keys
    return () if NULL_BLOCK_ID in page.block_ids else (page.key,)


@dataclass(eq=False)
class PendingStore:
    """One plan's L1 -> L2 stores, from queued to published."""

    plan: StepPlan
    transfer: GroupTransfer
    clock: CopyClock
    # Finished requests vLLM keeps the blocks of until this store is done.
    release: list[str] = field(default_factory=list)
    mark: Checkpoint | None = None
    # A copy raised (a CUDA error surfacing at the checkpoint counts too: ``failed``).
    copy_failed: bool = False
    order: int = 0  # its place in the worker's queue (0: not queued yet)
    # xxh3 of each stored page's bytes, in ``pages`` order (None: not computed).
    sums: list[int] | None = None
    keys: dict[int, bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = {p.slot: p.key for p in self.pages}

    @property
    def pages(self) -> list[PagePlan]:
        return self.plan.stores

    @property
    def failed(self) -> bool:
        return self.copy_failed or (self.mark is not None and self.mark.failed)
