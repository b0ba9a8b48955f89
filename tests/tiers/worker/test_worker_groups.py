"""Worker half with several KV-cache groups (vLLM's hybrid manager), no engine.

Like vLLM's hybrid allocator, a sliding-window layer and a full-attention
layer share one KV tensor and take disjoint blocks of it: each is its own
pool row, copied with its own group's blocks. Hits arrive as fetches without
L3 pages and are served at once; a failed one is reported per request
(``take_failed_recving``), never as block ids, which vLLM cannot map to
requests with several groups. A page stored without a window's blocks is
never backed up to L3. A prefetch at arrival stops in L2 and reaches only
the scheduler. Real host pool, real file backend.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hicache.connector.metadata import HiCacheStepMetadata
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.plans import PagePlan, RequestFetch, prefetch_id
from hicache.tiers.l2.host_pool import PoolGeometry
from hicache.tiers.l3.base import StorageConfig
from hicache.tiers.l3.file.backend import FileBackend
from hicache.tiers.l3.guard import guarded
from hicache.tiers.worker.core import HiCacheWorker

GEOM = PoolGeometry(num_slots=4, num_layers=2, blocks_per_page=2, block_bytes=64)
NS = KeyNamespace("tiny", "float32", "cpu", 8, 1)
KEY_A, KEY_B = page_keys(NS.seed(), list(range(16)), 8)
L1_BLOCKS = 10
GROUPS = [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]


def make_worker(tmp_path: Path | None = None) -> HiCacheWorker:
    def build(name: str, extra: dict) -> FileBackend:
        return guarded(FileBackend(StorageConfig(0, 1, NS.fingerprint(), "page_first", GEOM.page_bytes,
                                         extra_config=extra)))

    w = HiCacheWorker(GEOM, L1_BLOCKS, layout="page_first", storage_builder=build,
                      storage_spec=("file", {"path": str(tmp_path)}) if tmp_path else None,
                      group_layer_names=GROUPS)
    kv = torch.arange(L1_BLOCKS * 16, dtype=torch.float32).view(L1_BLOCKS, 16)  # 64 B blocks
    # One tensor, two layers of different groups (vLLM's hybrid allocator).
    w.register_kv_caches({GROUPS[0][0]: kv, GROUPS[1][0]: kv})
    w.kv = kv  # type: ignore[attr-defined]
    return w


def test_each_group_is_copied_with_its_own_blocks():
    w = make_worker()
    assert w.per_request_failures and len(w.layers) == 2
    # Page: window group blocks 1, 2; full-attention group blocks 3, 4.
    w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (1, 2, 3, 4))]))
    before = w.kv.clone()
    null_before = w.kv[0].clone()
    w.kv[5:9] = -1
    # The window no longer reaches the page's first block: vLLM names block 0 there.
    fetch = RequestFetch("r", (PagePlan(0, KEY_A, 0, (0, 5, 6, 7)),), ())
    w.start_load(HiCacheStepMetadata(fetches=[fetch]))
    w.finish_step(HiCacheStepMetadata())
    assert torch.equal(w.kv[0], null_before)  # never written
    assert torch.equal(w.kv[5], before[2])  # window group's second block
    assert torch.equal(w.kv[6:8], before[3:5])  # full-attention group's blocks
    assert torch.equal(w.kv[8], torch.full_like(w.kv[8], -1))  # untouched
    assert w.take_received() == {"r"}
    assert w.take_failed_recving() == set() and w.take_load_errors() == set()
    report = w.take_report()
    assert report is not None and report.fetched == {"r": [0]}


def test_a_mamba_checkpoint_moves_from_its_page_end_to_the_block_vllm_reads():
    """vLLM's "align" Mamba mode: the scheduler plans a state group's checkpoint at the
    page's last offset (tiers/index/kv_groups.py); here the first layer is the state
    group. A hit that starts mid-page (vLLM's own cache holds the head) still gets it."""
    w = make_worker()
    # State group: its checkpoint (block 3, handed off by vLLM) at offset 1; attention 1, 2.
    w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (0, 3, 1, 2))]))
    before = w.kv.clone()
    w.kv[5:9] = -1
    fetch = RequestFetch("r", (PagePlan(0, KEY_A, 1, (7, 6)),), ())
    w.start_load(HiCacheStepMetadata(fetches=[fetch]))
    w.finish_step(HiCacheStepMetadata())
    assert torch.equal(w.kv[7], before[3])  # the state, where the request reads it
    assert torch.equal(w.kv[6], before[2])  # the attention block of the page's tail
    assert torch.equal(w.kv[5], torch.full_like(w.kv[5], -1))
    assert w.take_received() == {"r"} and w.take_failed_recving() == set()


def test_a_failed_hit_is_reported_per_request():
    w = make_worker()
    # Slot 1 never received KEY_B: the key check fails.
    fetch = RequestFetch("s", (PagePlan(1, KEY_B, 0, (5, 6, 7, 8)),), ())
    w.start_load(HiCacheStepMetadata(fetches=[fetch]))
    w.finish_step(HiCacheStepMetadata())
    assert w.take_received() == {"s"}
    assert w.take_failed_recving() == {"s"}
    assert w.take_load_errors() == set()  # never block ids with several groups
    report = w.take_report()
    assert report is not None and report.bad_slots == {1}


def test_granted_tokens_no_page_covers_fail_the_request():
    w = make_worker()
    w.start_load(HiCacheStepMetadata(fetches=[RequestFetch("t", (), (), (5, 6))]))
    w.finish_step(HiCacheStepMetadata())
    assert w.take_received() == {"t"} and w.take_failed_recving() == {"t"}


def test_a_page_without_its_window_stays_out_of_l3(tmp_path):
    w = make_worker(tmp_path)
    try:
        w.finish_step(HiCacheStepMetadata(stores=[
            PagePlan(0, KEY_A, 0, (1, 2, 3, 4)),  # complete
            PagePlan(1, KEY_B, 0, (0, 2, 5, 6)),  # the window lost its first block
        ]))
        deadline = time.monotonic() + 60  # a bound for a loaded machine, not a speed check
        while w.storage_io.stats.backup_pages < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        w.storage_io.shutdown()  # drains the queue: nothing else was submitted
        assert w.storage_io.stats.backup_pages == 1
        assert w.storage.exists_prefix([KEY_A.hex()]) == 1
        assert w.storage.exists_prefix([KEY_B.hex()]) == 0
    finally:
        w.shutdown()


def test_a_mamba_layers_padded_state_pages_are_copied_whole():
    from hicache.tiers.worker.kv_layers import block_view as _block_view

    # vLLM's CPU layout: int8 state bytes (20 of them) in 64-byte pages.
    buffer = torch.arange(L1_BLOCKS * 64, dtype=torch.int32).to(torch.int8)
    state = buffer.as_strided((L1_BLOCKS, 1, 1, 20), (64, 20, 20, 1))
    view = _block_view(state, L1_BLOCKS, 64)
    assert view.shape == (L1_BLOCKS, 64)
    assert torch.equal(view[3], buffer[192:256].view(torch.uint8))
    # Upstream's layout: conv and ssm state tensors viewing one buffer's pages.
    raw = torch.zeros(L1_BLOCKS * 16, dtype=torch.float32)
    conv = raw.as_strided((L1_BLOCKS, 4), (16, 1), 0)
    ssm = raw.as_strided((L1_BLOCKS, 8), (16, 1), 4)
    both = _block_view([conv, ssm], L1_BLOCKS, 64)
    ssm[2].fill_(1.0)
    assert torch.equal(both[2].view(torch.float32)[4:12], torch.ones(8))


def test_a_prefetch_fills_l2_and_is_never_reported_to_vllm(tmp_path):
    w = make_worker(tmp_path)
    try:
        w.finish_step(HiCacheStepMetadata(stores=[PagePlan(0, KEY_A, 0, (1, 2, 3, 4))]))
        deadline = time.monotonic() + 60  # a bound for a loaded machine, not a speed check
        while w.storage_io.stats.backup_pages < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        fetch = RequestFetch(prefetch_id("r"), (), (PagePlan(2, KEY_A, 0, ()),), (), None,
                             prefetch=True)
        w.start_load(HiCacheStepMetadata(fetches=[fetch]))
        fetched: dict[str, list[int]] = {}
        while not fetched and time.monotonic() < deadline:
            assert w.take_received(wait_s=0.01) == set()  # vLLM never hears of it
            report = w.take_report()
            fetched = dict(report.fetched) if report is not None else {}
        assert fetched == {prefetch_id("r"): [1]}
        assert w.pool.holds(2, KEY_A) and torch.equal(w.pool.buffer[2], w.pool.buffer[0])
        assert w.take_failed_recving() == set() and w.take_load_errors() == set()
    finally:
        w.shutdown()


def test_a_prefetch_without_l3_ends_at_once_with_nothing():
    w = make_worker()
    fetch = RequestFetch(prefetch_id("r"), (), (PagePlan(2, KEY_A, 0, ()),), (), None,
                         prefetch=True)
    w.start_load(HiCacheStepMetadata(fetches=[fetch]))
    assert w.take_received() == set()
    report = w.take_report()
    assert report is not None and report.fetched == {prefetch_id("r"): [0]}
