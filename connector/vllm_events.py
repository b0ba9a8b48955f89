"""L2's KV events in vLLM's own types, for vLLM's KV event publisher.

Contract: ``kv_events_enabled(vllm_config)`` says whether vLLM publishes KV
events (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``);
only then does the scheduler record them (tiers/controller/events.py).
``to_vllm(events)`` turns them into vLLM's ``BlockStored`` / ``BlockRemoved``
(medium "CPU"), with block hashes converted the way vLLM converts its own
(``maybe_convert_block_hash``: the low 64 bits as an int unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), so a router matches them against
the hashes of vLLM's GPU events. The connector returns them from
``take_events``; vLLM publishes them in the same batch as its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from hicache.tiers.controller.events import PageEvent, PageStored


def kv_events_enabled(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def to_vllm(events: Iterable[PageEvent]) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]  # type: ignore[arg-type]
        if isinstance(event, PageStored):
            parent = event.parent_block_hash
            out.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=(maybe_convert_block_hash(parent)  # type: ignore[arg-type]
                                   if parent is not None else None),
                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                medium=event.medium, lora_name=event.lora_name))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=event.medium))
    return out
