"""Start and stop offline vLLM engines with or without HiCache (tests and benchmarks).

``EngineSpec`` names what differs between the engines we compare: whether the
connector is on (and its extra config), vLLM's own prefix cache, the L1 size
in blocks. ``open_llm`` turns it into ``vllm.LLM``; ``close_llm`` shuts the
engine-core process down so the next engine gets the cores and memory back.
``in_process=True`` keeps the engine core in this process (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test can inspect the connector.
``ENGINE_STARTS`` counts the engines this process started (or tried to), by
kind, ``open_llm``'s and the ``vllm serve`` processes launched through
``note_engine_start``; the test suite prints it at the end.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ENGINE_STARTS: Counter[str] = Counter()


def note_engine_start(kind: str) -> None:
    """Count one engine start of ``kind`` (e.g. "LLM", "vllm serve")."""
    ENGINE_STARTS[kind] += 1


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration."""

    model: str
    # None = no connector; a dict = HiCache on with this kv_connector_extra_config.
    hicache: dict[str, Any] | None = None
    # A whole kv_transfer_config instead (another connector, MultiConnector).
    kv_transfer: dict[str, Any] | None = None
    # vLLM's own (L1) automatic prefix caching.
    prefix_caching: bool = True
    # vLLM KV block size in tokens (CPU default is 128).
    block_size: int = 32
    # L1 capacity in blocks (num_gpu_blocks_override); None = vLLM's own sizing.
    num_blocks: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 8
    # float32 for token-identity tests: in bf16, KV computed during decode and
    # the same KV recomputed in a prefill differ in the last bits, which flips
    # 1-3% of near-tied greedy tokens even with vLLM's own prefix cache. The
    # connector's copies are bit-exact either way (tests/kernels).
    dtype: str = "float32"
    in_process: bool = False
    extra_args: dict[str, Any] = field(default_factory=dict)


def open_llm(spec: EngineSpec) -> Any:
    from vllm import LLM

    note_engine_start("LLM")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if spec.in_process else "1"
    kwargs: dict[str, Any] = dict(
        model=spec.model,
        enforce_eager=True,
        dtype=spec.dtype,
        seed=0,
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        enable_prefix_caching=spec.prefix_caching,
    )
    if spec.num_blocks is not None:
        kwargs["num_gpu_blocks_override"] = spec.num_blocks
    if spec.hicache is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HiCacheConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(spec.hicache),
        }
    elif spec.kv_transfer is not None:
        kwargs["kv_transfer_config"] = dict(spec.kv_transfer)
    kwargs.update(spec.extra_args)
    if not spec.in_process:
        return LLM(**kwargs)
    # vLLM 0.32's worker start scans every module in sys.modules to rebind
    # Triton kernels and crashes on llvmlite's ffi.lib (its __getattr__ answers
    # even __dict__). A fresh worker process has not imported numba yet; an
    # in-process engine may have (our CPU batch copy and L3 batch I/O use it), so
    # those modules sit out the scan, and only the scan: they hold no vLLM kernels
    # to rebind, and numba must stay importable while the engine starts (the L3
    # backend compiles its batch functions when the KV caches are registered; a
    # second import of numba meanwhile breaks its type registry).
    try:
        import vllm.triton_utils.dispatcher as dispatcher_module
    except ImportError:
        dispatcher_module = None  # type: ignore[assignment]
    dispatcher: Any = dispatcher_module
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None:  # another vLLM: keep them out of the whole start
        with _numba_hidden():
            return LLM(**kwargs)

    def scan_without_numba(*args: Any, **kw: Any) -> Any:
        with _numba_hidden():
            return scan(*args, **kw)

    dispatcher._rebind_kernels = scan_without_numba
    try:
        return LLM(**kwargs)
    finally:
        dispatcher._rebind_kernels = scan


@contextlib.contextmanager
def _numba_hidden() -> Iterator[None]:
    """numba's and llvmlite's modules out of sys.modules for the block."""
    hidden = {name: mod for name, mod in sys.modules.items()
              if name.split(".")[0] in ("numba", "llvmlite")}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def greedy_params(max_tokens: int) -> Any:
    """vLLM ``SamplingParams`` that decode exactly ``max_tokens`` tokens greedily."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def streaming_greedy_params(max_tokens: int) -> Any:
    """``greedy_params`` whose outputs carry only each step's new tokens (for clients
    that drive ``LLMEngine.step`` themselves)."""
    from vllm.sampling_params import RequestOutputKind

    params = greedy_params(max_tokens)
    params.output_kind = RequestOutputKind.DELTA
    return params


def close_llm(llm: Any) -> None:
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()


def kill_engine_core(llm: Any) -> list[int]:
    """SIGKILL the engine-core processes of a multiprocess engine (a crash: nothing
    is flushed or closed) and wait for them to die; returns their pids. The caller
    still calls ``close_llm`` to release the front end."""
    manager = getattr(llm.llm_engine.engine_core.resources, "engine_manager", None)
    procs = list(getattr(manager, "processes", []))
    if not procs:
        raise RuntimeError("kill_engine_core needs a multiprocess engine (in_process=False)")
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(timeout=30)
    return [proc.pid for proc in procs]


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an ``in_process`` engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def worker_connector() -> Any:
    """The worker-side connector of an ``in_process`` engine (same process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()
