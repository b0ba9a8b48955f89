"""The vLLM adapter: HiCacheConnector, vLLM's envelopes, its config and hashes read once.
With integration/vllm/, the only product code that imports vLLM."""
