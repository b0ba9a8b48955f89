"""The worker half's engine-free core: one rank's L2 bytes and the copies a step plan asks for.

``core.HiCacheWorker`` takes a plain ``StepPlan`` (tiers/index/plans.py) and
returns a plain ``WorkerReport``; vLLM's adapter (connector/connector.py)
only calls it from vLLM's hooks and wraps the report in vLLM's envelope.
It is a facade over jobs that own their state (copies.py, loads.py,
store_queue.py, fetch_endings.py, l3_link.py, report.py; outcome.py is
what they owe vLLM and the scheduler).
Never imports vLLM: tested with torch tensors standing for vLLM's KV cache.
"""
