"""vLLM plugin entry point (group ``vllm.general_plugins``, name ``hicache``).

vLLM calls ``register()`` in the front end, the engine core and every worker
before it reads the config, so ``--kv-transfer-config
'{"kv_connector":"HiCacheConnector","kv_role":"kv_both"}'`` works without
``kv_connector_module_path``. Importing this module stays cheap: the
connector class itself is loaded lazily by vLLM's factory.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "HiCacheConnector"


def register() -> None:
    """Register HiCacheConnector with vLLM's KV connector factory (idempotent)."""
    _log_like_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "hicache.connector.connector", CONNECTOR_NAME
        )


def _log_like_vllm() -> None:
    """Send ``hicache.*`` logs through vLLM's handlers, so they appear, formatted
    like vLLM's, in every process that runs the plugin."""
    ours = logging.getLogger("hicache")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
