"""The scheduler half and the simulator built on it import neither vLLM nor torch."""

import subprocess
import sys

CHECK = (
    "import sys, hicache.tiers.controller.scheduler, hicache.integration.bench.simulate; "
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))"
)


def test_scheduler_and_simulator_import_no_engine():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
