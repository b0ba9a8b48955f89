"""Peer component benchmarks: our tiers against SGLang and LMCache, each peer in its own venv."""
