"""HiCache for vLLM: SGLang-style hierarchical KV cache as a vLLM KV connector.

The subpackages live in the repository's top-level folders and are installed
under this namespace: ``hicache.connector`` (vLLM adapter), ``hicache.tiers``
(engine-independent cache core), ``hicache.kernels`` (KV copy paths) and
``hicache.integration`` (plugin, tiny model, CLI, benchmarks).
"""

__version__ = "0.1.0"
