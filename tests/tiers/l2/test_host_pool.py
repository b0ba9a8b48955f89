"""Host pool sizing stays within budget; slots refuse pages they do not hold."""

import pytest

from hicache.tiers.l2.host_pool import GB, HostPagePool, PoolGeometry


def test_budget_by_size_and_ratio():
    by_size = PoolGeometry.for_budget(
        num_layers=4, blocks_per_page=2, block_bytes=1000, l1_num_blocks=10,
        hicache_size_gb=0.0001, hicache_ratio=2.0,
    )
    assert by_size.page_bytes == 8000
    assert by_size.num_slots == int(0.0001 * GB) // 8000
    assert by_size.buffer_bytes <= 0.0001 * GB
    by_ratio = PoolGeometry.for_budget(
        num_layers=4, blocks_per_page=2, block_bytes=1000, l1_num_blocks=10,
        hicache_size_gb=0, hicache_ratio=2.0,
    )
    # 2 x L1 = 20 blocks of 4 layers = 10 pages of 2 blocks
    assert by_ratio.num_slots == 10


def test_budget_smaller_than_a_page_is_an_error():
    with pytest.raises(ValueError, match="smaller than one page"):
        PoolGeometry.for_budget(
            num_layers=4, blocks_per_page=2, block_bytes=10**6, l1_num_blocks=10,
            hicache_size_gb=0.001, hicache_ratio=2.0,
        )


def test_pool_allocates_exactly_the_budget_and_checks_keys():
    geo = PoolGeometry(num_slots=5, num_layers=3, blocks_per_page=2, block_bytes=64)
    pool = HostPagePool(geo, pin_memory=False)
    assert pool.nbytes == geo.buffer_bytes == 5 * 3 * 2 * 64
    assert not pool.holds(0, b"k")
    pool.set_key(0, b"k")
    assert pool.holds(0, b"k") and not pool.holds(0, b"j")
    pool.invalidate_all()
    assert not pool.holds(0, b"k")


def test_a_slot_keeps_its_checksum_until_it_gets_new_bytes():
    pool = HostPagePool(PoolGeometry(num_slots=3, num_layers=2, blocks_per_page=2,
                                     block_bytes=16), layout="page_first", pin_memory=False)
    assert pool.checksums_of([0, 1, 2]) == [None, None, None]
    pool.set_key(0, b"a")
    pool.set_key(1, b"b")
    pool.set_checksums([0, 1], [11, 22])
    assert pool.checksums_of([1, 0, 2]) == [22, 11, None]
    pool.set_key(1, None)  # a store or fetch is about to overwrite it
    assert pool.checksums_of([0, 1]) == [11, None]
    pool.invalidate_all()
    assert pool.checksums_of([0]) == [None]
