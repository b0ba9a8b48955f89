#!/usr/bin/env bash
# Device-side steps of the GPU end-to-end run; each device call runs one stage from the
# repository root (see README "On a GPU"). The bundle parts travel as carried paths
# .gpu/p0 and .gpu/p1 (built here by `python -m hicache.integration.bench.gpu.bundle build`).
#
#   stage0            keep bundle part 0 (in /tmp), GPU kernel tests, copy benchmark,
#                     pinned-memory check            (carry .gpu/p0)
#   stage1 [SECONDS]  keep part 1, unpack vLLM, register our plugin, start the e2e run in
#                     its own session, collect for up to SECONDS (carry .gpu/p1)
#   collect [SECONDS] wait for the e2e run up to SECONDS, copy what it wrote to $OUT
#
# The machine must stay warm between calls (the next call within its idle window), or
# /tmp is gone and stage0/stage1 start over. Extra e2e arguments: $E2E_ARGS.
set -u
HB=/tmp/hicache-bundle
SITE=/tmp/hicache-gpu/site
RES=/tmp/hicache-e2e
OUT=${OUT:-/tmp/hicache-out}
mkdir -p "$OUT" "$HB"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
export VLLM_USE_FLASHINFER_SAMPLER=0

collect() {
  local limit=${1:-500} t=0
  while pgrep -f "bench.gpu.e2e run" >/dev/null && [ "$t" -lt "$limit" ]; do
    sleep 5; t=$((t + 5))
  done
  pgrep -f "bench.gpu.e2e run" >/dev/null && echo "e2e still running after ${t}s" \
    || echo "e2e finished"
  cp "$RES"/results.json "$RES"/report.md "$RES"/ttft.png "$OUT"/ 2>/dev/null
  tail -c 4000000 "$RES.log" >"$OUT/e2e.log" 2>/dev/null
  (cd "$RES" 2>/dev/null && tar czf "$OUT/case-logs.tgz" case-*.log 2>/dev/null)
  cat "$RES/report.md" 2>/dev/null || tail -50 "$RES.log"
}

case "${1:-}" in
stage0)
  cp .gpu/p0/* "$HB"/ && ls -la "$HB"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pytest --noconftest -q -p no:cacheprovider tests/kernels tests/tiers/l2 2>&1 \
    | tail -25 | tee "$OUT/kernel-tests.txt"
  python3 -m hicache.integration.bench.micro.host_pin --gb 20 2>&1 | tee "$OUT/host-pin.txt"
  python3 -m hicache.integration.bench.micro.kv_copy --out "$OUT/copy" 2>&1 \
    | grep -v "it/s" | tee "$OUT/copy.txt"
  ;;
stage1)
  cp .gpu/p1/* "$HB"/ && python3 integration/bench/gpu/bundle.py unpack --parts "$HB" \
    --dest "$SITE" || exit 1
  # Our vLLM plugin entry point, without building a wheel: vLLM finds it by metadata.
  mkdir -p "$SITE/vllm_hicache-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm-hicache\nVersion: 0.1.0\n' \
    >"$SITE/vllm_hicache-0.1.0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nhicache = hicache.integration.vllm.plugin:register\n' \
    >"$SITE/vllm_hicache-0.1.0.dist-info/entry_points.txt"
  export PYTHONPATH=$PWD:$SITE
  python3 -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', \
transformers.__version__)" || exit 1
  mkdir -p "$RES"
  # shellcheck disable=SC2086
  setsid nohup python3 -m hicache.integration.bench.gpu.e2e run --out "$RES" ${E2E_ARGS:-} \
    >"$RES.log" 2>&1 </dev/null &
  sleep 2
  collect "${2:-500}"
  ;;
collect)
  collect "${2:-500}"
  ;;
*)
  echo "usage: $0 stage0 | stage1 [SECONDS] | collect [SECONDS]" >&2
  exit 2
  ;;
esac
