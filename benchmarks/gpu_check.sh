#!/usr/bin/env bash
# The GPU check: a few GRPO steps of a random-initialised model of Qwen2.5-0.5B's shape on one
# NVIDIA GPU, with each rollout engine that is installed (hf always, vllm when importable) and
# TRL 1.16 on the same work when it is installed or its wheels are carried, printing step time,
# generated tokens per second and peak GPU memory side by side (benchmarks/vs_trl.py). Data
# parallelism is not in it: NCCL needs one GPU per rank, and its equivalence with one process is
# tested on the CPU (gloo) by `make test` (tests/backends/test_distributed.py).
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from the repository root
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SHAPE=qwen-tiny bash benchmarks/gpu_check.sh   # a dry run on a CPU
#
# For a machine with no network: torch, transformers and peft must be there; grpo itself runs
# from src/ (PYTHONPATH), and wheels of anything else (trl, accelerate, datasets, ...) may be put
# in benchmarks/gpu_wheels/ beforehand (`pip download -d benchmarks/gpu_wheels trl==1.16.*`),
# installed from there with --no-index. Meant to finish in under 5 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SHAPE=${GPU_CHECK_SHAPE:-qwen2.5-0.5b}
STEPS=${GPU_CHECK_STEPS:-3}
LENGTH=${GPU_CHECK_COMPLETION_LENGTH:-256}
WHEELS=benchmarks/gpu_wheels
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) (device $DEVICE, shape $SHAPE)"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" - <<'EOF'
import platform, torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")
EOF

if [ -d "$WHEELS" ] && ! "$PYTHON" -c "import trl" 2>/dev/null; then
    echo "== installing carried wheels from $WHEELS"
    "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "trl==1.16.*" \
        || echo "(the carried wheels did not install: TRL's side is left out)"
fi

SIDES=grpo
if "$PYTHON" -c "import trl" 2>/dev/null; then SIDES="trl,grpo"; else echo "(TRL is not installed: its side is left out)"; fi
VLLM=()
if [ "$DEVICE" = cuda ] && "$PYTHON" -c "import vllm" 2>/dev/null; then
    VLLM=(--vllm --vllm-python "$PYTHON")
else
    echo "(vllm is not importable here, or the device is not a GPU: the vllm engine's row is left out)"
fi

echo "== a random-initialised $SHAPE model"
"$PYTHON" benchmarks/random_model.py --shape "$SHAPE" --out "$WORK/model" >/dev/null

echo "== GRPO steps: $SIDES ${VLLM[*]:+and grpo with vllm}"
"$PYTHON" benchmarks/vs_trl.py --model "$WORK/model" --device "$DEVICE" --precision bf16 \
    --sides "$SIDES" "${VLLM[@]}" --warmup 1 --steps "$STEPS" --repeats 1 \
    --max-completion-length "$LENGTH"
rm -rf "$WORK"
