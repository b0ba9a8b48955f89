#!/usr/bin/env bash
# Build the peer venvs for the peer component benchmarks (python -m hicache.integration.bench.peers).
#
# Contract:
# - Builds <repo>/.venv-peers/sglang and <repo>/.venv-peers/lmcache (root overridable with
#   PEERS_VENV_DIR), one venv per peer: their pins conflict with ours and with each other.
# - The local CPU torch wheel goes in first (pip finds torch==2.13.0 through its configured
#   find-links, as the Makefile does) and every later install pins "torch==2.13.0" too, so
#   no peer can replace it. After every install step the script asserts
#   torch.__version__ == "2.13.0+cpu" and stops with an error otherwise.
# - SGLang is installed with --no-deps plus the minimal list its mem_cache imports need;
#   torchvision is never installed (the peer script puts scripts/stubs on PYTHONPATH).
#   LMCache is a plain install (it keeps the CPU torch).
# - Idempotent: a finished venv has a stamp file holding its spec; a rerun with the same
#   spec does nothing, a changed spec (or a half-built venv) rebuilds that venv from scratch.
# - Prints each step, the seconds it took and the venv's size; exits non-zero on any failure.
#
# Usage: bash integration/bench/peers/setup_venvs.sh [sglang] [lmcache]     (default: both)

set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
ROOT="${PEERS_VENV_DIR:-$REPO/.venv-peers}"
BASE_PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
TORCH_VERSION="2.13.0+cpu"
STUBS="$HERE/scripts/stubs"

SGLANG_SPEC="sglang==0.5.23"
# What sglang.srt.mem_cache.{radix_cache,hicache_storage} need to import (feasibility.md §4).
SGLANG_DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette typing_extensions
             msgspec triton pydantic pyzmq tqdm IPython aiohttp transformers dill
             "apache-tvm-ffi==0.1.11" sentencepiece compressed_tensors gguf)
LMCACHE_SPEC="lmcache==0.5.6"

log() { printf '[setup-peers %(%H:%M:%S)T] %s\n' -1 "$*"; }

check_torch() {  # venv, step
    local py="$1/bin/python"
    if ! "$py" - "$TORCH_VERSION" "$2" <<'EOF'
import sys
import torch
want, step = sys.argv[1], sys.argv[2]
if torch.__version__ != want:
    sys.exit(f"FATAL after {step}: torch is {torch.__version__}, expected {want}")
print(f"  torch {torch.__version__} ok after {step}")
EOF
    then
        log "ABORT: $1 no longer has the CPU torch; delete it and fix the install step"
        exit 1
    fi
    if "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
        log "ABORT: torchvision got installed into $1 (it breaks the CPU torch); remove the venv"
        exit 1
    fi
}

timed() {  # label, command...
    local label="$1"; shift
    local t0=$SECONDS
    log "$label: $*"
    "$@"
    log "$label took $((SECONDS - t0)) s"
}

build() {  # name, spec text, install function
    local name="$1" spec="$2" install="$3"
    local venv="$ROOT/$name" stamp="$ROOT/$name/.hicache-peer-installed"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$spec" ]]; then
        log "$name: up to date ($stamp); checking torch only"
        check_torch "$venv" "stamp check"
        return 0
    fi
    if [[ -e "$venv" ]]; then
        log "$name: no stamp or another spec: removing $venv and rebuilding"
        rm -rf "$venv"
    fi
    local t0=$SECONDS
    mkdir -p "$ROOT"
    timed "$name venv" "$BASE_PYTHON" -m venv "$venv"
    timed "$name torch" "$venv/bin/python" -m pip install -q "$TORCH_SPEC"
    check_torch "$venv" "torch install"
    "$install" "$venv"
    echo "$spec" > "$stamp"
    log "$name: built in $((SECONDS - t0)) s, size $(du -sh "$venv" | cut -f1)"
}

install_sglang() {
    local venv="$1" py="$1/bin/python"
    timed "sglang wheel" "$py" -m pip install -q --no-deps "$SGLANG_SPEC"
    check_torch "$venv" "sglang --no-deps"
    timed "sglang deps" "$py" -m pip install -q "${SGLANG_DEPS[@]}" "$TORCH_SPEC"
    check_torch "$venv" "sglang deps"
    log "sglang: import check (torchvision stub from $STUBS)"
    PYTHONPATH="$STUBS" "$py" -c "
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
print('  sglang imports ok:', RadixCache.__name__, HiCacheFile.__name__)" 2>&1 | grep -v -i warn
}

install_lmcache() {
    local venv="$1" py="$1/bin/python"
    timed "lmcache" "$py" -m pip install -q "$LMCACHE_SPEC" "$TORCH_SPEC"
    check_torch "$venv" "lmcache install"
    log "lmcache: import check"
    "$py" -c "
from lmcache.v1.cache_engine import LMCacheEngineBuilder
print('  lmcache imports ok:', LMCacheEngineBuilder.__name__)" 2>&1 | tail -n 1
}

peers=("$@")
[[ ${#peers[@]} -eq 0 ]] && peers=(sglang lmcache)
log "peer venvs under $ROOT (base python: $("$BASE_PYTHON" --version 2>&1))"
for peer in "${peers[@]}"; do
    case "$peer" in
        sglang) build sglang "$SGLANG_SPEC + ${SGLANG_DEPS[*]} + $TORCH_SPEC (no-deps)" install_sglang ;;
        lmcache) build lmcache "$LMCACHE_SPEC + $TORCH_SPEC" install_lmcache ;;
        *) log "unknown peer '$peer' (allowed: sglang lmcache)"; exit 2 ;;
    esac
done
for peer in "${peers[@]}"; do
    log "$peer: $(du -sh "$ROOT/$peer" | cut -f1) in $ROOT/$peer"
done
