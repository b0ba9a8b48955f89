"""NixlBackend with real NIXL agents and the POSIX plugin on a temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl._api")

from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry  # noqa: E402
from hicache.tiers.l3 import integrity  # noqa: E402
from hicache.tiers.l3.base import (  # noqa: E402
    ReadBatch,
    StorageConfig,
    StorageConfigError,
    WriteBatch,
)
from hicache.tiers.l3.guard import guarded
from hicache.tiers.l3.nixl.backend import NixlBackend  # noqa: E402
from hicache.tiers.l3.page_dir import FILE_HEADER_BYTES, QUARANTINE_DIR  # noqa: E402

GEOMETRY = PoolGeometry(num_slots=16, num_layers=3, blocks_per_page=2, block_bytes=1024)
LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def make(path: Path, layout: str = "page_first_direct", tp_rank: int = 0, **extra):
    cfg = StorageConfig(tp_rank=tp_rank, tp_size=2, namespace="test-ns", mem_layout=layout,
                        page_bytes=GEOMETRY.page_bytes, extra_config={"path": str(path), **extra})
    backend = guarded(NixlBackend(cfg))
    pool = HostPagePool(GEOMETRY, layout=layout, pin_memory=False)
    backend.register_host_pool(pool)
    return backend, pool


def fill(pool: HostPagePool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8, generator=gen))


def keys_for(n: int, salt: int = 0) -> list[str]:
    return [(bytes([salt, i]) * 16).hex() for i in range(n)]


@pytest.fixture
def store(tmp_path: Path):
    backend, pool = make(tmp_path)
    yield backend, pool, tmp_path
    backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_bit_exact(tmp_path, layout):
    backend, pool = make(tmp_path, layout)
    fill(pool, 1)
    keys = keys_for(6)
    expect = [pool.read_page(s).clone() for s in range(6)]
    assert backend.write(WriteBatch(keys, list(range(6)))) == [True] * 6
    # one file per page in the shared page directory, the file backend's record (the
    # header padded to 4 KiB, then the payload); no temp files
    names = sorted(p.relative_to(tmp_path / "pages").as_posix()
                   for p in (tmp_path / "pages").rglob("*") if p.is_file())
    assert names == sorted(f"{k[:2]}/{backend.object_key(k)}.page" for k in keys)
    assert not list((tmp_path / "tmp").iterdir())
    for k in keys:
        assert page_file(backend, k).stat().st_size == FILE_HEADER_BYTES + GEOMETRY.page_bytes

    pool.buffer.zero_()
    assert backend.exists_prefix(keys) == 6
    assert backend.exists_prefix([*keys[:3], keys_for(1, salt=9)[0], keys[3]]) == 3
    assert backend.read(ReadBatch(keys, list(range(10, 16)))) == [True] * 6
    for i, slot in enumerate(range(10, 16)):
        assert torch.equal(pool.read_page(slot), expect[i])

    # writing again skips the existing pages
    assert backend.write(WriteBatch(keys[:2], [0, 1])) == [True, True]
    st = backend.stats()
    assert st.set_skipped_existing == 2 and st.get_hits == 6 and st.corrupt_pages == 0
    assert st.bytes_written == st.bytes_read == 6 * GEOMETRY.page_bytes
    assert st.read_seconds > 0 and st.write_seconds > 0

    # a key never stored is a clean miss
    assert backend.read(ReadBatch(keys_for(1, salt=7), [0])) == [False]
    assert backend.stats().get_misses == 1
    backend.clear()
    assert backend.exists_prefix(keys) == 0
    backend.close()


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, {test_dir!r})
    from test_nixl_backend import fill, keys_for, make
    from hicache.tiers.l3.base import WriteBatch
    backend, pool = make(Path({path!r}), {layout!r})
    fill(pool, 42)
    ok = backend.write(WriteBatch(keys_for(5), list(range(5))))
    backend.close()
    sys.exit(0 if all(ok) else 3)
""")


def test_other_process_reads_what_one_wrote(tmp_path):
    # page_first_direct and layer_first share the L3 byte order (and fingerprint),
    # so the zero-copy writer and the staging reader must agree on every byte.
    script = _WRITER.format(test_dir=str(Path(__file__).parent), path=str(tmp_path),
                            layout="page_first_direct")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]

    ref, ref_pool = make(tmp_path / "unused")
    fill(ref_pool, 42)
    expect = [ref_pool.read_page(s).clone() for s in range(5)]
    ref.close()

    reader, pool = make(tmp_path, "layer_first")  # same L3 byte order, other host layout
    assert reader.exists_prefix(keys_for(5)) == 5
    assert reader.read(ReadBatch(keys_for(5), [11, 12, 13, 14, 15])) == [True] * 5
    for i in range(5):
        assert torch.equal(pool.read_page(11 + i), expect[i])
    reader.close()


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[FILE_HEADER_BYTES + 777] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)


def _replace_key(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[24:56] = bytes(range(32))  # magic, version, reserved, length precede the key
    path.write_bytes(bytes(data))


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\x00")


@pytest.mark.parametrize("damage", [_flip_payload, _truncate, _replace_key, _append])
def test_corrupt_page_is_a_counted_quarantined_miss(store, damage):
    backend, pool, root = store
    fill(pool, 5)
    keys = keys_for(3)
    assert backend.write(WriteBatch(keys, [0, 1, 2])) == [True] * 3
    victim = page_file(backend, keys[1])
    damage(victim)

    assert backend.exists_prefix(keys) == 3  # existence is only a hint
    assert backend.read(ReadBatch(keys, [5, 6, 7])) == [True, False, True]
    st = backend.stats()
    assert st.corrupt_pages == 1 and st.get_misses == 1 and st.get_hits == 2
    assert not victim.exists()
    assert [p.name.rpartition(".")[0] for p in (root / QUARANTINE_DIR).iterdir()] == [victim.name]
    assert backend.exists_prefix(keys) == 1
    assert backend.read(ReadBatch(keys[1:2], [4])) == [False]


def test_page_deleted_between_exists_and_get_is_clean_miss(store):
    backend, pool, root = store
    fill(pool, 6)
    key = keys_for(1)[0]
    assert backend.write(WriteBatch([key], [0])) == [True]
    assert (backend.exists_prefix([key]) == 1)
    page_file(backend, key).unlink()
    assert backend.read(ReadBatch([key], [3])) == [False]
    st = backend.stats()
    assert st.get_misses == 1 and st.corrupt_pages == 0 and st.errors == 0


def test_other_tp_rank_misses(tmp_path):
    rank0, pool0 = make(tmp_path, tp_rank=0)
    rank1, _ = make(tmp_path, tp_rank=1)
    fill(pool0, 8)
    keys = keys_for(2)
    assert rank0.write(WriteBatch(keys, [0, 1])) == [True, True]
    assert rank1.exists_prefix(keys) == 0
    assert rank1.read(ReadBatch(keys, [4, 5])) == [False, False]
    # even under rank 1's file name, rank 0's bytes fail the fingerprint check
    page_file(rank1, keys[0]).parent.mkdir(exist_ok=True)
    os.link(page_file(rank0, keys[0]), page_file(rank1, keys[0]))
    assert rank1.read(ReadBatch(keys[:1], [4])) == [False]
    assert rank1.stats().corrupt_pages == 1
    assert rank0.read(ReadBatch(keys, [6, 7])) == [True, True]
    rank0.close()
    rank1.close()


def test_transfer_timeout_is_a_miss(tmp_path):
    backend, pool = make(tmp_path, xfer_timeout_s=1e-9)
    fill(pool, 9)
    keys = keys_for(8)
    # a transfer not finished by its deadline stores nothing and leaves no temp file
    assert backend.write(WriteBatch(keys, list(range(8)))) == [False] * 8
    st = backend.stats()
    assert st.set_failures == 8 and st.errors >= 1 and st.bytes_written == 0
    assert backend.exists_prefix(keys) == 0
    # with a sane deadline the parked request is drained and I/O goes on
    backend.inner.timeout_s = 5.0
    assert backend.write(WriteBatch(keys, list(range(8)))) == [True] * 8
    assert backend.read(ReadBatch(keys, list(range(8, 16)))) == [True] * 8
    assert torch.equal(pool.buffer[8:16], pool.buffer[:8])
    assert not list((tmp_path / "tmp").iterdir())
    backend.close()


def page_file(backend, key: str) -> Path:
    return Path(backend.inner.dir.path(backend.inner.dir.name(key)))


@pytest.mark.parametrize("plugin", ["NO_SUCH_PLUGIN", "GDS"])
def test_unavailable_plugin_lists_available_ones(tmp_path, plugin):
    try:
        backend, _ = make(tmp_path, plugin=plugin)
    except StorageConfigError as exc:
        msg = str(exc)
        assert "plugin" in msg and plugin in msg and "'POSIX'" in msg
        return
    backend.close()
    pytest.skip(f"{plugin} loads on this host")


@pytest.mark.parametrize("extra", [{"bogus_key": 1}, {"plugin_params": {"no_such_param": "1"}},
                                   {"xfer_timeout_s": -1}, {"plugin_params": "x"},
                                   {"xfer_timeout_s": "soon"}, {"max_batch_pages": 0},
                                   {"max_batch_pages": 2.5}, {"plugin": ""}])
def test_bad_extra_config(tmp_path, extra):
    with pytest.raises(StorageConfigError) as info:
        make(tmp_path, **extra)
    key = next(iter(extra))
    assert key in str(info.value)
    if key == "bogus_key":
        assert "plugin_params" in str(info.value) and "path" in str(info.value)
    rule = {"xfer_timeout_s": "a number > 0", "max_batch_pages": "a positive integer"}
    if key in rule:
        assert f"hicache_storage_backend_extra_config.{key} must be {rule[key]}" in str(info.value)


def test_plugin_params_pass_through(tmp_path):
    backend, pool = make(tmp_path, plugin_params={"use_posix_aio": "false"})
    fill(pool, 11)
    assert backend.write(WriteBatch(keys_for(2), [0, 1])) == [True, True]
    assert backend.read(ReadBatch(keys_for(2), [2, 3])) == [True, True]
    assert torch.equal(pool.read_page(2), pool.read_page(0))
    backend.close()


def test_delete_removes_one_page(store):
    backend, pool, _ = store
    ks = keys_for(3, salt=77)
    assert backend.write(WriteBatch(ks, [0, 1, 2])) == [True] * 3
    assert backend.delete([ks[1], ks[1]]) == 1
    assert [(backend.exists_prefix([k]) == 1) for k in ks] == [True, False, True]


def test_lookups_run_on_probe_threads_beside_transfers(store):
    """``concurrent_lookups``: lookups stat() the files, never the agent, so the
    scheduler's probe threads may ask while the I/O thread reads through NIXL."""
    from concurrent.futures import ThreadPoolExecutor

    backend, pool, _ = store
    assert backend.capabilities.concurrent_lookups
    fill(pool, 4)
    keys = keys_for(6)
    assert backend.write(WriteBatch(keys[:4], [0, 1, 2, 3])) == [True] * 4
    with ThreadPoolExecutor(8) as probes:
        found = [probes.submit(backend.exists_prefix, keys) for _ in range(32)]
        assert backend.read(ReadBatch(keys[:4], [4, 5, 6, 7])) == [True] * 4
        assert {f.result() for f in found} == {4}
    assert all(torch.equal(pool.read_page(4 + i), pool.read_page(i)) for i in range(4))


def test_writes_take_the_pools_checksums_and_reads_still_check_them(store):
    """A write takes the checksum the store path left with the slot instead of hashing
    the page; even a wrong one cannot load wrong KV: the read checks the bytes."""
    backend, pool, _ = store
    fill(pool, 9)
    keys = keys_for(2, salt=9)
    pool.set_key(0, b"a")
    pool.set_key(1, b"b")
    pool.set_checksums([0, 1], [integrity.checksum(pool.read_page(0)),
                                integrity.checksum(pool.read_page(1)) ^ 1])  # slot 1: wrong
    assert backend.write(WriteBatch(keys, [0, 1])) == [True, True]
    assert backend.read(ReadBatch(keys, [5, 6])) == [True, False]
    assert torch.equal(pool.read_page(0), pool.read_page(5))
    assert backend.stats().corrupt_pages == 1


@pytest.mark.parametrize("writer_is_nixl", [True, False])
def test_file_and_nixl_backends_share_one_page_format(tmp_path, writer_is_nixl):
    """One directory, one fingerprint: what either backend writes the other reads,
    verified, and finds stored already."""
    from hicache.tiers.l3.file.backend import FileBackend

    cfg = StorageConfig(tp_rank=0, tp_size=2, namespace="test-ns",
                        mem_layout="page_first_direct", page_bytes=GEOMETRY.page_bytes,
                        extra_config={"path": str(tmp_path)})
    nixl, nixl_pool = make(tmp_path)
    files = guarded(FileBackend(cfg))
    files_pool = HostPagePool(GEOMETRY, layout="page_first_direct", pin_memory=False)
    files.register_host_pool(files_pool)
    writer, writer_pool = (nixl, nixl_pool) if writer_is_nixl else (files, files_pool)
    reader, reader_pool = (files, files_pool) if writer_is_nixl else (nixl, nixl_pool)
    fill(writer_pool, 5)
    keys = keys_for(4, salt=11)
    assert writer.write(WriteBatch(keys, [0, 1, 2, 3])) == [True] * 4
    assert reader.exists_prefix(keys) == 4
    assert reader.read(ReadBatch(keys, [8, 9, 10, 11])) == [True] * 4
    for i in range(4):
        assert torch.equal(reader_pool.read_page(8 + i), writer_pool.read_page(i))
    assert reader.write(WriteBatch(keys, [8, 9, 10, 11])) == [True] * 4
    assert reader.stats().set_skipped_existing == 4 and reader.stats().corrupt_pages == 0
    nixl.close()
