"""HiCache asks vLLM for PIECEWISE CUDA graphs, alone and inside MultiConnector.

The worker's per-layer load waits and saves run from vLLM's attention hooks,
which a full CUDA graph replays without calling. vLLM's config turns FULL
modes into PIECEWISE when the connector class says so
(``requires_piecewise_for_cudagraph``); the GPU run (integration/bench/gpu)
ran HiCache under vLLM's CUDA graphs that way.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from hicache.connector.connector import HiCacheConnector
from hicache.integration.vllm.null_connector import TRANSFER_CONFIG as NULL
from hicache.integration.vllm.plugin import CONNECTOR_NAME, register


def test_hicache_requires_piecewise_cuda_graphs():
    assert HiCacheConnector.requires_piecewise_for_cudagraph({}) is True


def test_multiconnector_with_hicache_requires_piecewise_and_without_does_not():
    register()
    hicache = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both",
               "kv_connector_extra_config": {"hicache_size": 1}}
    assert MultiConnector.requires_piecewise_for_cudagraph({"connectors": [NULL, hicache]})
    assert not MultiConnector.requires_piecewise_for_cudagraph({"connectors": [NULL]})
