# ftrain: the two commands of the README, and their helpers.
#   make demo   - create .venv, install, run the demo job
#   make test   - create .venv, install, run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine has a CPU wheel of torch 2.13.0 on disk; GPU hosts may set TORCH_SPEC="torch>=2.6".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.ftrain-installed
# One intra-op thread per rank: ranks do not fight over cores, and runs are bitwise reproducible.
RUN_ENV := OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE

.PHONY: setup demo test lint format test-unit test-distributed chaos soak bench plan gpu-check docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,hf,lightning]"
	touch $(STAMP)

demo: setup
	$(RUN_ENV) $(PY) scripts/demo.py

test: setup lint
	$(RUN_ENV) $(PY) -m pytest -q --durations=30

# ruff (lint and format) and mypy over the whole tree; `make format` applies ruff's fixes
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test-unit: setup
	$(PY) -m pytest -q tests/unit

test-distributed: setup
	$(RUN_ENV) $(PY) -m pytest -q tests/distributed

chaos: setup
	$(RUN_ENV) $(PY) -m pytest -q -s tests/chaos

# A long seeded random campaign (about 30 minutes, >= 100 faults); SEED=N to vary it,
# RECOVERY=live|restart to override the agents' default recovery mode (live).
SEED ?= 1
RECOVERY ?=
# make soak [PROFILE=uniform|realistic|stress] [SEED=N] [RECOVERY=live|restart] [FAULT_EVERY_S=S]
# uniform: chaos/scenarios/soak.toml (every kind alike); realistic, stress: soak-<profile>.toml
PROFILE ?= uniform
SOAK_SCENARIO = chaos/scenarios/$(if $(filter uniform,$(PROFILE)),soak,soak-$(PROFILE)).toml
soak: setup
	@test -f $(SOAK_SCENARIO) || { echo "make soak: PROFILE=$(PROFILE): one of uniform, realistic, stress"; exit 2; }
	$(RUN_ENV) $(PY) -m ftrain chaos run $(SOAK_SCENARIO) --seed $(SEED) $(if $(RECOVERY),--recovery $(RECOVERY)) \
		$(if $(FAULT_EVERY_S),--fault-every-s $(FAULT_EVERY_S))

bench: setup
	$(RUN_ENV) $(PY) bench/strategies.py

plan: setup
	$(PY) -m ftrain plan configs/demo.toml --world-size 8

# ftrain on one CUDA device in under 8 minutes, one JSON line at the end (docs/gpu.md); without
# CUDA (or with GPU_CHECK_ARGS=--dry) the dry run: the same checks on the CPU, in under a minute
GPU_CHECK_ARGS ?=
gpu-check: setup
	$(RUN_ENV) $(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

docs: setup
	$(PY) scripts/update_config_reference.py docs/configuration.md
	$(PY) scripts/render_examples.py

clean:
	rm -rf $(VENV) runs .pytest_cache
