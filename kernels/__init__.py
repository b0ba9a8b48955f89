"""Copies between an engine's paged KV blocks and host pool pages (torch reference path).

Never imports vLLM: callers hand in plain tensors.
"""
