"""The compiled loop behind cpu_copy.py: byte ranges copied with the C library's memcpy.

Imported only when the first copy needs it (cpu_copy.py ``_copy_runs`` says why
numba is not imported at module import).

Contract: ``copy_runs(kv, kv_base, kv_stride, pool, pool_at, row_at, start, nbytes,
load)`` copies, for each layer ``j`` (outer) and run ``k`` (inner), ``nbytes[k]``
bytes between ``kv[kv_base[j] + start[k] * kv_stride[j]:]`` and
``pool[pool_at[k] + row_at[j]:]`` (pool -> kv when ``load``, else kv -> pool), on
flat uint8 arrays, without the GIL. Each layer's offsets are computed in this loop,
so a store of a page or two costs the caller no array building per layer. Every
range is checked against its array before any byte moves: a range outside raises
``IndexError`` and nothing is copied. Ranges must not overlap within a call
(memcpy).

Each copy is one ``llvm.memcpy`` (the C library's vectorised routine); numba's
slice assignment is an element loop, several times slower for the KiB-sized copies
of a step's pages (docs/benchmarks-trace.md, "The copy loop"). The intrinsic names
no address, so numba's on-disk cache keeps the compiled loop.
"""

from __future__ import annotations

from typing import Any

import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _memcpy(typingctx: Any, dst: Any, dst_off: Any, src: Any, src_off: Any,
            nbytes: Any) -> Any:
    """memcpy(dst.data + dst_off, src.data + src_off, nbytes), no checks."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        d, d_off, s, s_off, n = args
        d_ptr = context.make_array(sig.args[0])(context, builder, d).data
        s_ptr = context.make_array(sig.args[2])(context, builder, s).data
        cgutils.raw_memcpy(builder, builder.gep(d_ptr, [d_off]),
                           builder.gep(s_ptr, [s_off]), n, 1)
        return context.get_dummy_value()

    return types.void(dst, dst_off, src, src_off, nbytes), codegen


@numba.njit(cache=True, nogil=True)
def copy_runs(kv, kv_base, kv_stride, pool, pool_at, row_at, start, nbytes, load):  # noqa: ANN001, ANN201
    for j in range(kv_base.shape[0]):
        for k in range(start.shape[0]):
            at_kv = kv_base[j] + start[k] * kv_stride[j]
            at_pool = pool_at[k] + row_at[j]
            n = nbytes[k]
            if (n < 0 or at_kv < 0 or at_pool < 0 or at_kv + n > kv.shape[0]
                    or at_pool + n > pool.shape[0]):
                raise IndexError("cpu_copy: a byte range lies outside its array")
    for j in range(kv_base.shape[0]):
        for k in range(start.shape[0]):
            at_kv = kv_base[j] + start[k] * kv_stride[j]
            at_pool = pool_at[k] + row_at[j]
            if load:
                _memcpy(kv, at_kv, pool, at_pool, nbytes[k])
            else:
                _memcpy(pool, at_pool, kv, at_kv, nbytes[k])
