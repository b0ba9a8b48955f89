"""Throughput of the Mooncake L3 backend versus raw Mooncake Store calls on the same bytes.

Contract: ``bench_mooncake(page_bytes, num_pages, repeats)`` starts its own
mooncake_master on 127.0.0.1 (``mooncake_service``), and in this one process
measures:
- ours: ``MooncakeBackend.write`` / ``read`` on a registered
  ``HostPagePool`` (page_first_direct, one layer, one block per page):
  existence check, xxh3 checksum, 128-byte header, multi-buffer put; get with
  header check and checksum verification;
- ours with the pool's checksums (``ours_put_pool_sums``): the same put with
  every slot's checksum already in the pool, as the store path leaves it
  (host_pool.py ``set_checksums``: computed on the copy thread right after
  the L1 -> L2 copy); what that costs there is ``l2_checksum_gbps``, the
  checksums of the same slots timed on their own;
- ours reading through Mooncake (``ours_get_transfer``): the same get with reads
  in place turned off (tiers/l3/mooncake/local.py), as for objects in another process's or
  host's segment: Mooncake's transfer, then the check;
- raw: ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of the
  same pool slots through the backend's own client (same segment, same
  registration), no header, no checks;
- with ``span_pages`` > 1, span objects (tiers/index/spans.py): ours through
  batches with ``spans`` (pool checksums), against the raw
  client putting and getting objects of the same ``span_pages`` consecutive
  slots (``raw_span_put`` / ``raw_span_get``).
Every object of ours lies in the backend's own segment (the only one mounted), so
its gets read in place; the raw client's gets are Mooncake's memcpy from it.
``verify``: the backend's verify mode (verify.py: where reads in place hash).
Both issue batches of ``batch_pages`` pages; before every put the store is
emptied (``remove_all``) so no write is skipped. Each repeat runs ours then
raw. Returns medians in GB/s (1e9 bytes of payload per second), every sample,
and the overhead ratios raw/ours (1.0 = no overhead, 1.25 = ours 25 % slower).
Data read back is checked bit-exact once per path. Everything it starts is
stopped before it returns.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from hicache.integration.bench.micro.store_rounds import ours_round, source_pool, timed
from hicache.integration.bench.mooncake_service import apply_client_env, start_mooncake
from hicache.tiers.index.spans import SpanLayout, SpanRef
from hicache.tiers.l2.host_pool import HostPagePool
from hicache.tiers.l3 import native_io
from hicache.tiers.l3.base import ReadBatch, StorageConfig, WriteBatch
from hicache.tiers.l3.integrity import HEADER_BYTES, checksums_at
from hicache.tiers.l3.mooncake.backend import MooncakeBackend


def _span_round(backend: MooncakeBackend, pool: HostPagePool, keys: list[str],
                span_pages: int, batch_pages: int, samples: dict[str, list[float]], *,
                check: bool) -> None:
    """One timed store of slots [0, n) as span objects (the pool's checksums with the
    slots, as the store path leaves them) and one timed load of them into [n, 2n)."""
    n, nb = len(keys), pool.geometry.page_bytes
    refs: list[SpanRef] = [r for r in SpanLayout(span_pages).refs(
        [bytes.fromhex(k) for k in keys], 0, n) if r is not None]
    assert len(refs) == n  # n is whole spans
    per = max(span_pages, batch_pages - batch_pages % span_pages)
    batches = [(lo, min(lo + per, n)) for lo in range(0, n, per)]
    backend.clear()
    secs, ok = timed(lambda: sum(sum(backend.write(WriteBatch(keys[lo:hi], list(range(lo, hi)),
                                                              refs[lo:hi]))) for lo, hi in batches))
    if ok != n:
        raise RuntimeError(f"MooncakeBackend stored {ok}/{n} pages in span objects")
    samples["ours_span_put"].append(n * nb / secs / 1e9)
    total = pool.geometry.num_slots // 2
    pool.buffer[total:].zero_()
    secs, ok = timed(lambda: sum(sum(backend.read(ReadBatch(
        keys[lo:hi], [total + s for s in range(lo, hi)], refs[lo:hi]))) for lo, hi in batches))
    if ok != n:
        raise RuntimeError(f"MooncakeBackend loaded {ok}/{n} pages from span objects")
    samples["ours_span_get"].append(n * nb / secs / 1e9)
    if check:
        assert torch.equal(pool.buffer[:n], pool.buffer[total:total + n])


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{i:064x}" if not prefix else f"{prefix}-{i}" for i in range(n)]


def bench_mooncake(page_bytes: int, num_pages: int, repeats: int, *,
                   batch_pages: int = 256, span_pages: int = 1,
                   verify: str = "inline") -> dict[str, Any]:
    """GB/s of put and get through MooncakeBackend versus raw Mooncake calls."""
    apply_client_env()
    pool = source_pool(page_bytes, num_pages)
    # room for one full run of objects (eviction starts at 90 % full)
    segment = int(num_pages * (page_bytes + HEADER_BYTES) * 1.5) + (64 << 20)
    payload = num_pages * page_bytes
    batches = [(lo, min(lo + batch_pages, num_pages)) for lo in range(0, num_pages, batch_pages)]

    samples: dict[str, list[float]] = {"ours_put": [], "ours_get": [], "raw_put": [],
                                       "raw_get": [], "ours_put_pool_sums": [],
                                       "ours_get_transfer": [], "l2_checksum": [],
                                       "ours_span_put": [], "ours_span_get": [],
                                       "raw_span_put": [], "raw_span_get": []}
    spans = span_pages > 1 and num_pages >= span_pages
    whole = num_pages - num_pages % span_pages if spans else 0
    span_bytes = span_pages * page_bytes
    objects = [f"raw-span-{lo}" for lo in range(0, whole, span_pages)]
    slots = list(range(num_pages))
    addresses = [pool.buffer.data_ptr() + s * page_bytes for s in slots]
    payloads = [pool.buffer[s].view(-1).numpy() for s in slots]
    with start_mooncake() as svc:
        backend = MooncakeBackend(StorageConfig(
            tp_rank=0, tp_size=1, namespace="bench", mem_layout="page_first_direct",
            page_bytes=page_bytes, extra_config={**svc.extra_config(segment),
                                                 "verify": verify}))
        try:
            backend.register_host_pool(pool)
            # The raw calls go through the backend's own client: the same segment and
            # the same registered pool, so both sides place objects alike (two clients
            # in one process let the master place a put in either segment, local
            # memcpy or loopback TCP, which swung raw puts between 1 and 3 GB/s).
            raw = backend._store
            keys = _keys("", num_pages)
            raw_keys = _keys("raw", num_pages)
            base, nb = pool.buffer.data_ptr(), page_bytes
            raw_checked = False
            for rep in range(repeats):
                backend.clear()
                for s in slots:
                    pool.set_key(s, keys[s].encode())  # no checksums with the slots
                ours_round(backend, pool, keys, batch_pages, samples, check=rep == 0)
                # ---- ours, the checksums left with the slots by the store path
                secs, sums = timed(lambda: checksums_at(addresses, payloads, page_bytes))
                samples["l2_checksum"].append(payload / secs / 1e9)
                pool.set_checksums(slots, sums)
                backend.clear()
                secs, ok = timed(lambda: sum(
                    sum(backend.write(WriteBatch(keys[lo:hi],
                                                 slots[lo:hi]))) for lo, hi in batches))
                if ok != num_pages:
                    raise RuntimeError(f"MooncakeBackend stored {ok}/{num_pages} pages")
                samples["ours_put_pool_sums"].append(payload / secs / 1e9)
                # ---- ours, every read through Mooncake's transfer (no reads in place)
                here, backend._segment = backend._segment, None
                secs, ok = timed(lambda: sum(
                    sum(backend.read(ReadBatch(keys[lo:hi], [num_pages + s for s in slots[lo:hi]])))
                    for lo, hi in batches))
                backend._segment = here
                if ok != num_pages:
                    raise RuntimeError(f"MooncakeBackend loaded {ok}/{num_pages} pages")
                samples["ours_get_transfer"].append(payload / secs / 1e9)
                if spans:
                    _span_round(backend, pool, keys[:whole], span_pages, batch_pages, samples,
                                check=rep == 0)
                # ---- raw, same bytes
                raw.remove_all(True)
                secs, rcs = timed(lambda: [rc for lo, hi in batches for rc in raw.batch_put_from(
                    raw_keys[lo:hi], [base + i * nb for i in range(lo, hi)], [nb] * (hi - lo))])
                if any(rc != 0 for rc in rcs):
                    raise RuntimeError(f"raw batch_put_from failed: {sorted(set(rcs))}")
                samples["raw_put"].append(payload / secs / 1e9)
                pool.buffer[num_pages:].zero_()
                secs, rcs = timed(lambda: [rc for lo, hi in batches for rc in raw.batch_get_into(
                    raw_keys[lo:hi], [base + (num_pages + i) * nb for i in range(lo, hi)],
                    [nb] * (hi - lo))])
                if any(rc != nb for rc in rcs):
                    raise RuntimeError(f"raw batch_get_into failed: {sorted(set(rcs))}")
                samples["raw_get"].append(payload / secs / 1e9)
                if not raw_checked:
                    assert torch.equal(pool.buffer[:num_pages], pool.buffer[num_pages:])
                    raw_checked = True
                if spans:  # raw objects of span_pages consecutive slots each
                    raw.remove_all(True)
                    secs, rcs = timed(lambda: raw.batch_put_from(
                        objects, [base + lo * nb for lo in range(0, whole, span_pages)],
                        [span_bytes] * len(objects)))
                    if any(rc != 0 for rc in rcs):
                        raise RuntimeError(f"raw span batch_put_from failed: {sorted(set(rcs))}")
                    samples["raw_span_put"].append(whole * nb / secs / 1e9)
                    secs, rcs = timed(lambda: raw.batch_get_into(
                        objects, [base + (num_pages + lo) * nb
                                  for lo in range(0, whole, span_pages)],
                        [span_bytes] * len(objects)))
                    if any(rc != span_bytes for rc in rcs):
                        raise RuntimeError(f"raw span batch_get_into failed: {sorted(set(rcs))}")
                    samples["raw_span_get"].append(whole * nb / secs / 1e9)
            raw.remove_all(True)
        finally:
            backend.close()
    med = {name: statistics.median(vals) if vals else 0.0 for name, vals in samples.items()}
    return {
        "page_bytes": page_bytes,
        "num_pages": num_pages,
        "repeats": repeats,
        "batch_pages": batch_pages,
        "ours_put_gbps": med["ours_put"],
        "ours_get_gbps": med["ours_get"],
        "raw_put_gbps": med["raw_put"],
        "raw_get_gbps": med["raw_get"],
        "ours_put_pool_sums_gbps": med["ours_put_pool_sums"],
        "ours_get_transfer_gbps": med["ours_get_transfer"],
        "span_pages": span_pages if spans else 1,
        **({"ours_span_put_gbps": med["ours_span_put"],
            "ours_span_get_gbps": med["ours_span_get"],
            "raw_span_put_gbps": med["raw_span_put"],
            "raw_span_get_gbps": med["raw_span_get"]} if spans else {}),
        "l2_checksum_gbps": med["l2_checksum"],
        "native_checksums": native_io.available(),
        "put_overhead": med["raw_put"] / med["ours_put"],
        "get_overhead": med["raw_get"] / med["ours_get"],
        "samples_gbps": samples,
    }
