"""GIL-free batch page I/O (tiers/l3/native_io.py): the xxhash package's checksums,
files read into and written from a flat buffer with every check done per page and
every failure reported per page, and the GIL released for the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import xxhash

from hicache.tiers.l3 import native_io

pytestmark = pytest.mark.skipif(not native_io.available(),
                                reason="numba, libc's functions or xxHash's C API missing")

HEAD, PREFIX, PAD_FROM, LENGTH = 64, 8, 16, 4096  # header: prefix, checksum, padding


def test_checksums_are_xxh3_64_of_each_slice():
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 70_000, dtype=np.uint8)
    for length in (0, 1, 17, 240, 241, 4096, 65_536):
        offsets = np.array([0, 3, 999])
        got = native_io.checksums(buf, offsets, length)
        assert [int(x) for x in got] == [
            xxhash.xxh3_64_intdigest(buf[o:o + length].tobytes()) for o in offsets], length


@pytest.mark.parametrize("helper", [False, True], ids=["inline", "helper"])
def test_copied_records_arrive_whole_with_the_checksum_of_what_was_copied(helper):
    rng = np.random.default_rng(1)
    # three records (header then payload) back to back, payloads longer than a chunk
    length = native_io.READ_CHUNK + 12_345
    record = HEAD + length
    src = rng.integers(0, 256, 3 * record, dtype=np.uint8)
    headers = np.zeros((2, HEAD), np.uint8)
    dest = np.zeros(2 * length, np.uint8)
    base = src.ctypes.data
    # records 2 and 0, in that order
    with ThreadPoolExecutor(1) as pool:
        got = native_io.copy_records(
            [base + 2 * record, base], [headers[0].ctypes.data, headers[1].ctypes.data],
            [dest.ctypes.data, dest.ctypes.data + length], HEAD, length,
            pool if helper else None)
    for row, r in enumerate((2, 0)):
        at = r * record
        assert np.array_equal(headers[row], src[at:at + HEAD])
        payload = src[at + HEAD:at + record]
        assert np.array_equal(dest[row * length:(row + 1) * length], payload)
        assert int(got[row]) == xxhash.xxh3_64_intdigest(payload.tobytes())
    assert len(native_io.copy_records([], [], [], HEAD, length)) == 0


def _headers(n: int) -> np.ndarray:
    """Header rows: a per-page prefix, the checksum field (zero), zero padding."""
    rows = np.zeros((n, HEAD), np.uint8)
    rows[:, :PREFIX] = np.arange(1, n + 1, dtype=np.uint8)[:, None]
    return rows


def _write(tmp_path, n, rng, **kw):
    src = rng.integers(0, 256, n * LENGTH, dtype=np.uint8)
    headers = _headers(n)
    paths = native_io.path_rows([str(tmp_path / f"p{i}") for i in range(n)])
    tmp = native_io.path_rows([str(tmp_path / f"p{i}.tmp") for i in range(n)])
    status = native_io.write_pages(tmp, paths, src, np.arange(n) * LENGTH, LENGTH, headers,
                                   PREFIX, **kw)
    return src, headers, paths, tmp, status


def test_written_files_hold_the_header_with_its_checksum_then_the_payload(tmp_path):
    src, headers, paths, tmp, status = _write(tmp_path, 3, np.random.default_rng(1))
    assert status.tolist() == [native_io.OK] * 3
    for i in range(3):
        raw = (tmp_path / f"p{i}").read_bytes()
        payload = src[i * LENGTH:(i + 1) * LENGTH].tobytes()
        assert raw[HEAD:] == payload and raw[:PREFIX] == bytes([i + 1]) * PREFIX
        assert int.from_bytes(raw[PREFIX:PREFIX + 8], "little") == \
            xxhash.xxh3_64_intdigest(payload)
        assert bytes(headers[i]) == raw[:HEAD]  # the row now holds the checksum too
    assert not list(tmp_path.glob("*.tmp"))
    # Written again with skip_existing: nothing is touched.
    (tmp_path / "p1").unlink()
    again = native_io.write_pages(tmp, paths, src, np.arange(3) * LENGTH, LENGTH,
                                  _headers(3), PREFIX, skip_existing=True)
    assert again.tolist() == [native_io.SKIPPED, native_io.OK, native_io.SKIPPED]


@pytest.mark.parametrize("call_records", [1, 3, 64])
def test_a_file_of_many_records_is_written_whole_in_bounded_calls(tmp_path, monkeypatch,
                                                                   call_records):
    """A file's records split into several pwritev calls (WRITE_CALL_BYTES, a gap
    between records) land each at its offset with its checksum. (That the bound splits
    the calls was checked with strace by hand: 7 records, 2 per call, 4 pwritev.)"""
    monkeypatch.setattr(native_io, "WRITE_CALL_BYTES", call_records * (HEAD + LENGTH))
    n = 7
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, n * LENGTH, dtype=np.uint8)
    headers = _headers(n)
    # Records 0-3 back to back, then a gap of 100 bytes before records 4-6.
    bases = [r * (HEAD + LENGTH) + (100 if r >= 4 else 0) for r in range(n)]
    path = str(tmp_path / "span")
    paths = native_io.path_rows([path] * n)
    tmp = native_io.path_rows([path + ".tmp"] * n)
    last = [0] * (n - 1) + [1]
    status = native_io.write_pages(tmp, paths, src, np.arange(n) * LENGTH, LENGTH, headers,
                                   PREFIX, bases=bases, last=last)
    assert status.tolist() == [native_io.OK] * n
    raw = (tmp_path / "span").read_bytes()
    assert len(raw) == bases[-1] + HEAD + LENGTH
    for r, at in enumerate(bases):
        payload = src[r * LENGTH:(r + 1) * LENGTH].tobytes()
        assert raw[at:at + PREFIX] == bytes([r + 1]) * PREFIX
        assert int.from_bytes(raw[at + PREFIX:at + PREFIX + 8], "little") == \
            xxhash.xxh3_64_intdigest(payload)
        assert raw[at + HEAD:at + HEAD + LENGTH] == payload
    assert not list(tmp_path.glob("*.tmp"))


def _read_calls() -> int:
    """Read system calls of this thread so far (Linux: /proc/thread-self/io)."""
    with open("/proc/thread-self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


def test_a_record_is_read_in_two_calls_header_and_payload_together(tmp_path):
    """The header and the payload's first chunk come in one preadv (with O_DIRECT one
    I/O, not two), then one read past the file's end: two read calls per one-chunk
    record, counted by the kernel."""
    if not os.path.exists("/proc/thread-self/io"):
        pytest.skip("no per-thread I/O accounting here")
    n = 16
    src, headers, paths, _, status = _write(tmp_path, n, np.random.default_rng(8))
    assert status.tolist() == [native_io.OK] * n
    dest = np.zeros(n * LENGTH, np.uint8)
    got = np.zeros((n, HEAD), np.uint8)
    native_io.read_pages(paths[:1], dest, [0], HEAD, LENGTH, got[:1],
                         headers[:1, :PREFIX].copy(), PAD_FROM)  # compiled, warm
    idle = -_read_calls() + _read_calls()  # what asking costs
    before = _read_calls()
    status, _ = native_io.read_pages(paths, dest, np.arange(n) * LENGTH, HEAD, LENGTH, got,
                                     headers[:, :PREFIX].copy(), PAD_FROM)
    calls = _read_calls() - before - idle
    assert status.tolist() == [native_io.OK] * n and np.array_equal(dest, src)
    assert calls == 2 * n, calls


def test_a_write_into_a_missing_folder_fails_that_page_only_and_leaves_no_temp(tmp_path):
    src = np.random.default_rng(2).integers(0, 256, 2 * LENGTH, dtype=np.uint8)
    paths = native_io.path_rows([str(tmp_path / "p0"), str(tmp_path / "gone" / "p1")])
    tmp = native_io.path_rows([str(tmp_path / "t0"), str(tmp_path / "t1")])
    status = native_io.write_pages(tmp, paths, src, np.array([0, LENGTH]), LENGTH,
                                   _headers(2), PREFIX)
    assert status.tolist() == [native_io.OK, native_io.RENAME_FAILED]
    assert (tmp_path / "p0").exists() and not (tmp_path / "t1").exists()
    no_tmp_dir = native_io.path_rows([str(tmp_path / "nodir" / "t")])
    status = native_io.write_pages(no_tmp_dir, paths[:1], src, np.array([0]), LENGTH,
                                   _headers(1), PREFIX)
    assert status.tolist() == [native_io.OPEN_FAILED]


class _Recording(ThreadPoolExecutor):
    """A helper that keeps the futures of the jobs it was given."""

    def __init__(self) -> None:
        super().__init__(1)
        self.jobs: list[Future] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        job = super().submit(fn, *args, **kwargs)
        self.jobs.append(job)
        return job


@pytest.fixture(params=["inline", "helper", "late-helper"])
def helper(request):
    """Where reads are checksummed: on the reading thread; on a helper thread behind
    the reads (whichever side claims the job first hashes: both must give the same
    answer); on a helper whose only thread is busy until the read is over, so the
    reader claims the job and hashes itself."""
    if request.param == "inline":
        yield None
        return
    pool = _Recording()
    gate = threading.Event()
    if request.param == "late-helper":
        pool.submit(gate.wait)
    yield pool
    gate.set()
    pool.shutdown(wait=True)
    if request.param == "late-helper":  # it found the job claimed and did nothing
        assert [job.result() for job in pool.jobs[1:]] == [False] * (len(pool.jobs) - 1)


def test_reads_check_every_page_and_report_the_first_failed_check(tmp_path, helper):
    n = 8
    src, headers, paths, _, _ = _write(tmp_path, n, np.random.default_rng(3))
    (tmp_path / "p1").unlink()
    with open(tmp_path / "p2", "ab") as f:
        f.write(b"x")  # one byte too long
    os.truncate(tmp_path / "p3", HEAD + 10)  # short
    with open(tmp_path / "p4", "r+b") as f:  # a payload bit flipped
        f.seek(HEAD + 1000)
        byte = f.read(1)[0]
        f.seek(HEAD + 1000)
        f.write(bytes([byte ^ 0x10]))
    with open(tmp_path / "p5", "r+b") as f:  # another page's prefix
        f.write(bytes([99]) * PREFIX)
    with open(tmp_path / "p6", "r+b") as f:  # padding not zero
        f.seek(HEAD - 1)
        f.write(b"\x01")
    dest = np.zeros((n + 1) * LENGTH, np.uint8)
    got = np.zeros((n, HEAD), np.uint8)
    expect = np.ascontiguousarray(_headers(n)[:, :PREFIX])
    offsets = np.arange(n, 0, -1) * LENGTH
    status, sizes = native_io.read_pages(paths, dest, offsets, HEAD, LENGTH, got, expect,
                                         PAD_FROM, helper=helper)
    assert status.tolist() == [
        native_io.OK, native_io.MISSING, native_io.WRONG_SIZE, native_io.WRONG_SIZE,
        native_io.BAD_CHECKSUM, native_io.BAD_HEADER, native_io.BAD_PADDING, native_io.OK]
    assert sizes[2] == HEAD + LENGTH + 1 and sizes[3] == HEAD + 10
    for i in (0, 7):
        assert np.array_equal(dest[offsets[i]:offsets[i] + LENGTH],
                              src[i * LENGTH:(i + 1) * LENGTH])
        assert np.array_equal(got[i], headers[i])
    # The same bytes against another page's expected prefix: a header mismatch.
    status, _ = native_io.read_pages(paths[:1], dest, offsets[:1], HEAD, LENGTH, got[:1],
                                     np.ascontiguousarray(expect[1:2]), PAD_FROM,
                                     helper=helper)
    assert status.tolist() == [native_io.BAD_HEADER]


def test_the_helper_hashes_what_the_reader_publishes_as_it_does():
    """follow_hashes on its own thread, driven step by step from here as the reading
    thread would (progress[i]: bytes of page i read so far, -1: nothing more to hash):
    each page's digest is that of all its bytes, a page given up gets none, and the
    helper says it is done only after the last page."""
    follow = native_io._kernels()["follow_hashes"]
    rng = np.random.default_rng(7)
    dest = rng.integers(0, 256, 3 * LENGTH, dtype=np.uint8)
    offsets = np.arange(3, dtype=np.int64) * LENGTH
    progress = np.zeros(3, np.int64)
    digests = np.zeros(3, np.uint64)
    ctl = np.zeros(2, np.int64)
    with ThreadPoolExecutor(1) as pool:
        addresses = (offsets + dest.ctypes.data).astype(np.uint64)
        job = pool.submit(follow, addresses, LENGTH, progress, digests, ctl)
        progress[0] = LENGTH // 3  # a first chunk of page 0
        progress[0] = LENGTH
        progress[1] = -1  # page 1: unreadable, nothing to hash
        assert ctl[1] == 0 or not job.result(timeout=0)  # page 2 not read yet
        progress[2] = LENGTH
        assert job.result(timeout=60) is True
    assert ctl.tolist() == [1, 1]  # claimed by the helper, done
    assert int(digests[0]) == xxhash.xxh3_64_intdigest(dest[:LENGTH].tobytes())
    assert digests[1] == 0
    assert int(digests[2]) == xxhash.xxh3_64_intdigest(dest[2 * LENGTH:].tobytes())
    # A job the reader claimed first is left alone.
    assert follow(addresses, LENGTH, progress, digests, np.array([2, 0])) is False


GIL_CHILD = """
import os, sys, threading
import numpy as np
from hicache.tiers.l3 import native_io

native_io.warm_up()
fifo, head, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.mkfifo(fifo)
sys.setswitchinterval(1000)  # a thread gets the GIL only when its holder blocks
go = threading.Event()

def writer():
    go.wait()
    with open(fifo, "wb") as f:  # meets the batch's open() of the FIFO
        try:
            f.write(bytes(head + length))
        except BrokenPipeError:
            pass  # the batch may have closed it already

dest = np.zeros(length, np.uint8)
headers = np.zeros((1, head), np.uint8)
w = threading.Thread(target=writer)
w.start()  # returns once the writer waits on go, the GIL free
go.set()  # the writer may run now, but only once this thread lets go of the GIL
status, sizes = native_io.read_pages(native_io.path_rows([fifo]), dest, np.array([0]),
                                     head, length, headers, np.zeros((1, 8), np.uint8), 16)
w.join()
print("ran", status.tolist())
"""


def test_a_batch_runs_without_the_gil(tmp_path):
    """The batch blocks in open() on a FIFO until a writer opens it, and the writer is
    a Python thread of the same process that can only get the GIL when the batch's
    thread lets go of it (switch interval 1000 s). Held through the batch, both wait
    forever: the child runs under a timeout, so that is a failure here, not a hang.
    (Nothing depends on how fast the machine is.)"""
    proc = subprocess.run([sys.executable, "-c", GIL_CHILD, str(tmp_path / "fifo"),
                           str(HEAD), str(LENGTH)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # A pipe cannot be read at an offset: an unreadable file, reported, not raised.
    assert proc.stdout.split("\n")[-2] == f"ran [{native_io.UNREADABLE}]"


def test_no_page_is_started_after_the_deadline(tmp_path, helper):
    import time

    _, _, paths, _, _ = _write(tmp_path, 3, np.random.default_rng(4))
    expect = np.ascontiguousarray(_headers(3)[:, :PREFIX])
    dest = np.zeros(3 * LENGTH, np.uint8)
    got = np.zeros((3, HEAD), np.uint8)
    offsets = np.arange(3) * LENGTH
    past, future = time.monotonic() - 1, time.monotonic() + 3600
    status, _ = native_io.read_pages(paths, dest, offsets, HEAD, LENGTH, got, expect,
                                     PAD_FROM, past, helper)
    assert status.tolist() == [native_io.NOT_READ] * 3 and not dest.any()
    status, _ = native_io.read_pages(paths, dest, offsets, HEAD, LENGTH, got, expect,
                                     PAD_FROM, future, helper)
    assert status.tolist() == [native_io.OK] * 3


def _accepts_o_direct(path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | native_io.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


def test_empty_batches_are_empty_results_with_direct_io_too():
    """An empty batch moves nothing and checks nothing: its (0, width) header array has
    no aligned address, so a direct batch must not get as far as the alignment check."""
    rows = np.zeros((0, native_io.DIRECT_ALIGN), np.uint8)
    none = native_io.path_rows([])
    for direct in (False, True):
        status = native_io.write_pages(none, none, np.zeros(8, np.uint8), [],
                                       native_io.DIRECT_ALIGN, rows, PREFIX, direct=direct)
        assert status.tolist() == []
        status, sizes = native_io.read_pages(none, np.zeros(8, np.uint8), [],
                                             native_io.DIRECT_ALIGN, native_io.DIRECT_ALIGN,
                                             rows, rows[:, :PREFIX], PREFIX + 8,
                                             direct=direct)
        assert status.tolist() == [] and sizes.tolist() == []


def test_direct_batches_open_with_o_direct_and_refuse_unaligned_memory(tmp_path):
    if not native_io.O_DIRECT or not _accepts_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT")
    align, length = native_io.DIRECT_ALIGN, 2 * native_io.DIRECT_ALIGN
    raw = np.random.default_rng(5).integers(0, 256, 4 * length + align, dtype=np.uint8)
    src = raw[-raw.ctypes.data % align:][:4 * length]  # 4 KiB aligned
    headers = native_io.aligned(np.zeros((2, align), np.uint8))
    headers[:, :PREFIX] = [[1] * PREFIX, [2] * PREFIX]
    paths = native_io.path_rows([str(tmp_path / "p0"), str(tmp_path / "p1")])
    tmp = native_io.path_rows([str(tmp_path / "t0"), str(tmp_path / "t1")])
    status = native_io.write_pages(tmp, paths, src, [0, length], length, headers, PREFIX,
                                   direct=True)
    assert status.tolist() == [native_io.OK] * 2
    dest = native_io.aligned_rows(1, 2 * length)[0]
    got = native_io.aligned_rows(2, align)
    status, sizes = native_io.read_pages(paths, dest, [0, length], align, length, got,
                                         headers[:, :PREFIX].copy(), PREFIX + 8, direct=True)
    assert status.tolist() == [native_io.OK] * 2 and sizes.tolist() == [align + length] * 2
    assert np.array_equal(dest, src[:2 * length])
    # The flag reaches open(2): O_DIRECT refuses a payload one byte off alignment, which
    # buffered I/O takes; the wrapper refuses it before any I/O.
    kernel = native_io._kernels()["write_pages"]
    one = np.ones(1, np.uint8)
    for flags, want in ((native_io.O_DIRECT, native_io.WRITE_FAILED), (0, native_io.OK)):
        (tmp_path / "p0").unlink(missing_ok=True)
        out = kernel(tmp[:1], paths[:1], src, np.array([1], np.int64), length, headers[:1],
                     PREFIX, False, False, np.zeros(1, np.int64), one, flags,
                     native_io.WRITE_CALL_BYTES)
        assert out.tolist() == [want]
    with pytest.raises(ValueError, match="aligned"):
        native_io.write_pages(tmp[:1], paths[:1], src, [1], length, headers[:1], PREFIX,
                              direct=True)
    with pytest.raises(ValueError, match="aligned"):
        native_io.read_pages(paths[:1], dest, [0], align, length,
                             np.zeros(align + 1, np.uint8)[1:].reshape(1, align),
                             headers[:1, :PREFIX].copy(),
                             PREFIX + 8, direct=True)


WARM_CHILD = """
import sys, time
import torch
from hicache.tiers.index.page_keys import KeyNamespace, page_keys
from hicache.tiers.index.spans import SpanLayout
from hicache.tiers.l2.host_pool import HostPagePool, PoolGeometry
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.factory import create_backend

geom = PoolGeometry(num_slots=16, num_layers=1, blocks_per_page=1, block_bytes=4096)
pool = HostPagePool(geom, layout="page_first_direct", pin_memory=False)
pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, dtype=torch.uint8))
ns = KeyNamespace("warm", "uint8", "warm", 64, 1)
ids = page_keys(ns.seed(), list(range(64 * 8)), 64)
keys = [k.hex() for k in ids]
cfg = StorageConfig(0, 1, ns.fingerprint(), "page_first_direct", geom.page_bytes,
                    extra_config={"path": sys.argv[1]})
backend = create_backend("file", cfg)
backend.register_host_pool(pool)  # warms the kernels up
assert backend.capabilities.spans, "the batch path does not run here"
print({name: len(f.signatures) for name, f in native_io._kernels().items()})
spans = SpanLayout(4).refs(ids, 0, 8)
assert all(backend.write(WriteBatch(keys[:4], [0, 1, 2, 3])))  # a file per page
assert all(backend.write(WriteBatch(keys[4:], [4, 5, 6, 7], spans[4:])))  # one span file
assert all(backend.read(ReadBatch(keys[:4], [8, 9, 10, 11])))
assert all(backend.read(ReadBatch(keys[4:], [12, 13, 14, 15], spans[4:],
                                  time.monotonic() + 60)))
assert torch.equal(pool.buffer[:8], pool.buffer[8:])
print({name: len(f.signatures) for name, f in native_io._kernels().items()})
"""


def test_warm_up_compiles_what_a_file_store_then_runs(tmp_path):
    """numba compiles a kernel for each new set of argument types: a batch whose types
    warm_up did not see compiles on the L3 thread of a serving engine (measured: 0.75 s
    of CPU on the first backup). In a fresh process, a file store's warm-up compiles
    every kernel once, and after its pages and span files went both ways each still has
    that one compiled version."""
    if not native_io.available():
        pytest.skip("the GIL-free batch path does not run here (numba or libc missing)")
    proc = subprocess.run([sys.executable, "-c", WARM_CHILD, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warmed, used = (eval(line)  # noqa: S307 - our own child's dicts
                    for line in proc.stdout.strip().splitlines()[-2:])
    assert warmed == {name: 1 for name in warmed} and "write_pages" in warmed, warmed
    assert used == warmed
