"""Engine-independent cache core: page keys, HiRadixTree, L2 host page pool.

Never imports vLLM; tested without an engine.
"""
