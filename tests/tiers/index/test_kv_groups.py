"""KV-cache groups: a page's blocks over groups, residency masks, where a hit may end."""

from __future__ import annotations

import pytest

from hicache.tiers.index.kv_groups import KVGroup, KVGroups

PAGE = 32
# Gemma-3's shape: windowed layers and one full-attention layer (window 64 tokens).
SWA = KVGroups((KVGroup("window", 64), KVGroup("window", 64), KVGroup("full")))


def test_single_group_is_the_old_layout():
    one = KVGroups.single(4)
    assert not one.hybrid and not one.windowed and one.num_layers == 4
    assert one.page_blocks([[5, 6, 7, 8]], 1, 2) == (7, 8)
    assert one.usable_pages([0, 0, 0], 0, PAGE) == 3


def test_page_blocks_concatenate_groups_in_order_and_split_back():
    ids = [[1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23, 24]]
    blocks = SWA.page_blocks(ids, 1, 2)
    assert blocks == (3, 4, 13, 14, 23, 24)
    assert SWA.split(blocks) == [(3, 4), (13, 14), (23, 24)]
    # A tail of the page only (vLLM's own cache holds its head).
    assert SWA.page_blocks(ids, 1, 2, lo=1) == (4, 14, 24)
    # A group that lacks the page's blocks: no page.
    assert SWA.page_blocks([[1, 2, 3, 4], [11, 12], [21, 22, 23, 24]], 1, 2) == ()


def test_missing_mask_marks_windowed_groups_and_refuses_full_ones():
    assert SWA.missing_mask((3, 4, 13, 14, 23, 24)) == 0
    assert SWA.missing_mask((0, 0, 13, 14, 23, 24)) == 0b001
    assert SWA.missing_mask((0, 4, 0, 14, 23, 24)) == 0b011
    assert SWA.missing_mask((3, 4, 13, 14, 0, 24)) is None  # full attention lost a block


def test_usable_pages_end_where_the_window_has_every_group():
    missing = 0b011  # both windowed groups
    # Pages 0-3 lack the window; 4-5 are complete (a history stored by write_back).
    masks = [missing] * 4 + [0, 0]
    # Ending after page 6 (192 tokens) needs tokens 129..191: pages 4 and 5. Fine.
    assert SWA.usable_pages(masks, 0, PAGE) == 6
    # A branch that shares only the first 4 pages cannot end there.
    assert SWA.usable_pages(masks[:4], 0, PAGE) == 0
    # Ending after page 5 needs tokens 97..159: pages 3 and 4; page 3 lacks them.
    assert SWA.usable_pages(masks[:5], 0, PAGE) == 0
    # One group missing is enough to refuse; the hit ends before the window reaches it.
    assert SWA.usable_pages([0, 0, 0b010, 0], 0, PAGE) == 2
    assert SWA.usable_pages([0, 0, 0, 0b010], 0, PAGE) == 3
    # Pages far behind the window may lack it.
    assert SWA.usable_pages([0b011, 0b011, 0, 0], 0, PAGE) == 4


def test_usable_pages_ignore_what_vllms_own_cache_holds():
    masks = [0b001, 0b001, 0b001, 0]
    # vLLM's own prefix cache holds the first 96 tokens: only page 3 is loaded,
    # and the window's blocks before it are vLLM's (real blocks) or not needed.
    assert SWA.usable_pages(masks, 96, PAGE) == 4
    assert SWA.usable_pages(masks, 64, PAGE) == 0  # page 2 would be loaded: refused


@pytest.mark.parametrize("window", [1, 32, 33, 95, 96, 97])
def test_the_needed_pages_follow_vllms_skip_rule(window):
    groups = KVGroups((KVGroup("window", window), KVGroup("full")))
    for missing_page in range(4):
        masks = [0] * 4
        masks[missing_page] = 1
        end = 4 * PAGE
        # vLLM keeps real blocks for tokens >= end - window + 1 (SlidingWindowManager).
        needed = missing_page * PAGE + PAGE - 1 >= end - window + 1
        assert (groups.usable_pages(masks, 0, PAGE) == 4) == (not needed), (window, missing_page)


# Nemotron-H's shape: two Mamba state groups and one full-attention group.
MAMBA = KVGroups((KVGroup("state"), KVGroup("full"), KVGroup("state")))


def test_a_state_block_goes_to_the_page_it_checkpoints_only():
    ids = [[9], [1, 2, 3, 4], [8]]  # one state block per request and state group
    at_1 = MAMBA.state_blocks(ids, 2 * PAGE, PAGE, 2)
    assert at_1 == {1: {0: 9, 2: 8}}
    # The checkpoint sits at the page's last block offset, the others are null.
    assert MAMBA.page_blocks(ids, 1, 2, checkpoints=at_1) == (0, 9, 3, 4, 0, 8)
    assert MAMBA.page_blocks(ids, 0, 2, checkpoints=at_1) == (0, 0, 1, 2, 0, 0)
    assert MAMBA.page_blocks(ids, 1, 2) == (0, 0, 3, 4, 0, 0)
    assert MAMBA.state_blocks(ids, 2 * PAGE - 1, PAGE, 2) == {}  # no page end
    assert MAMBA.missing_mask((0, 9, 3, 4, 0, 8)) == 0
    assert MAMBA.missing_mask((0, 0, 1, 2, 0, 0)) == 0b101
    assert MAMBA.missing_mask((0, 9, 1, 2, 0, 0)) == 0b100


# vLLM's "align" Mamba cache mode: a state block per block position.
ALIGNED = KVGroups((KVGroup("state", aligned=True), KVGroup("full")))


def test_an_aligned_load_fills_the_state_block_at_the_hits_last_position():
    # vLLM's table for a 2-page hit (2 blocks a page): nulls but the last column,
    # where its model runner reads a new request's initial state from.
    ids = [[0, 0, 0, 7], [1, 2, 3, 4]]
    at_1 = ALIGNED.state_blocks(ids, 2 * PAGE, PAGE, 2)
    assert at_1 == {1: {0: 7}}
    assert ALIGNED.page_blocks(ids, 1, 2, checkpoints=at_1) == (0, 7, 3, 4)
    # A load that starts mid-page (vLLM's own cache holds the head) still gets it.
    assert ALIGNED.page_blocks(ids, 1, 2, 1, 2, checkpoints=at_1) == (7, 4)
    assert ALIGNED.state_blocks(ids, PAGE, PAGE, 2) == {}  # a null column: no checkpoint
    assert ALIGNED.state_blocks([[0], [1, 2]], 2 * PAGE, PAGE, 2) == {}  # a short table
    assert ALIGNED.aligned and not MAMBA.aligned


def test_handed_off_states_checkpoint_the_pages_they_end():
    handoff = [(0, 6, 8), (0, 9, 24), (0, 5, 12), (1, 3, 16), (0, 0, 16), (0, 4, 0)]
    # 12 is no page end, group 1 is no state group, block 0 is vLLM's null block.
    assert ALIGNED.handed_off(handoff, 8) == {0: {0: 6}, 2: {0: 9}}
    assert MAMBA.handed_off([(0, 6, 8), (2, 5, 8)], 8) == {0: {0: 6, 2: 5}}


def test_a_hit_ends_on_a_checkpoint():
    without = 0b101
    assert MAMBA.usable_pages([without, without, 0, without], 0, PAGE) == 3
    assert MAMBA.usable_pages([without, 0b001, without], 0, PAGE) == 0  # one state lacks
    assert MAMBA.usable_pages([0, without], 0, PAGE) == 1
