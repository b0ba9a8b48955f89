"""Glue around the core: the vLLM plugin entry point, the tiny test model, the CLI and benchmarks."""
