#!/usr/bin/env bash
# Device-side steps of the GPU end-to-end run; each device call runs one stage from the
# repository root (see README "On a GPU"). The bundle parts travel as carried paths
# .gpu/p0 and .gpu/p1 (built here by `python -m hicache.integration.bench.gpu.bundle build`).
#
#   stage0            keep bundle part 0 (in /tmp), build the gpu8b model in the
#                     background, copy-kernel tests and the kernel tuning sweep
#                     (carry .gpu/p0)
#   stage1 [SECONDS]  keep part 1, unpack vLLM, register our plugin, start `runs` in its
#                     own session, collect for up to SECONDS (carry .gpu/p1)
#   collect [SECONDS] wait for `runs` up to SECONDS, copy what it wrote to $OUT
#   sglang [SECONDS]  one call on its own (carry .gpu-sglang/p0, built by
#                     `bundle.py build --profile sglang`): unpack SGLang 0.5.17, run
#                     sglang_e2e.py (arguments $SGLANG_ARGS) for up to SECONDS, return
#                     its report and the JIT cache (carry it back next time)
#   runs              (started by stage1) the serving-under-load run (serve_load.py,
#                     arguments $SERVE_ARGS; skipped when SERVE_ARGS=skip), then the
#                     end-to-end run (e2e.py, arguments $E2E_ARGS; skipped when
#                     E2E_ARGS=skip), then the Mamba hybrid with vLLM's prefix caching
#                     on (e2e.py on the nemotron_h preset, vLLM's "align" Mamba mode,
#                     arguments $MAMBA_ARGS; skipped when MAMBA_ARGS=skip)
#
# The machine must stay warm between calls (the next call within its idle window), or
# /tmp is gone and stage0/stage1 start over.
set -u
HB=/tmp/hicache-bundle
SITE=/tmp/hicache-gpu/site
RES=/tmp/hicache-e2e
OUT=${OUT:-/tmp/hicache-out}
mkdir -p "$OUT" "$HB"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
export VLLM_USE_FLASHINFER_SAMPLER=0

running() { [ -f "$RES.pid" ] && kill -0 "$(cat "$RES.pid")" 2>/dev/null; }

snapshot() {
  for d in serve e2e mamba; do
    mkdir -p "$OUT/$d"
    cp "$RES/$d"/results.json "$RES/$d"/report.md "$RES/$d"/*.png "$OUT/$d"/ 2>/dev/null
  done
  tail -c 2000000 "$RES.log" >"$OUT/runs.log" 2>/dev/null
}

# Copies what the runs wrote every 10 s, so a call cut short still returns it.
collect() {
  local limit=${1:-500} t=0
  while running && [ "$t" -lt "$limit" ]; do
    sleep 5; t=$((t + 5))
    [ $((t % 10)) -eq 0 ] && snapshot
  done
  running && echo "runs still going after ${t}s" || echo "runs finished"
  snapshot
  (cd "$RES" 2>/dev/null && tar czf "$OUT/case-logs.tgz" */case-*.log 2>/dev/null)
  cat "$RES/serve/report.md" "$RES/e2e/report.md" "$RES/mamba/report.md" 2>/dev/null \
    || tail -50 "$RES.log"
}

case "${1:-}" in
stage0)
  cp .gpu/p0/* "$HB"/ && ls -la "$HB"
  # The model stage1 serves (ignored paths stay on a warm machine).
  nohup python3 -m hicache.integration.models.tiny_model --preset gpu8b >"$OUT/model.txt" 2>&1 &
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -m pytest --noconftest -q -p no:cacheprovider tests/kernels/test_gpu_copy.py 2>&1 \
    | tail -25 | tee "$OUT/kernel-tests.txt"
  python3 -m hicache.integration.bench.micro.kv_copy --sweep --page-sizes 16 --pages 64,256 \
    --layouts page_first,layer_first --out "$OUT/sweep" 2>&1 | grep -v "it/s" \
    | tee "$OUT/sweep.txt"
  wait
  cat "$OUT/model.txt"
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
  setsid nohup bash "$0" runs >"$RES.log" 2>&1 </dev/null &
  echo $! >"$RES.pid"
  sleep 2
  collect "${2:-500}"
  ;;
runs)
  export PYTHONPATH=$PWD:$SITE
  # shellcheck disable=SC2086
  [ "${SERVE_ARGS:-}" = skip ] || python3 -m hicache.integration.bench.gpu.serve_load run \
    --out "$RES/serve" ${SERVE_ARGS:-}
  # shellcheck disable=SC2086
  [ "${E2E_ARGS:-}" = skip ] || python3 -m hicache.integration.bench.gpu.e2e run \
    --out "$RES/e2e" ${E2E_ARGS:-}
  # shellcheck disable=SC2086
  [ "${MAMBA_ARGS:-}" = skip ] || python3 -m hicache.integration.bench.gpu.e2e run \
    --out "$RES/mamba" --preset nemotron_h --cases null-eager,hicache-eager \
    --max-model-len 4096 --histories 1024,3072 --warmup 512 --host-gb 2 --case-timeout 300 \
    ${MAMBA_ARGS:-}
  ;;
collect)
  collect "${2:-500}"
  ;;
sglang)
  SG=/tmp/hicache-sglang
  mkdir -p "$SG/parts" && cp .gpu-sglang/p0/* "$SG/parts"/ \
    && python3 integration/bench/gpu/bundle.py unpack --parts "$SG/parts" --dest "$SG/site" \
    || exit 1
  # The bundle first: its transformers / tokenizers shadow the device's for SGLang's
  # processes (it spawns its scheduler, so the environment, not sys.path).
  export PYTHONPATH=$SG/site:$PWD HF_HUB_OFFLINE=1 TVM_FFI_CACHE_DIR=$SG/tvm-ffi
  [ -d .gpu-sglang/tvm-ffi ] && cp -r .gpu-sglang/tvm-ffi "$SG"/
  python3 -c "import sglang, sgl_kernel, transformers; print('sglang', sglang.__version__, \
'transformers', transformers.__version__)" || exit 1
  # shellcheck disable=SC2086
  timeout "${2:-480}" python3 -m hicache.integration.bench.gpu.sglang_e2e run \
    --out "$SG/out" ${SGLANG_ARGS:-} 2>&1 | tail -c 2000000 >"$OUT/sglang.log"
  cp "$SG/out"/* "$OUT"/ 2>/dev/null
  (cd "$SG" && [ -d tvm-ffi ] && tar czf "$OUT/tvm-ffi-cache.tgz" tvm-ffi)
  cat "$OUT/report.md" 2>/dev/null || tail -60 "$OUT/sglang.log"
  ;;
*)
  echo "usage: $0 stage0 | stage1 [SECONDS] | collect [SECONDS] | runs | sglang [SECONDS]" >&2
  exit 2
  ;;
esac
