"""The HiRadixTree's node and what its calls return (tiers/index/radix_tree.py).

Contract:

- ``TreeNode`` is one edge: a run of pages with the same L2 residency and
  locks. Its fields are the tree's to change (radix_tree.py keeps the
  invariants); everyone else reads them. ``id`` orders nodes created later
  after earlier ones and breaks ties in eviction.
- ``MatchResult`` / ``InsertResult`` / ``Dropped``: what ``match_prefix``,
  ``insert`` and ``drop_subtrees`` return, plain data.
- ``DEFAULT_PRIORITY``: the eviction class of pages nobody classed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hicache.tiers.index.page_keys import PageKey

_node_ids = itertools.count()

# Eviction class of pages nobody classed (hints.py maps the request's names to these).
DEFAULT_PRIORITY = 1


class TreeNode:
    """One edge of the tree: a run of pages with identical L2 residency and locks."""

    __slots__ = (
        "id",
        "keys",
        "parent",
        "children",
        "host_slots",
        "in_l3",
        "l2_children",
        "lock_ref",
        "hit_count",
        "last_access",
        "priority",
        "tail_lost",
    )

    def __init__(
        self,
        keys: list[PageKey],
        parent: TreeNode | None,
        host_slots: list[int] | None,
        last_access: float,
        in_l3: list[bool] | None = None,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        self.id: int = next(_node_ids)
        self.keys = keys
        self.parent = parent
        # Keyed by the child's first page key: siblings never share one.
        self.children: dict[PageKey, TreeNode] = {}
        self.host_slots = host_slots
        # Per page: L3 holds it (as far as this engine knows).
        self.in_l3 = in_l3 if in_l3 is not None else [False] * len(keys)
        # Children that are L2-resident (an L2 node without any is an L2 leaf).
        self.l2_children = 0
        self.lock_ref = 0
        self.hit_count = 1  # SGLang semantics: creation counts as one hit
        self.last_access = last_access
        self.priority = priority  # eviction class: lower goes first
        # Pages below this node that left L2 by eviction since it last gained an L2
        # child: how much of its conversation's tail a returning turn recomputes.
        self.tail_lost = 0

    def __repr__(self) -> str:
        tier = "L2" if self.host_slots is not None else "L3"
        return (
            f"TreeNode(id={self.id}, pages={len(self.keys)}, {tier}, "
            f"in_l3={sum(self.in_l3)}, lock_ref={self.lock_ref}, "
            f"hits={self.hit_count}, priority={self.priority}, "
            f"children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    node: TreeNode  # ends exactly at the last L2-matched page (root when nothing matched)
    num_pages: int
    host_slots: list[int]  # one per matched page, in order
    # Pages after the L2 match that the tree knows L3 holds, consecutively.
    l3_pages: int = 0


@dataclass(frozen=True)
class InsertResult:
    node: TreeNode  # ends exactly at the last inserted page
    unused_slots: list[int]  # given slots of pages already in L2: free them
    num_new_pages: int  # pages that entered L2 (new, or L3-only before)


@dataclass
class Dropped:
    """What ``drop_subtrees`` took out of the tiers."""

    freed_slots: list[int] = field(default_factory=list)  # L2 slots now free
    kept_slots: list[int] = field(default_factory=list)  # L2 slots of locked pages, kept
    keys: list[PageKey] = field(default_factory=list)  # every page key below the tops
