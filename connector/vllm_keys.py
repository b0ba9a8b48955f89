"""Page keys as vLLM sees them: the namespace, the block hashes, and whether they are stable.

Contract:
- ``key_namespace``: everything that changes the meaning of a page's bytes
  (model, KV dtype, vLLM's layout and spec, page size, TP size, the
  block-hash algorithm, and with several KV-cache groups their kinds and
  layers in order) goes into the keys' seed.
- Page keys derive from vLLM's ``request.block_hashes`` (tiers/index/page_keys.py),
  which cover tokens, multimodal features, prompt embeddings, LoRA (name and
  path) and cache salt. ``prefix_hasher`` computes the same hashes for a
  plain-token prompt (admin flush / tree view by prefix) with vLLM's own
  block hasher, so the two always agree.
- ``PageHashes``: where vLLM hashes coarser than a page (a Mamba hybrid
  without vLLM's prefix caching hashes per ``max_model_len`` tokens), the
  connector hashes each request per page with vLLM's own block hasher (the
  same extra keys: multimodal features, LoRA, cache salt, embeddings) and
  hands the scheduler a view of the request with those hashes.
- ``check_stable_hashes``: L3 keys must survive restarts and be shared
  between engines. vLLM's block hashes are stable for its cryptographic
  algorithms (``sha256``, ``sha256_cbor``: fixed seed) and for any algorithm
  when ``PYTHONHASHSEED`` is set; with ``xxhash``/``xxhash_cbor`` and no
  ``PYTHONHASHSEED`` vLLM seeds them at random per process, and an L3
  configuration is refused with a message naming both fixes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hicache.tiers.config import HiCacheConfigError
from hicache.tiers.index.page_keys import KeyNamespace, kv_dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# vLLM's algorithms whose NONE_HASH seed is random per process without PYTHONHASHSEED.
RANDOM_SEEDED_ALGOS = ("xxhash", "xxhash_cbor")


def key_namespace(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, page_size: int
) -> KeyNamespace:
    """Everything that changes the meaning of a page's bytes goes into its keys."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    groups = kv_cache_config.kv_cache_groups
    spec = next(g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec))
    layout = kv_cache_config.kv_cache_layout or "default"
    extra: tuple[str, ...] = ()
    if len(groups) > 1:
        # vLLM's hybrid manager: a page holds each group's layers in group order, a
        # Mamba group's checkpoint in the page's last block ("ckpt@last").
        extra = ("groups=" + ";".join(
            f"{type(g.kv_cache_spec).__name__}:{getattr(g.kv_cache_spec, 'sliding_window', 0)}"
            f"{':ckpt@last' if isinstance(g.kv_cache_spec, MambaSpec) else ''}"
            f":{','.join(g.layer_names)}" for g in groups),)
    return KeyNamespace(
        model=f"{vllm_config.model_config.model}@{vllm_config.model_config.revision or ''}",
        kv_dtype=kv_dtype_name(str(spec.dtype), vllm_config.cache_config.cache_dtype),
        layout=(
            f"{current_platform.device_type}:{layout}:{type(spec).__name__}:"
            f"bs{spec.block_size}:h{getattr(spec, 'num_kv_heads', 0)}:"
            f"d{getattr(spec, 'head_size', 0)}"
        ),
        page_size=page_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        extra=(f"block-hash={vllm_config.cache_config.prefix_caching_hash_algo}", *extra),
    )


def hash_block_size(kv_cache_config: KVCacheConfig, block_size: int) -> int:
    """Tokens per entry of ``request.block_hashes`` (vLLM resolves it at start)."""
    return int(getattr(kv_cache_config, "hash_block_size", None) or block_size)


def check_stable_hashes(vllm_config: VllmConfig, uses_l3: bool) -> None:
    """Refuse an L3 whose keys would change at every restart (see module docstring)."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if uses_l3 and algo in RANDOM_SEEDED_ALGOS and os.environ.get("PYTHONHASHSEED") is None:
        raise HiCacheConfigError(
            f"hicache_storage_backend needs block hashes that are the same in every "
            f"process, but --prefix-caching-hash-algo={algo} is seeded at random per "
            f"process unless PYTHONHASHSEED is set. Set PYTHONHASHSEED to one shared value "
            f"for every engine (and keep it), or use --prefix-caching-hash-algo sha256 "
            f"(allowed values with L3: sha256, sha256_cbor, or {algo} with PYTHONHASHSEED)"
        )


class VllmPrefixHasher:
    """vLLM's block hashes of a plain-token prompt, as its requests would get them."""

    def __init__(self, vllm_config: VllmConfig, hash_block_size: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self._hasher = get_request_block_hasher(hash_block_size, hash_fn)
        # LoRA block hashes cover the adapter's path too: remember it per name.
        self.lora_paths: dict[str, str] = {}

    def __call__(self, tokens: Sequence[int], cache_salt: str | None,
                 lora_name: str | None) -> list[bytes]:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        lora = None
        if lora_name is not None:
            lora = LoRARequest(lora_name, 1, self.lora_paths.get(lora_name, "<unknown path>"))
        request = Request("hicache-prefix", list(tokens), SamplingParams(max_tokens=1), None,
                          lora_request=lora, cache_salt=cache_salt, block_hasher=self._hasher)
        return list(request.block_hashes)


class _HashInput:
    """The request as vLLM's block hasher reads it, with our own hash list."""

    def __init__(self, request: Request, hashes: list[Any]) -> None:
        self._request = request
        self.block_hashes = hashes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class PageHashedRequest:
    """A request whose ``block_hashes`` are per page (see ``PageHashes``)."""

    def __init__(self, request: Request, hashes: list[Any],
                 hasher: Callable[[Any], list[Any]]) -> None:
        self._request = request
        self._input = _HashInput(request, hashes)
        self._hasher = hasher

    @property
    def block_hashes(self) -> list[Any]:
        hashes: list[Any] = self._input.block_hashes
        hashes.extend(self._hasher(self._input))
        return hashes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class PageHashes:
    """Per-page block hashes of live requests, by vLLM's hasher (see module docstring)."""

    def __init__(self, vllm_config: VllmConfig, page_size: int) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self._hasher = get_request_block_hasher(page_size, hash_fn)
        self._hashes: dict[str, list[Any]] = {}

    def view(self, request: Request) -> PageHashedRequest:
        hashes = self._hashes.setdefault(request.request_id, [])
        return PageHashedRequest(request, hashes, self._hasher)

    def forget(self, req_id: str) -> None:
        self._hashes.pop(req_id, None)
