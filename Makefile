# make demo   train the embedded model on the built-in arithmetic task
# make test   run the test suite (default: fast tests, under 10 minutes on 2 cores)
# Each target creates .venv and installs what it needs on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of PyTorch; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: demo test test-slow bench-tiny bench clean

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

# each demo run gets its own directory, so an earlier run is never overwritten
demo: $(VENV)/.runtime
	$(BIN)/grpo train examples/demo.yaml output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

test-slow: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m slow

# grpo vs TRL side by side in one run (TRL is a dev extra)
bench-tiny: $(VENV)/.dev
	$(BIN)/python benchmarks/vs_trl.py --model tiny --precision both

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/vs_trl.py --model gemma-3-270m --precision both

clean:
	rm -rf $(VENV) runs
