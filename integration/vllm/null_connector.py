"""A KV connector that never loads or stores: the bf16 oracle for token-identity tests.

vLLM's CPU path computes differently in bf16 as soon as any KV connector is
configured (measured: a connector that never loads flips greedy tokens
against vLLM without one). So the fair bf16 oracle for HiCache is vLLM with
this connector: same code path, no cache beyond vLLM's own.

Select it with ``{"kv_connector": "NullConnector", "kv_role": "kv_both",
"kv_connector_module_path": "hicache.integration.vllm.null_connector"}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from hicache.connector.profile import instrument

TRANSFER_CONFIG = {"kv_connector": "NullConnector", "kv_role": "kv_both",
                   "kv_connector_module_path": "hicache.integration.vllm.null_connector"}


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """Every hook present, none does anything: never a cache hit. ``SupportsHMA``,
    so a hybrid model keeps vLLM's hybrid KV cache manager, as with HiCache.
    With ``HICACHE_PROFILE`` set its hooks are timed like HiCache's
    (connector/profile.py): the baseline of a step profile."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        instrument(self, "scheduler" if role == KVConnectorRole.SCHEDULER else "worker")

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
