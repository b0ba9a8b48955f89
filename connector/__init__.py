"""vLLM adapter: the HiCacheConnector (scheduler and worker halves), step metadata and config parsing.

The only folder that imports vLLM besides integration/.
"""
