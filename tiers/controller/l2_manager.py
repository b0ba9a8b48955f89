"""L2 placement: which pages the host pool holds, in which slots, and what leaves it.

Contract:
- ``L2Manager`` owns the HiRadixTree (the index of L2-resident pages) and the
  slot allocator, and keeps them exact: every slot is either free or held by
  exactly one page of the tree (or reserved for a fetch or store in flight).
- Room is made by the eviction policy (``policies.py``; leaf-first LRU), and
  only from unlocked pages: a caller locks the prefix it is about to extend
  before it allocates, so the prefix survives the eviction.
- ``plan_store`` publishes pages in the tree as soon as their store is
  planned: the worker runs steps in order and finishes a step's stores
  before a later step's loads (see tiers/index/plans.py), so a hit on a page
  never reads a slot before its bytes are there. Until the plan that carries
  their copies is built (``release_planned_stores``) those pages are locked:
  a later allocation of the same plan (another request's store, a fetch)
  must not evict them and give their slot out twice.
- vLLM's null block (a sliding window's dropped blocks) is never stored. A
  page whose full-attention blocks are not all real ends the store (L2 stays
  prefix-closed). A page whose windowed groups lost blocks
  (tiers/index/kv_groups.py) is stored without them: its slot's
  residency mask (``missing_of``) says which groups it lacks, and lookups
  only end a hit where the window's pages have them.
- Slots a worker found unusable (failed store, key mismatch) are dropped
  with every page below them at the next step; pages locked by a load or
  fetch are dropped once unlocked.
- L3 residency lives in the same tree (radix_tree.py): pages are marked
  when every writing rank backed them up (``backed_up``), when a fetch read
  them and when a lookup found them (``found_in_l3``), and unmarked when a
  fetch could not read them (``publish_fetched``) or a flush deleted them
  (``drop``). Eviction from L2 keeps what L3 holds as L3-only pages. Not for
  models with Mamba state groups (``l3_index`` False): their L3 pages are
  bodies and checkpoints, looked up in the store every time (fetches.py).
- Every page that enters or leaves L2 or L3 is told to ``events``
  (tiers/controller/events.py, vLLM's KV events; off by default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hicache.tiers.controller.events import EventRequest, PageEvents
from hicache.tiers.controller.policies import EvictionPolicy, LeafFirstLRU
from hicache.tiers.controller.stats import SchedulerStats
from hicache.tiers.index.kv_groups import Checkpoints, GroupBlockIds, KVGroups
from hicache.tiers.index.page_keys import PageKey
from hicache.tiers.index.plans import PagePlan
from hicache.tiers.index.radix_tree import HiRadixTree
from hicache.tiers.index.slot_allocator import SlotAllocator
from hicache.tiers.index.spans import SpanLayout, SpanRef
from hicache.tiers.index.tree_node import DEFAULT_PRIORITY, Dropped, MatchResult, TreeNode


class L2Manager:
    """The tree and the slots of the L2 host pool (see the module docstring)."""

    def __init__(self, num_slots: int, blocks_per_page: int, stats: SchedulerStats,
                 eviction: EvictionPolicy | None = None,
                 groups: KVGroups | None = None, events: PageEvents | None = None) -> None:
        self.tree = HiRadixTree()
        # What entered and left the tree, for vLLM's KV events (off by default).
        self.events = events or PageEvents(page_size=1, hashes_per_page=1)
        self.groups = groups or KVGroups.single()
        # The tree records L3 residency (see the module docstring).
        self.l3_index = not self.groups.has_state
        # slot -> groups the page in it lacks (bit g = group g); defined for every
        # slot the tree holds, set whenever a slot is given a page; 0 = complete.
        self._missing: dict[int, int] = {}
        self.slots = SlotAllocator(num_slots)
        self.eviction = eviction or LeafFirstLRU()
        self.blocks_per_page = blocks_per_page
        # How L3 objects group pages (tiers/index/spans.py); set by the scheduler
        # where its L3 stores spans. Never with state groups (bodies are per page).
        self.spans = SpanLayout()
        # Pages in L2 that stores cut out of a span (``_store_spans``): backed up to L3
        # as page objects with the next plan (``take_backups``).
        self._backups: list[PagePlan] = []
        self._stats = stats
        self._bad_slots: set[int] = set()
        # Nodes of stores planned but not yet in a plan handed to the workers:
        # locked, so no allocation before that (another store of the same plan, a
        # fetch reserved meanwhile) evicts a page whose bytes are not copied yet
        # and gives its slot out twice (release_planned_stores).
        self._unsent: list[TreeNode] = []

    def room(self) -> int:
        """Pages that could be allocated now: free slots plus unlocked pages."""
        return self.slots.num_free + self.tree.evictable_pages()

    def allocate(self, n: int) -> list[int] | None:
        """``n`` slots, evicting unlocked pages as needed; None (nothing taken) if short."""
        short = n - self.slots.num_free
        if short > 0:
            freed = self.eviction.evict(self.tree, short)
            self.events.removed(freed)
            self.slots.free(freed)
            self._stats.evicted_pages += len(freed)
        return self.slots.alloc(n)

    def storable(self, keys: Sequence[PageKey]) -> int:
        """How many of ``keys``, from the first, L2 could hold after a store now: the
        prefix it has plus the room beside it (that prefix kept, as plan_store keeps it)."""
        match = self.tree.match_prefix(keys)
        self.tree.lock(match.node)
        try:
            room = self.room()
        finally:
            self.tree.unlock(match.node)
        return min(len(keys), match.num_pages + room)

    def missing_of(self, slot: int) -> int:
        """Groups the page in ``slot`` lacks (bit g = group g; 0 = complete)."""
        return self._missing.get(slot, 0)

    def plan_store(self, keys: Sequence[PageKey], block_ids: GroupBlockIds,
                   checkpoints: Checkpoints | None = None, source: EventRequest | None = None,
                   priority: int = DEFAULT_PRIORITY,
                   known: Sequence[PageKey] | None = None) -> list[PagePlan] | None:
        """Store the pages of ``keys`` beyond the prefix already in L2, from
        ``block_ids`` (the request's blocks, per group): allocate their slots
        and publish them. ``checkpoints``: the L1 blocks holding state groups'
        checkpoints, per page (kv_groups.py; None: no page has one). ``source``:
        the request whose pages they are (KV events); ``priority``: their eviction
        class (the tree's priorities). ``known``: every page key of the request
        known now (its prompt's, beyond ``keys``): a page of a span these keys
        complete goes to L3 inside that span's object, queued by the plan that
        stores the span's last page (``_complete_spans``), not as a page object.

        Returns the copies to plan ([] when nothing is missing or storable),
        or None when L2 has no room now (the caller may try again later).
        """
        bpp = self.blocks_per_page
        match = self.tree.match_prefix(keys)
        # A sliding window puts vLLM's null block where it no longer reaches,
        # and the tree must stay prefix-closed: the first page that cannot be
        # stored ends the store (see the module docstring for windowed groups).
        masks: list[int] = []
        page_blocks: list[tuple[int, ...]] = []
        for page in range(match.num_pages, len(keys)):
            blocks = self.groups.page_blocks(block_ids, page, bpp, checkpoints=checkpoints)
            mask = self.groups.missing_mask(blocks) if blocks else None
            if mask is None:
                self._stats.store_skipped_pages += len(keys) - page
                keys = keys[:page]
                break
            masks.append(mask)
            page_blocks.append(blocks)
        if match.num_pages >= len(keys):
            return []
        need = len(keys) - match.num_pages
        # The prefix we extend must survive the eviction that makes room for it.
        self.tree.lock(match.node)
        try:
            slots = self.allocate(need)
        finally:
            self.tree.unlock(match.node)
        if slots is None:
            self._stats.store_skipped_pages += need
            return None
        inserted = self.tree.insert(keys, list(match.host_slots) + slots, priority)
        self.tree.lock(inserted.node)
        self._unsent.append(inserted.node)
        leftover = set(inserted.unused_slots) & set(slots)
        if leftover:  # cannot happen single-threaded; keep the allocator exact anyway
            self.slots.free(sorted(leftover))
        plans = []
        spans = self._store_spans(keys, match.num_pages, masks, leftover, slots)
        later = self._later_spans(known, match.num_pages, len(keys), masks, spans, leftover,
                                  slots)
        self._cut_span_backups(keys, match, known if any(later) else None)
        for i, slot in enumerate(slots):
            if slot in leftover:
                continue
            page = match.num_pages + i
            self._missing[slot] = masks[i]
            self._stats.stored_partial_pages += masks[i] != 0
            # A page its span object will carry gets no page object of its own.
            at = () if later[i] is not None else self.groups.l3_keys(keys[page], masks[i])
            plans.append(PagePlan(slot, keys[page], 0, page_blocks[i], l3_keys=at,
                                  span=spans[i]))
        self._complete_spans(keys, later, match, slots)
        if source is not None:
            self.events.added(source, [(p.slot, match.num_pages + i, p.key)
                                       for i, p in enumerate(plans)])
        self._stats.stored_pages += len(plans)
        self._stats.max_used_slots = max(self._stats.max_used_slots, self.slots.num_used)
        return plans

    def _store_spans(self, keys: Sequence[PageKey], start: int, masks: list[int],
                     leftover: set[int], slots: list[int]) -> list[SpanRef | None]:
        """The span object of each page stored from ``start`` on: only spans stored
        whole in this plan, every page complete (tiers/index/spans.py)."""
        if not self.spans.enabled or self.groups.has_state:
            return [None] * len(slots)
        refs = self.spans.refs(keys, start, len(keys), whole=True)
        bad = {ref.key for ref, mask, slot in zip(refs, masks, slots, strict=True)
               if ref is not None and (mask or slot in leftover)}
        return [None if ref is None or ref.key in bad else ref for ref in refs]

    def _later_spans(self, known: Sequence[PageKey] | None, start: int, end: int,
                     masks: list[int], whole: list[SpanRef | None], leftover: set[int],
                     slots: list[int]) -> list[SpanRef | None]:
        """Per page stored from ``start`` to ``end``: the span object that will carry
        it, where the request's ``known`` keys complete its span but this plan does
        not store the span whole (a prefill cut into steps, a head another request
        stored); None: whole in this plan, or a page object."""
        none: list[SpanRef | None] = [None] * (end - start)
        if known is None or not self.spans.enabled or self.groups.has_state:
            return none
        refs = self.spans.refs(known, start, end)
        return [None if ref is None or whole[i] is not None or masks[i]
                or slots[i] in leftover else ref for i, ref in enumerate(refs)]

    def _complete_spans(self, keys: Sequence[PageKey], later: list[SpanRef | None],
                        match: MatchResult, slots: list[int]) -> None:
        """Each span whose last page this plan stores and which ``_later_spans`` gave
        an object: back up every page of it from L2 as that one object with the next
        plan (the earlier pages are in L2: this plan's match holds them)."""
        start = match.num_pages
        for i, ref in enumerate(later):
            if ref is None or ref.index != ref.count - 1:
                continue
            first = start + i - ref.count + 1
            places = [match.host_slots[p] if p < start else slots[p - start]
                      for p in range(first, start + i + 1)]
            whole = all(not self._missing.get(slot, 0) for slot in places)
            self._backups.extend(
                PagePlan(slot, keys[first + j], 0, (), l3_keys=(keys[first + j],),
                         span=SpanRef(ref.key, j, ref.count) if whole else None)
                for j, slot in enumerate(places) if not self._missing.get(slot, 0))

    def _cut_span_backups(self, keys: Sequence[PageKey], match: MatchResult,
                          known: Sequence[PageKey] | None = None) -> None:
        """A store that starts inside a span leaves that span's leading pages (in L2,
        stored by whichever request came first) inside that request's span object,
        which a lookup of this request cannot name: they are backed up as page objects
        too, so the lookup finds them page by page (spans.py ``run_in_store``).
        Not where this request's ``known`` keys complete the span: its own span
        object will hold them (``_complete_spans``)."""
        layout, start = self.spans, match.num_pages
        if not layout.enabled or self.groups.has_state or not start % layout.pages:
            return
        if start >= len(keys) or not layout.has_span(keys, start):
            return
        if known is not None and layout.has_span(known, start):
            return
        first = start - start % layout.pages
        slots = match.host_slots
        self._backups.extend(PagePlan(slots[p], keys[p], 0, ()) for p in range(first, start)
                             if not self._missing.get(slots[p], 0))

    def back_up(self, pages: Sequence[tuple[PageKey, int]]) -> None:
        """Back up these (key, slot) pages L2 holds to L3 with the next plan (the L3
        admission rule admitted them late: policies.py ``reused``); a page stored
        without some group's blocks stays in L2 (kv_groups.py ``l3_keys``)."""
        for key, slot in pages:
            at = self.groups.l3_keys(key, self.missing_of(slot))
            if at:
                self._backups.append(PagePlan(slot, key, 0, (), l3_keys=at))

    def take_backups(self) -> list[PagePlan]:
        """The L2 pages to back up to L3 as page objects with the next plan."""
        backups, self._backups = self._backups, []
        return backups

    def publish_fetched(self, node: TreeNode, prefix_keys: Sequence[PageKey],
                        keys: Sequence[PageKey], slots: Sequence[int], fetched: int,
                        masks: Sequence[int] = (), source: EventRequest | None = None,
                        tried: bool = True) -> None:
        """An L3 fetch ended: its first ``fetched`` pages (``keys``, in their reserved
        ``slots``, with residency ``masks``: default complete) extend the locked
        prefix ``node`` in the tree; unlock it and free every reserved slot that no
        page of the tree holds. ``source``: the request whose pages they are;
        ``tried``: False for a fetch cancelled before it ran."""
        unused = list(slots[fetched:])
        attached = node is self.tree.root or node.parent is not None
        for i, slot in enumerate(slots[:fetched]):
            self._missing[slot] = masks[i] if i < len(masks) else 0
        if fetched and attached:
            # The prefix is locked, hence still resident.
            prefix = self.tree.match_prefix(prefix_keys)
            assert prefix.num_pages == len(prefix_keys), "locked prefix left L2"
            mine = set(slots)
            inserted = self.tree.insert(list(prefix_keys) + list(keys[:fetched]),
                                        prefix.host_slots + list(slots[:fetched]))
            unused += [s for s in inserted.unused_slots if s in mine]
            if source is not None:
                spare = set(unused)
                self.events.added(source, [(slot, len(prefix_keys) + i, keys[i])
                                           for i, slot in enumerate(slots[:fetched])
                                           if slot not in spare])
        elif fetched:
            unused = list(slots)
        self.tree.unlock(node)
        if unused:
            self.slots.free(sorted(set(unused)))
        if self.l3_index and tried:
            # Read from L3: it holds them. The pages after them it could not
            # give (missing, unreadable or too late): ask the store next time.
            self.events.l3_added(self.tree.mark_l3_keys(keys[:fetched]))
            self.events.l3_removed(self.tree.unmark_l3_keys(keys[fetched:]))

    def found_in_l3(self, keys: Sequence[PageKey], start: int,
                    source: EventRequest | None = None) -> None:
        """A lookup found ``keys[start:]`` in L3 after ``keys[:start]`` (in the tree)."""
        if not self.l3_index or start >= len(keys):
            return
        newly = set(self.tree.mark_l3(keys, start))
        if newly and source is not None:
            self.events.l3_found(source, [(i, k) for i, k in enumerate(keys) if k in newly])

    def backed_up(self, keys: Iterable[PageKey]) -> None:
        """Every writing rank stored these pages in L3."""
        if self.l3_index:
            self.events.l3_added(self.tree.mark_l3_keys(keys))

    def drop(self, tops: Iterable[TreeNode], *, l2: bool, l3: bool) -> Dropped:
        """Take ``tops`` and everything below them out of L2 and/or L3 (a flush);
        locked pages stay in L2. Pages in neither tier leave the tree."""
        dropped = self.tree.drop_subtrees(tops, l2=l2, l3=l3)
        self.events.removed(dropped.freed_slots)
        if l3:
            self.events.l3_removed(dropped.keys)
        self.slots.free(dropped.freed_slots)
        return dropped

    def forget_l3(self) -> None:
        """Forget what the tree knows of L3 (another store was attached, or none):
        L3-only pages leave the tree, L2 pages are no longer marked in L3."""
        if self.l3_index:
            self.drop(list(self.tree.root.children.values()), l2=False, l3=True)

    def report_bad_slots(self, slots: Iterable[int]) -> None:
        self._bad_slots.update(slots)

    def drop_bad_slots(self) -> bool:
        """Forget pages whose slots a worker could not use, so they are not hit again;
        True when any were reported (requests must match L2 again)."""
        if not self._bad_slots:
            return False
        bad = self._bad_slots
        freed, self._bad_slots = self.tree.remove_slots(bad)  # locked ones: next step
        self.events.removed(freed)
        self.slots.free(freed)
        self._stats.bad_slots_reported += len(bad - self._bad_slots)
        return True

    def release_planned_stores(self) -> None:
        """The plan carrying the stores planned so far is built: their pages may be
        evicted from the next plan on (the workers copy them in plan order)."""
        for node in self._unsent:
            self.tree.unlock(node)
        self._unsent = []

    def reset(self) -> bool:
        """Drop every page; False (nothing dropped) while any page is locked."""
        try:
            freed = self.tree.reset()
        except RuntimeError:
            return False
        self.events.removed(freed)
        self.slots.free(freed)
        return True
