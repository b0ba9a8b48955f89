"""Benchmarks of whole servers: workload client, comparison runner, sizing simulator.

``hicache bench run`` drives an OpenAI-compatible endpoint (client.py over
workloads.py), ``hicache bench compare`` launches each system of a YAML
config in turn (compare.py over systems.py) and ``hicache simulate`` replays
a recorded trace (trace.py) through the real HiRadixTree (simulate.py).
"""
