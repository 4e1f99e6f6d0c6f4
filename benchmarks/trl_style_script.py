"""A GRPO training script as TRL users write it (GRPOConfig, GRPOTrainer, a reward function, a
dataset), run with TRL's trainer or with grpo's: the import is the argument.

    python benchmarks/trl_style_script.py --trainer trl  --shape qwen2.5-1.5b
    python benchmarks/trl_style_script.py --trainer grpo --shape qwen2.5-1.5b
    python benchmarks/trl_style_script.py --trainer grpo --shape qwen2.5-7b --lora 16 --prompts 8
    python benchmarks/trl_style_script.py --trainer grpo --shape qwen-tiny --prompts 2 \\
        --generations 4 --completion-length 16 --batch-size 4 --grad-accum 2   # seconds, on a CPU

Run each side in its own process (benchmarks/gpu_check.sh does), so that its peak memory is its
own. The model is a random-initialised one of the named shape (benchmarks/random_model.py), built
from one seed on the device it trains on: float32 weights for full fine-tuning (bf16=True is
autocast, as in TRL), a bfloat16 base under LoRA; the tokenizer is random_model's, one token per
character and the model's vocabulary size. The prompts are arithmetic problems, the reward the share
of digits in a completion (it varies between completions, so advantages are not all zero), and every
completion runs to max_completion_length tokens (`generation_kwargs={"min_new_tokens": T}`, which
both take). Only the import differs between the two sides.

What it prints, after the run (`RESULT {json}` last, for benchmarks/gpu_check.sh):

- the seconds of each optimizer step, between consecutive step ends (a TrainerCallback's
  on_step_end, after a CUDA synchronize; the first from on_train_begin), and their median over the
  steps after the `--warmup` ones;
- the peak memory: torch.cuda.max_memory_allocated over the whole process on a GPU, the peak
  resident set (ru_maxrss) on a CPU;
- the roofline multiple, when `--bandwidth` and `--peak-flops` are given: the median step over the
  time the step's work takes at those limits (benchmarks/vs_trl.py's step_roofline, every
  completion max_completion_length tokens):

      decode   = sum over the T-1 decode steps of max(FLOPs / peak, bytes / bandwidth), bytes = the
                 bf16 weights (layers + output layer) and the rows' KV cache, read once per step;
                 plus the prefill's FLOPs / peak
      update   = 3 x forward FLOPs (6 x matmul params x positions + attention) / peak, full
                 fine-tuning; LoRA: 2 x forward FLOPs (the frozen base's forward and its input
                 gradients, no weight gradients) + 6 x adapter params x positions, / peak
      multiple = median step s / (decode + update)

  Norms, activations, sampling, rewards, the optimizer's traffic and gradient checkpointing's
  recomputation are left out, so no trainer reaches 1.

`--exit-after-last-step` ends the process right after the last step's on_step_end (the result
printed first): grpo's train() writes final/ (weights and optimizer state) and its report after the
last step, which TRL with save_strategy="no" does not; the check leaves that tail out of both
sides' time. Without it, train() returns as usual and the tail is printed as `after_last_step_s`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GIB = 1024**3


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=("trl", "grpo"), required=True)
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="a random_model.SHAPES name")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--completion-length", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size")
    ap.add_argument("--grad-accum", type=int, default=8, help="gradient_accumulation_steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the median")
    ap.add_argument("--steps", type=int, default=2, help="steady steps after the warm-up")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--bandwidth", type=float, help="bytes/s, for the roofline (none: n/a)")
    ap.add_argument("--peak-flops", type=float, help="bf16 FLOP/s, for the roofline")
    ap.add_argument("--limits-label", default="", help="where --bandwidth/--peak-flops come from")
    ap.add_argument("--exit-after-last-step", action="store_true")
    ap.add_argument("--output-dir", help="the trainer's output_dir (default: a temporary one)")
    ap.add_argument("--result", type=Path, help="also write the RESULT json to this file")
    args = ap.parse_args(argv)
    if args.batch_size * args.grad_accum != args.prompts * args.generations:
        ap.error(
            f"--batch-size x --grad-accum ({args.batch_size} x {args.grad_accum}) must be the "
            f"completions per step, --prompts x --generations ({args.prompts} x {args.generations})"
        )
    return args


# ---------------------------------------------------------------- what a user's script holds

COMPLETION_TOKENS: list[int] = []
"""Completion tokens the reward function saw, one entry per call (a check that every completion
ran to max_completion_length on both sides)."""


def digit_share(completions, completion_ids=None, **kwargs):
    """The share of digits in each completion: a reward with variance for a random model."""
    if completion_ids is not None:
        COMPLETION_TOKENS.append(sum(len(ids) for ids in completion_ids))
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` problems `a + b = ` with two-digit a and b: every prompt the same token length."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a} + {b} = ", "answer": str(a + b)})
    return rows


def train(args, model, tokenizer, callbacks, output_dir: str, device: str):
    if args.trainer == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo import GRPOConfig, GRPOTrainer
    from datasets import Dataset

    T = args.completion_length
    steps = args.warmup + args.steps
    dataset = Dataset.from_list(arithmetic_rows(max(256, 2 * steps * args.prompts)))
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        num_generations=args.generations,
        max_completion_length=T,
        # every completion exactly T tokens: no EOS before its last
        generation_kwargs={"min_new_tokens": T},
        learning_rate=1e-6,
        bf16=True,
        use_cpu=device == "cpu",  # TRL refuses bf16 on a machine without a GPU otherwise
        max_steps=steps,
        save_strategy="no",
        report_to="none",
        seed=42,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora,
            lora_alpha=2 * args.lora,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_share,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


# ---------------------------------------------------------------- the measurement around it


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_memory(device: str) -> tuple[float, str]:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / GIB, "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, "peak RSS (ru_maxrss)"


def adapter_params(model, rank: int) -> int:
    """Parameters of LoRA adapters of rank `rank` on every Linear but the output layer (peft's
    all-linear): rank x (in + out) each."""
    import torch

    out = model.get_output_embeddings()
    return sum(
        rank * (m.in_features + m.out_features)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not out
    )


def roofline(args, shape: dict, prompt_len: int, adapters: int) -> dict | None:
    """The step's time at --bandwidth and --peak-flops (module docstring), or None without them."""
    if not (args.bandwidth and args.peak_flops):
        return None
    from vs_trl import step_roofline

    rows = args.prompts * args.generations
    T = args.completion_length
    decode, update = step_roofline(
        shape,
        [prompt_len] * rows,
        [T] * rows,
        element_bytes=2,
        peak_flops=args.peak_flops,
        bandwidth=args.bandwidth,
        update_passes=2.0 if args.lora else 3.0,
    )
    update += 6.0 * adapters * rows * (prompt_len + T - 1) / args.peak_flops
    return {"decode_s": decode, "update_s": update, "limit_s": decode + update}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from random_model import random_model
    from transformers import TrainerCallback
    from vs_trl import model_shape

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t_start = time.perf_counter()
    dtype = torch.bfloat16 if args.lora else torch.float32
    model, tokenizer = random_model(args.shape, args.seed, device, dtype)
    shape = model_shape(model)
    adapters = adapter_params(model, args.lora) if args.lora else 0
    prompt_len = len(tokenizer(arithmetic_rows(1)[0]["prompt"]).input_ids)
    limits = roofline(args, shape, prompt_len, adapters)
    total = args.warmup + args.steps
    work = (
        f"{args.shape} shape, "
        + (f"LoRA r={args.lora} all-linear on a bf16 base" if args.lora else "full fine-tuning")
        + f", {args.prompts} prompts x {args.generations} completions x "
        f"{args.completion_length} tokens, per_device_train_batch_size {args.batch_size}, "
        f"gradient_accumulation_steps {args.grad_accum}, bf16"
    )
    result = {
        "trainer": args.trainer,
        "work": work,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else None,
        "shape": args.shape,
        "lora": args.lora,
        "params": shape["total_params"],
        "adapter_params": adapters,
        "prompt_tokens": prompt_len,
        "expected_completion_tokens_per_step": args.prompts
        * args.generations
        * args.completion_length,
        "warmup": args.warmup,
        "step_s": [],
        "roofline": limits,
        "limits_label": args.limits_label if limits else None,
    }

    def summarize(trainer_s: float | None = None) -> None:
        steady = result["step_s"][args.warmup :]
        result["median_steady_s"] = statistics.median(steady) if steady else None
        result["peak_gib"], result["peak_kind"] = peak_memory(device)
        calls = len(COMPLETION_TOKENS)
        result["completion_tokens_per_step"] = sum(COMPLETION_TOKENS) / calls if calls else None
        result["wall_s"] = time.perf_counter() - t_start
        if trainer_s is not None:
            result["after_last_step_s"] = trainer_s
        if limits and result["median_steady_s"]:
            result["roofline_multiple"] = result["median_steady_s"] / limits["limit_s"]
        if args.result:  # after every step: a side cut at its time limit keeps what it measured
            args.result.write_text(json.dumps(result, indent=1) + "\n")

    def finish(trainer_s: float | None = None) -> None:
        summarize(trainer_s)
        steps_text = ", ".join(f"{s:.2f}" for s in result["step_s"])
        print(f"\n== {args.trainer}: {work}")
        print(f"   steps s: {steps_text} (the first {args.warmup} warm-up)")
        if result["median_steady_s"] is not None:
            print(f"   median steady step s: {result['median_steady_s']:.2f}")
        print(f"   peak: {result['peak_gib']:.2f} GiB ({result['peak_kind']})")
        if limits:
            print(
                f"   roofline ({args.limits_label}): decode {limits['decode_s']:.3g} s + update "
                f"{limits['update_s']:.3g} s = {limits['limit_s']:.3g} s; "
                f"multiple {result.get('roofline_multiple', float('nan')):.1f}"
            )
        if trainer_s is not None:
            print(f"   train() returned {trainer_s:.1f} s after the last step's end")
        per_step = result["completion_tokens_per_step"]
        if per_step != result["expected_completion_tokens_per_step"]:
            print(
                f"   WARNING: {per_step} completion tokens per step, "
                f"{result['expected_completion_tokens_per_step']} expected"
            )
        print("RESULT " + json.dumps(result), flush=True)
        sys.stderr.flush()

    class StepClock(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kwargs):
            _sync(device)
            self.t = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            _sync(device)
            now = time.perf_counter()
            result["step_s"].append(now - self.t)
            self.t = now
            summarize()
            if len(result["step_s"]) == total and args.exit_after_last_step:
                finish()
                os._exit(0)

    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="trl-style-") as tmp:
        train(args, model, tokenizer, [clock], args.output_dir or tmp, device)
        finish(time.perf_counter() - clock.t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
