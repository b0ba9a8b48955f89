"""Flush (the admin endpoint's): drop cached pages from L2 and plan their removal from L3.

Contract:
- ``prefix_keys`` keys a plain-token prompt exactly as its requests get
  keyed (through the engine's own block hashes: ``PrefixHasher``), so a
  flush or a tree view by prefix finds the pages those requests stored.
- Without a prefix, every page goes from the chosen tiers, and L3 is cleared.
- With a prefix, a page is flushed when its tokens extend the prefix: when
  the prefix ends on a page boundary, its last page and every page after
  it; when it ends mid-page, every page after its last full page (page keys
  hash whole pages, so siblings that share the full pages are flushed too).
  Those pages are found in the HiRadixTree, which indexes L2 and L3
  (radix_tree.py), so a page only L3 holds is flushed as exactly as one in
  L2.
- Pins (retain_s, admin pins) inside what is flushed from L2 or forgotten end
  first (``release``), so pinned pages go too. Pages in use by a load or fetch
  stay in L2 (counted as skipped). A page
  flushed from one tier stays in the other.
- The L3 removal is ``ClearStore()`` or ``DeletePages(keys)`` (tiers/index/commands.py): the
  flushed pages the tree knows, in either tier, plus, for a page-aligned
  prefix, its last page (which makes every later page unreachable by
  lookups, even ones this engine never saw).
  The caller runs it outside the scheduler lock, on its own storage instance
  and on every worker (each holds its rank's shard).
- Forget (``forget``): a conversation's own pages, from every tier: every page
  of the prompt after the pages another cached prefix shares with it
  (``HiRadixTree.shared_depth``: the deepest fork off the prompt's path; at least
  ``keep_tokens`` leading tokens are kept too), and every page that extends
  the prompt (its later turns). L3 loses every one of those keys, whether the
  tree knew them or not, so no engine finds them again. Sharing is judged from
  this engine's tree: a prefix shared only with conversations this engine never
  saw needs ``keep_tokens``. Keys cover full pages: a prompt that ends inside the
  conversation's first own page names only the shared pages before it, and a
  prompt ending where several conversations part (a system prompt) removes
  nothing.
- Live requests forget which of their pages are in L2 and match again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.tiers.controller.l2_manager import L2Manager
from hicache.tiers.controller.requests import RequestTable
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.commands import ClearStore, DeletePages, L3Removal
from hicache.tiers.index.page_keys import (
    PageKey,
    block_page_keys,
    token_block_hashes,
)
from hicache.tiers.index.tree_node import Dropped, TreeNode

# Called with the subtrees a flush or forget is about to drop from L2 (pins.py
# release_under: their pins end, so pinned pages go too).
Release = Callable[[list[TreeNode]], object]
# (token ids, cache salt, LoRA name) -> the engine's block hashes of that prompt.
PrefixHasher = Callable[[Sequence[int], "str | None", "str | None"], list[bytes]]


class StandInPrefixHasher:
    """The engine-free prefix hasher: ``token_block_hashes`` over blocks of
    ``block_size`` tokens, the same hashes ``SimRequest`` gets."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, tokens: Sequence[int], cache_salt: str | None,
                 lora_name: str | None) -> list[bytes]:
        return token_block_hashes(tokens, self.block_size, cache_salt, lora_name)


class Flusher:
    """Flushes L2 pages by prefix or all of them (see the module docstring)."""

    def __init__(self, l2: L2Manager, requests: RequestTable, stats: SchedulerStats, *,
                 seed: bytes, page_size: int, hashes_per_page: int,
                 prefix_hasher: PrefixHasher) -> None:
        self.l2 = l2
        self.page_size = page_size
        self._requests = requests
        self._stats = stats
        self._seed = seed
        self._hashes_per_page = hashes_per_page
        self._prefix_hasher = prefix_hasher

    def prefix_keys(self, prefix: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[PageKey]:
        """Keys of the full pages of a plain-token prompt, as its requests get them."""
        hashes = self._prefix_hasher(list(prefix), cache_salt, lora_name)
        return block_page_keys(self._seed, hashes, self._hashes_per_page)

    def flush(self, tiers: set[str], prefix: Sequence[int] | None,
              cache_salt: str | None = None, lora_name: str | None = None,
              release: Release | None = None) -> tuple[dict[str, int], L3Removal | None]:
        """Flush ``tiers`` ("l2", "l3") of all pages or those below ``prefix``;
        (L2 counts, the L3 removal or None)."""
        l2, l3 = "l2" in tiers, "l3" in tiers
        tree = self.l2.tree
        l3_op: L3Removal | None = None
        tops: list[TreeNode] = []
        if prefix is None:
            tops = list(tree.root.children.values())
            if release is not None and l2:
                release(tops)
            dropped = self.l2.drop(tops, l2=l2, l3=l3)
            if l3:
                l3_op = ClearStore()
                self.l2.events.l3_removed(None)
        else:
            keys = self.prefix_keys(prefix, cache_salt, lora_name)
            aligned = bool(keys) and len(prefix) % self.page_size == 0
            if aligned:
                top = tree.subtree_at(keys, len(keys) - 1)
                tops = [top] if top is not None else []
            else:
                node = tree.find(keys)
                tops = list(node.children.values()) if node is not None else []
            if release is not None and l2:
                release(tops)
            spans = self._span_objects(tops, keys, len(keys) - 1 if aligned else len(keys))
            dropped = self.l2.drop(tops, l2=l2, l3=l3)
            if l3:
                l3_op = self._delete_pages(dropped.keys + ([keys[-1]] if aligned else []),
                                           spans)
        return self._settle(dropped), l3_op

    def forget(self, prefix: Sequence[int], cache_salt: str | None = None,
               lora_name: str | None = None, keep_tokens: int = 0,
               release: Release | None = None) -> tuple[dict[str, int], DeletePages | None]:
        """Remove a conversation's own pages from L2 and plan their removal from L3
        (see the module docstring for which); (L2 counts, the L3 removal or None)."""
        return self.forget_keys(self.prefix_keys(prefix, cache_salt, lora_name),
                                keep_tokens // self.page_size, release)

    def forget_keys(self, keys: Sequence[PageKey], keep_pages: int = 0,
                    release: Release | None = None) -> tuple[dict[str, int], DeletePages | None]:
        """``forget`` of a conversation known by its page keys (a closed session's)."""
        tree = self.l2.tree
        start = max(tree.shared_depth(keys), min(keep_pages, len(keys)))
        # No other prefix forks off the path after ``start`` (shared_depth is the
        # deepest fork): the subtree from there is the conversation's own.
        top = tree.subtree_at(keys, start)
        tops = [top] if top is not None else []
        if release is not None:
            release(tops)
        spans = self._span_objects(tops, keys, start)
        dropped = self.l2.drop(tops, l2=True, l3=True)
        counts = self._settle(dropped)
        counts["kept_shared_pages"] = start
        doomed = list(keys[start:]) + dropped.keys
        return counts, self._delete_pages(doomed, spans) if doomed else None

    def _span_objects(self, tops: list[TreeNode], keys: Sequence[PageKey],
                      start: int) -> list[bytes]:
        """Keys of the L3 span objects (tiers/index/spans.py) holding a page about to go:
        those ending at a page of ``keys[start:]`` (a prompt's keys from its first page)
        or of the subtrees under ``tops``. A span object goes whole, also with pages
        before ``start`` in it: those are then read from their page objects, or miss
        and are recomputed."""
        spans = self.l2.spans
        if not spans.enabled:
            return []
        found = [key for p, key in enumerate(keys) if p >= start and spans.ends_span(p)]
        for top in tops:
            # Pages above ``top``: its first page's place in every request it serves.
            depth, node = 0, top.parent
            while node is not None:
                depth += len(node.keys)
                node = node.parent
            todo = [(top, depth)]
            while todo:
                node, first = todo.pop()
                found.extend(k for i, k in enumerate(node.keys) if spans.ends_span(first + i))
                todo.extend((child, first + len(node.keys)) for child in node.children.values())
        return [spans.object_key(k) for k in dict.fromkeys(found)]

    def _delete_pages(self, keys: list[PageKey], spans: Sequence[bytes] = ()) -> DeletePages:
        """The L3 removal of ``keys`` (each once), told to the KV events, and of the span
        objects ``spans``; with Mamba state groups their bodies too (page_keys.body_key)."""
        doomed = list(dict.fromkeys(keys))
        self.l2.events.l3_removed(doomed)
        return DeletePages((*self.l2.groups.l3_page_keys(doomed), *map(PageKey, spans)))

    def _settle(self, dropped: Dropped) -> dict[str, int]:
        counts = {"l2_pages": len(dropped.freed_slots),
                  "skipped_locked": len(dropped.kept_slots)}
        self._requests.forget_stored()
        self._stats.flushed_l2_pages += counts["l2_pages"]
        self._stats.flush_skipped_locked += counts["skipped_locked"]
        return counts

