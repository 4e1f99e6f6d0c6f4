"""grpo's Trainer against TRL's GRPOTrainer, same model, prompts and work, in one run.

    python benchmarks/vs_trl.py                                # Gemma-3-270M, fp32
    python benchmarks/vs_trl.py --precision both               # fp32, then bf16 autocast
    python benchmarks/vs_trl.py --model tiny --precision both  # CI-sized, about a minute
    python benchmarks/vs_trl.py --precision bf16 --lora 16     # full fine-tuning, then LoRA r=16
    python benchmarks/vs_trl.py --precision bf16 --vllm        # + grpo with rollout.engine=vllm

Each side runs in its own child process (this script again, with `--side trl`
or `--side grpo`), so that its peak memory is its own. A child builds its
trainer, runs `--warmup` steps, then `--steps` measured steps, and writes a
JSON record; the parent runs the two sides' processes in alternation (TRL,
grpo, then grpo, TRL, ... `--repeats` pairs), so slow drifts of a shared
machine fall on both sides alike, and takes medians over all measured steps.

One step = one generation batch (4 prompts x 4 completions, each exactly
max_completion_length tokens, EOS ignored) + one optimizer step on it. See
benchmarks/README.md for what each column measures and how to read it.

A second table per run gives each side's roofline: the time each phase would take
at this machine's limits, both measured in the same run (at the start and at the
end, the best kept): the matmul peak of the precision (measure_peak_flops, the best of
a square product and one with a short inner dimension like the model's) and the
memory bandwidth, a 1 GiB streaming read (measure_bandwidth), with the torch
threads the sides use. From the model shape and each measured step's token counts
(step_roofline):

    generate = prefill FLOPs / peak
             + sum over decode steps t = 1 .. T-1 of max(FLOPs_t / peak, bytes_t / bandwidth)
    bytes_t  = E * (N_non_embedding + hidden * vocab)                  every weight, once per step
             + E * 2 * kv_width * sum_rows sum_layers min(p + t, window)  K and V the rows attend to
    update   = update FLOPs / peak;   step = generate + update

E is the bytes per element of the generation dtype: 2 under --precision bf16, 4
otherwise (on the grpo-vllm side, vLLM's model dtype). The output layer is read once
per step (with tied embeddings it is the embedding matrix; the input lookup is not
counted); kv_width = key heads x head dim. The table shows the measured times as
multiples of these.

`--lora R` adds LoRA rows after the full fine-tuning ones: the same rank, alpha
(`--lora-alpha`) and target modules (peft's all-linear) on both sides, TRL
through `GRPOTrainer(peft_config=peft.LoraConfig(...))`, grpo through
`model.lora`. In LoRA rows the update's FLOP count is 2x forward instead of 3x
(no gradient for the frozen base weights; the adapters' own products are not
counted), and "peak-state" subtracts gradients and Adam moments of the trainable
(adapter) weights only.

`--vllm` adds a third side, `grpo-vllm`: grpo's Trainer as on the grpo side with
rollout.engine=vllm (VLLM_SETTINGS), measured the same way (its own child
processes, in the same alternation, the same work and medians). vllm is not in
the main venv, so its children run with `--vllm-python` (default
.venv-vllm/bin/python, built by `make .venv-vllm/.dev`); the trl and grpo sides
keep this interpreter. Each grpo step, on both grpo sides, is what
Trainer.train_step does: collect_batch, engine.sleep(), update, then
engine.sync_weights (for vLLM the weight push, counted in "update"; nothing for
the hf engine). Not with --model tiny on the CPU (vLLM's CPU attention does not
support its head size, 16).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1024**3
SIDES = ("trl", "grpo")
VLLM_SIDE = "grpo-vllm"
"""grpo with rollout.engine: vllm (--vllm), run by the interpreter of a venv with vllm in it."""
LABELS = {"trl": "TRL", "grpo": "grpo", VLLM_SIDE: VLLM_SIDE}
RATIOS = (("grpo", "trl"), (VLLM_SIDE, "trl"), (VLLM_SIDE, "grpo"))
"""The ratio rows of the table (numerator, denominator), those whose sides ran."""
PRECISIONS = ("fp32", "bf16")
DEV_HINT = 'pip install -e ".[dev]"'
VLLM_VENV = REPO / ".venv-vllm"
VLLM_HINT = "make .venv-vllm/.dev"
VLLM_SETTINGS = {"kv_cache_gb": 1.0, "enforce_eager": True}
"""rollout.vllm of the grpo-vllm side: vLLM's CPU build needs a fixed KV cache size (1 GiB holds
Gemma-3-270M's longest sequence, which vLLM requires at start); eager, as tests/rollout/test_vllm.py
runs it (no torch.compile of the model)."""

# Work per step; both sides get exactly these values.
NUM_PROMPTS = 4
NUM_GENERATIONS = 4
DEFAULT_COMPLETION_LENGTH = {"gemma-3-270m": 64, "tiny": 16}
BANDWIDTH_BYTES = 1 << 30
"""The streaming read of measure_bandwidth: 1 GiB, several times the last-level cache of the machines
it has run on (300 MiB L3 on the 2-core Xeon)."""


class BenchmarkError(RuntimeError):
    """A problem the user can fix; printed without a traceback."""


# ----------------------------------------------------------------------------
# Small helpers shared by parent and children
# ----------------------------------------------------------------------------


def _status_kb(key: str) -> int | None:
    """A `Vm...` line of /proc/self/status, in kB (None where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _gb_from_kb(kb: int | None) -> float | None:
    return None if kb is None else kb * 1024 / GB


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median(xs):
    return statistics.median(xs) if xs else math.nan


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchmarkError("--device cuda: no CUDA device is available; use --device cpu")
    return name


# ----------------------------------------------------------------------------
# FLOP model (the same count for both sides)
# ----------------------------------------------------------------------------


def model_shape(model) -> dict:
    """What the FLOP count needs from the model; shared (tied) weights counted once, LoRA
    adapters left out (the base model's shape, the same for both sides)."""
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    # deduplicated: a tied embedding appears once
    params = [p for name, p in model.named_parameters() if "lora_" not in name]
    total = sum(p.numel() for p in params)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    tied = out is emb  # tie_weights() shares the Parameter object
    non_embedding = total - emb.numel() - (0 if tied else out.numel())
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
    windows = [window if (t == "sliding_attention" and window) else None for t in layer_types]
    return {
        "model_type": cfg.model_type,
        "total_params": total,
        "non_embedding_params": non_embedding,
        "hidden_size": cfg.hidden_size,
        "vocab_size": out.shape[0],
        "num_layers": layers,
        "attention_width": heads * head_dim,  # query heads x head dim
        "kv_width": kv_heads
        * head_dim,  # key (or value) heads x head dim: one layer's K (or V) per position
        "layer_windows": windows,
        "tied_embeddings": tied,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def sequence_forward_flops(shape: dict, prompt_len: int, completion_len: int) -> float:
    """FLOPs of one forward pass that yields the logits for every completion token.

    Positions 1 .. p+T-1 go through the decoder (the hidden state at position j
    predicts token j+1; the last completion token is never an input), and the
    output layer runs at the T positions that predict a completion token:

        (p + T - 1) * 2 * N_non_embedding          matmuls of the layers
      + sum_j sum_layers 4 * attention_width * ctx_j   QK^T and AV, ctx_j = keys seen
      + T * 2 * hidden * vocab                      output layer (logits)

    Generation does exactly this work (prefill of p positions + T-1 decode steps,
    one logit row per generated token); the update does it forward + backward
    (x3). Norms, activations, softmax and the embedding lookup are not counted.
    """
    n = prompt_len + completion_len - 1
    linear = 2.0 * shape["non_embedding_params"] * n
    attention = 0.0
    for window in shape["layer_windows"]:
        if window is None or window >= n:
            keys = n * (n + 1) / 2  # causal: position j sees j keys
        else:
            keys = window * (window + 1) / 2 + (n - window) * window
        attention += 4.0 * shape["attention_width"] * keys
    logits = 2.0 * shape["hidden_size"] * shape["vocab_size"] * completion_len
    return linear + attention + logits


def step_flops(
    shape: dict,
    prompt_lengths: list[int],
    completion_lengths: list[int],
    update_passes: float = 3.0,
) -> tuple[float, float]:
    """(generation FLOPs, update FLOPs) of one step: every sequence prefilled and trained on in full.
    The update is forward + backward: 3 forwards with weight gradients, 2 without (LoRA's frozen base)."""
    forward = sum(
        sequence_forward_flops(shape, p, c) for p, c in zip(prompt_lengths, completion_lengths)
    )
    return forward, update_passes * forward


def decode_bytes(shape: dict, contexts: list[int], element_bytes: int) -> float:
    """Bytes one decode step reads: every weight once (the rows share the step's matmuls) plus each
    row's KV cache. Weights: the decoder layers and the output layer (hidden x vocab; with tied
    embeddings the same matrix, read once; the input embedding lookup reads one row per token, not
    counted). KV cache: K and V of every layer for the `contexts[i]` keys row i attends to (at most a
    sliding layer's window)."""
    weights = shape["non_embedding_params"] + shape["hidden_size"] * shape["vocab_size"]
    keys = sum(min(ctx, window or ctx) for ctx in contexts for window in shape["layer_windows"])
    return element_bytes * (weights + 2 * shape["kv_width"] * keys)


def step_roofline(
    shape: dict,
    prompt_lengths: list[int],
    completion_lengths: list[int],
    element_bytes: int,
    peak_flops: float,
    bandwidth: float,
    update_passes: float = 3.0,
) -> tuple[float, float]:
    """(generation s, update s) of one step at the machine's limits. Generation: the prefill (every
    prompt, up to the first completion token's logits) at the matmul peak, then each decode step t
    (feeding completion token t, so a row attends to p + t keys) at the slower of its FLOPs / peak
    and its bytes read (decode_bytes) / bandwidth. Update: its FLOPs / peak."""
    rows = list(zip(prompt_lengths, completion_lengths))
    prefill = sum(sequence_forward_flops(shape, p, 1) for p, _ in rows)
    generate = prefill / peak_flops
    for t in range(1, max(completion_lengths, default=0)):
        active = [(p, c) for p, c in rows if c > t]
        # one more position per row: the difference of two forward counts
        flops = sum(
            sequence_forward_flops(shape, p, t + 1) - sequence_forward_flops(shape, p, t)
            for p, _ in active
        )
        read = decode_bytes(shape, [p + t for p, _ in active], element_bytes)
        generate += max(flops / peak_flops, read / bandwidth)
    _, update = step_flops(shape, prompt_lengths, completion_lengths, update_passes)
    return generate, update / peak_flops


def trainable_bytes(model) -> int:
    """Bytes of the weights the optimizer updates (all of them, or the LoRA adapters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def lora_label(spec: dict) -> str:
    return (
        f"LoRA r={spec['lora_r']}, alpha={spec['lora_alpha']:g}, all-linear"
        if spec.get("lora_r")
        else "full fine-tuning"
    )


def peak_shapes(size: int) -> list[tuple[int, int, int]]:
    """(m, k, n) products measure_peak_flops tries: size^3, and size/2 x 640 x 2 size, the short
    inner dimension of a small model's products (on the 2-core Xeon with AMX, bf16 products with
    k = 640 ran at up to 2,100 GFLOP/s while 2048^3 gave 650-1,800 in the same minutes)."""
    return [(size, size, size), (size // 2, 640, 2 * size)]


def measure_peak_flops(dtype_name: str, device: str, size: int, repeats: int) -> tuple[float, str]:
    """Best-of-`repeats` FLOP/s of matmuls in `dtype_name` over peak_shapes(size) (the machine's
    practical peak), and the kernel and shape that reached it. On the CPU both torch's default
    (`a @ b`: MKL for float32) and oneDNN (`grpo.cpu.kernels.linear_nt`) are tried, so
    that neither side can exceed 100% of the peak."""
    import torch

    from grpo.cpu.kernels import linear_nt, onednn_available

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    inner = 10 if device == "cuda" else 1
    results = {}
    for m, k, n in peak_shapes(size):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        kernels = {"torch matmul": lambda a=a, b=b: a @ b}
        if device == "cpu" and dtype == torch.float32 and onednn_available():
            bt = b.t().contiguous()
            kernels["oneDNN"] = lambda a=a, bt=bt: linear_nt(a, bt)
        for name, product in kernels.items():
            product()  # warm-up (thread pool, kernels)
            _sync(device)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(inner):
                    product()
                _sync(device)
                best = min(best, (time.perf_counter() - t0) / inner)
            results[f"{name}, {m}x{k}x{n}"] = 2.0 * m * k * n / best
    name = max(results, key=results.get)
    return results[name], name


def measure_bandwidth(device: str, nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Best-of-`repeats` bytes/s of a streaming read: the sum of a float32 tensor of `nbytes`
    (larger than the caches), with the torch threads the sides use."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    inner = 10 if device == "cuda" else 1
    x.sum()  # warm-up (pages, thread pool, kernels)
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            x.sum()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / inner)
    return x.numel() * x.element_size() / best


def measure_limits(precisions, device: str, size: int, repeats: int) -> dict:
    """{precision: (matmul FLOP/s, its kernel, memory bytes/s)}, measured now."""
    bandwidth = measure_bandwidth(device, repeats=repeats)
    return {p: (*measure_peak_flops(p, device, size, repeats), bandwidth) for p in precisions}


# ----------------------------------------------------------------------------
# Child process: one side, W + S steps
# ----------------------------------------------------------------------------


class _DtypeProbe:
    """Records the output dtype of one decoder Linear per phase: shows whether
    bf16 autocast is really in effect in generation and in the update."""

    def __init__(self, model):
        import torch

        self.phase = "setup"
        self.seen: dict[str, set[str]] = {}
        target = next(
            (
                m
                for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and "lm_head" not in name
            ),
            None,
        )
        if target is not None:
            target.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.record(self.phase, output.dtype)

    def record(self, phase: str, dtype) -> None:
        self.seen.setdefault(phase, set()).add(str(dtype).replace("torch.", ""))

    def watch_fused_decoding(self) -> None:
        """grpo's CPU rollouts (bf16 and float32) compute through grpo.cpu.fused_decoding's
        products, not the Linear modules: record theirs too."""
        from grpo.cpu import fused_decoding as fused

        original, probe = fused._Product.__call__, self

        def call(product, x):
            out = original(product, x)
            probe._hook(None, (x,), out)
            return out

        fused._Product.__call__ = call

    def report(self) -> dict[str, list[str]]:
        return {k: sorted(v) for k, v in self.seen.items()}


class _Recorder:
    """Per-step timings and memory in a child, identical for both sides."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.device = spec["device"]
        self.steps: list[dict] = []
        self.memory: dict = {}
        self.generate_s = 0.0
        self.lengths: tuple[list[int], list[int]] = ([], [])
        self._t0 = 0.0

    def after_load(self):
        self.memory["after_load_rss_gb"] = _gb_from_kb(_status_kb("VmRSS"))

    def begin(self):
        _sync(self.device)
        self.generate_s = 0.0
        self._t0 = time.perf_counter()

    def end(self, index: int):
        """Call after the optimizer step (and zero_grad): the state held between steps."""
        import torch

        _sync(self.device)
        step_s = time.perf_counter() - self._t0
        warmup = index < self.spec["warmup"]
        prompt_lengths, completion_lengths = self.lengths
        self.steps.append(
            {
                "index": index,
                "warmup": warmup,
                "step_s": step_s,
                "generate_s": self.generate_s,
                "update_s": step_s - self.generate_s,
                "prompt_lengths": prompt_lengths,
                "completion_lengths": completion_lengths,
                "rss_gb": _gb_from_kb(_status_kb("VmRSS")),
            }
        )
        if (
            index == self.spec["warmup"] - 1
        ):  # end of the warm-up: steady state, then measure peaks from here
            m = self.memory
            m["steady_rss_gb"] = _gb_from_kb(_status_kb("VmRSS"))
            m["peak_rss_through_warmup_gb"] = _gb_from_kb(_status_kb("VmHWM"))
            m["hwm_reset"] = _reset_peak_rss()
            if self.device == "cuda":
                m["steady_cuda_gb"] = torch.cuda.memory_allocated() / GB
                torch.cuda.reset_peak_memory_stats()
        if index == self.spec["warmup"] + self.spec["steps"] - 1:  # last measured step
            m = self.memory
            m["train_peak_rss_gb"] = _gb_from_kb(_status_kb("VmHWM"))
            m["process_peak_rss_gb"] = max(
                m["train_peak_rss_gb"] or 0, m["peak_rss_through_warmup_gb"] or 0
            )
            if self.device == "cuda":
                m["train_peak_cuda_gb"] = torch.cuda.max_memory_allocated() / GB


def _rows(spec: dict) -> list[dict]:
    """The seed's arithmetic training problems as plain-text prompts (no chat template)."""
    from grpo.config.model_data import ArithmeticConfig
    from grpo.tasks.data import arithmetic_splits, render_prompt

    train, _ = arithmetic_splits(ArithmeticConfig(), seed=spec["data_seed"])
    # render_prompt without a template joins the message contents: "<instruction>\n"
    return [
        {"prompt": render_prompt(r["prompt"], None, False, None)[0], "answer": r["answer"]}
        for r in train
    ]


def _optimizer_name(optimizer) -> str:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    fused = inner.param_groups[0].get("fused")
    return type(inner).__name__ + (" (fused)" if fused else "")


def _set_threads(spec: dict) -> None:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])


def _versions() -> dict[str, str | None]:
    """The versions of the libraries a side ran with (the vLLM side's venv has its own); None
    for one the side did not import."""
    return {
        name: getattr(sys.modules.get(name), "__version__", None)
        for name in ("torch", "transformers", "trl", "vllm")
    }


def _side_result(
    rec, shape: dict, probe, setup_s: float, optimizer, autocast: str, trained_bytes: int
) -> dict:
    """What a child reports to the parent (the same fields for every side)."""
    return {
        "python": sys.executable,
        "versions": _versions(),
        "shape": shape,
        "trainable_bytes": trained_bytes,
        "steps": rec.steps,
        "memory": rec.memory,
        "compute_dtypes": probe.report(),
        "setup_s": setup_s,
        "optimizer": _optimizer_name(optimizer),
        "autocast": autocast,
    }


def run_trl(spec: dict, out_dir: Path) -> dict:
    rec = _Recorder(spec)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.rewards.arithmetic import arithmetic_correct

    _set_threads(spec)
    rec.memory["baseline_rss_gb"] = _gb_from_kb(_status_kb("VmRSS"))
    t_setup = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    shape = model_shape(model)
    probe = _DtypeProbe(model)
    dataset = Dataset.from_list(_rows(spec))
    T = spec["max_completion_length"]
    W, S = spec["warmup"], spec["steps"]
    args = GRPOConfig(
        output_dir=str(out_dir),
        # the work: 4 prompts x 4 completions, one optimizer step per generation batch
        per_device_train_batch_size=NUM_PROMPTS * NUM_GENERATIONS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=NUM_GENERATIONS,
        num_iterations=1,
        max_steps=W + S,
        max_completion_length=T,
        # exactly T tokens: EOS may not be sampled before T tokens (MinNewTokensLengthLogitsProcessor)
        generation_kwargs={"min_new_tokens": T},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # the algorithm, as in grpo's defaults
        beta=0.0,
        loss_type=spec["loss_type"],
        scale_rewards="group",
        epsilon=0.2,
        mask_truncated_completions=False,
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        seed=spec["seed"],
        # precision: fp32 weights, bf16 autocast (accelerate) when bf16
        bf16=spec["precision"] == "bf16",
        fp16=False,
        use_cpu=spec["device"] == "cpu",
        gradient_checkpointing=False,  # GRPOConfig defaults to True; grpo to False
        # no logging, saving or evaluation work inside the steps
        use_vllm=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )

    class StepTimer(TrainerCallback):
        # on_step_begin: before the step's training_step (which generates, via _prepare_inputs);
        # on_step_end: after clipping, optimizer.step(), scheduler.step() and model.zero_grad().
        def on_step_begin(self, args, state, control, **kwargs):
            probe.phase = "update"
            rec.begin()

        def on_step_end(self, args, state, control, **kwargs):
            rec.end(state.global_step - 1)

    peft_config = None
    if spec.get("lora_r"):
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=spec["lora_r"],
            lora_alpha=spec["lora_alpha"],
            lora_dropout=0.0,
            target_modules="all-linear",
            bias="none",
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic_correct],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
        peft_config=peft_config,
    )
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs):
        # generation + decoding + rewards + advantages: the same scope as grpo's collect_batch()
        _sync(spec["device"])
        probe.phase = "generate"
        t0 = time.perf_counter()
        output = generate_and_score(inputs)
        _sync(spec["device"])
        rec.generate_s += time.perf_counter() - t0
        probe.phase = "update"
        rec.lengths = (
            output["prompt_mask"].sum(-1).tolist(),
            output["completion_mask"].sum(-1).tolist(),
        )
        return output

    trainer._generate_and_score_completions = timed_generate_and_score
    rec.after_load()
    setup_s = time.perf_counter() - t_setup
    trainer.train()
    return _side_result(
        rec,
        shape,
        probe,
        setup_s,
        trainer.optimizer,
        str(getattr(trainer.accelerator, "mixed_precision", None)),
        trainable_bytes(trainer.model),
    )


def grpo_trainer(spec: dict, out_dir: Path, engine: str = "hf"):
    """grpo's Trainer for the benchmark's work (`spec`: base_spec's keys and the precision)."""
    from grpo.config import loading as grpo_config
    from grpo.training.trainer import Trainer

    T = spec["max_completion_length"]
    W, S = spec["warmup"], spec["steps"]
    cfg = grpo_config.from_dict(
        {
            "output_dir": str(out_dir),
            "model": {
                "name": spec["model_dir"],
                "dtype": "float32",
                "lora": {
                    "r": spec.get("lora_r", 0),
                    "alpha": spec.get("lora_alpha", 16.0),
                    "dropout": 0.0,
                    "target_modules": ["all-linear"],
                },
            },
            "data": {"chat_template": "never", "seed": spec["data_seed"]},
            "rollout": {
                "num_generations": NUM_GENERATIONS,
                "max_completion_length": T,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "ignore_eos": True,
                "engine": engine,
                "vllm": VLLM_SETTINGS,  # read only by the vllm engine
            },
            "rewards": {"funcs": ["arithmetic_correct"]},
            "algorithm": {
                "beta": 0.0,
                "loss_type": spec["loss_type"],
                "scale_rewards": "group",
                "epsilon": 0.2,
                "num_iterations": 1,
                "mask_truncated_completions": False,
            },
            "training": {
                "max_steps": W + S,
                "per_device_train_batch_size": NUM_PROMPTS * NUM_GENERATIONS,
                "microbatch_tokens": spec["microbatch_tokens"],
                "gradient_accumulation_steps": 1,
                "learning_rate": spec["learning_rate"],
                "lr_scheduler_type": "linear",
                "warmup_steps": 0,
                "weight_decay": 0.0,
                "max_grad_norm": 1.0,
                "bf16": spec["precision"] == "bf16",
                "gradient_checkpointing": False,
                "seed": spec["seed"],
                "device": spec["device"],
            },
            "logging": {"sample_every": 0},
        }
    )
    return Trainer.from_config(cfg, train_rows=_rows(spec))


def run_grpo(spec: dict, out_dir: Path, engine: str = "hf") -> dict:
    rec = _Recorder(spec)
    import torch  # noqa: F401

    _set_threads(spec)
    rec.memory["baseline_rss_gb"] = _gb_from_kb(_status_kb("VmRSS"))
    t_setup = time.perf_counter()
    W, S = spec["warmup"], spec["steps"]
    trainer = grpo_trainer(spec, out_dir, engine)
    shape = model_shape(trainer.model)
    probe = _DtypeProbe(trainer.model)
    probe.watch_fused_decoding()
    if engine == "vllm":  # vLLM generates with its own copy of the model, not the policy's modules
        probe.record("generate", trainer.engine.llm.llm_engine.model_config.dtype)
    rec.after_load()
    setup_s = time.perf_counter() - t_setup
    for index in range(W + S):
        rec.begin()
        probe.phase = "generate"
        _sync(spec["device"])
        t0 = time.perf_counter()
        batch = trainer.collect_batch()  # generation + decoding + rewards + advantages
        _sync(spec["device"])
        rec.generate_s = time.perf_counter() - t0
        probe.phase = "update"
        trainer.engine.sleep()  # as Trainer.train_step: nothing to do for the hf engine and on the CPU
        # logprobs, loss, backward, clipping, optimizer.step(), scheduler.step()
        trainer.update(batch)
        trainer.engine.sync_weights(trainer.model)  # vllm: the new weights pushed into vLLM's copy
        trainer.state.step += 1
        ro = batch.rollout
        rec.lengths = (ro.prompt_mask.sum(-1).tolist(), ro.completion_mask.sum(-1).tolist())
        rec.end(index)
    return _side_result(
        rec,
        shape,
        probe,
        setup_s,
        trainer.state.optimizer,
        "bf16" if trainer.cfg.training.bf16 else "no",
        trainable_bytes(trainer.model),
    )


def child_main(args) -> int:
    if (
        args.side != "trl"
    ):  # as grpo's CLI does for a run with the CPU layer (grpo.cpu.memory.use_huge_pages)
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    spec = json.loads(Path(args.spec).read_text())
    run = {"trl": run_trl, "grpo": run_grpo, VLLM_SIDE: functools.partial(run_grpo, engine="vllm")}[
        args.side
    ]
    with tempfile.TemporaryDirectory(prefix=f"vs_trl-{args.side}-") as tmp:
        result = run(spec, Path(tmp))
    result["side"] = args.side
    result["pid"] = os.getpid()
    Path(args.result).write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------
# Parent: prepare the model, run the sides in alternation, print the table
# ----------------------------------------------------------------------------


def check_dependencies(sides: tuple[str, ...]) -> None:
    missing = [
        m
        for m in ("trl", "datasets", "accelerate")
        if "trl" in sides and importlib.util.find_spec(m) is None
    ]
    if missing:
        raise BenchmarkError(
            f"the benchmark runs TRL's GRPOTrainer as the peer and needs {', '.join(missing)}, "
            f"which {'is' if len(missing) == 1 else 'are'} not installed: {DEV_HINT} (or leave it out: --sides grpo)"
        )
    if importlib.util.find_spec("grpo") is None:
        raise BenchmarkError(
            f"the grpo package is not importable: run from the repository's venv ({DEV_HINT})"
        )


def prepare_model(name: str, workdir: Path) -> tuple[Path, str]:
    """A save_pretrained directory that both sides load (and a short label for file names)."""
    from grpo.config.errors import ConfigError
    from grpo.config.model_data import ModelConfig

    if name == "tiny":
        from transformers.utils import logging as hf_logging

        from grpo.models import tiny

        hf_logging.disable_progress_bar()
        cfg = ModelConfig(name="tiny")
        tokenizer = tiny.char_tokenizer()
        model = tiny.tiny_model(tokenizer, cfg.tiny_hidden_size, cfg.tiny_num_layers, seed=0)
        directory = workdir / "tiny-model"
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        return directory, "tiny"
    if name == "gemma-3-270m":
        from grpo.models.loading import convert_gguf, embedded_gguf_path

        try:
            return convert_gguf(embedded_gguf_path()), "gemma-3-270m"
        except ConfigError as e:
            raise BenchmarkError(
                f"--model gemma-3-270m: the embedded model is not available ({e}); or use --model tiny"
            ) from None
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve(), path.name
    raise BenchmarkError(
        f"--model {name}: expected tiny, gemma-3-270m or a directory written by save_pretrained (with config.json)"
    )


def vllm_interpreter(python: str | None, device: str, model: str) -> str:
    """The interpreter that runs the grpo-vllm side: --vllm-python, or .venv-vllm's."""
    if model == "tiny" and device == "cpu":
        raise BenchmarkError(
            "--vllm: vLLM's CPU attention does not support the tiny model's head size (16); "
            "use --model gemma-3-270m (or a save_pretrained directory with head size 32 or more)"
        )
    path = (
        Path(python) if python else VLLM_VENV / "bin" / "python"
    ).absolute()  # not resolved: a venv's python is a link
    if not path.is_file():
        raise BenchmarkError(
            f"--vllm: no Python interpreter at {path}; build the vllm venv with `{VLLM_HINT}` "
            "(or pass --vllm-python PATH, an interpreter with vllm and grpo installed)"
        )
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None or u.find_spec('grpo') is None)"
    if subprocess.run([str(path), "-c", probe]).returncode != 0:
        raise BenchmarkError(
            f"--vllm: {path} cannot import vllm and grpo; build the vllm venv with `{VLLM_HINT}`"
        )
    return str(path)


def run_child(side: str, spec: dict, workdir: Path, label: str, verbose: bool, python: str) -> dict:
    spec_path = workdir / f"spec-{label}.json"
    result_path = workdir / f"result-{label}.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--side",
        side,
        "--spec",
        str(spec_path),
        "--result",
        str(result_path),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=not verbose, text=True)
    if proc.returncode != 0 or not result_path.is_file():
        tail = "" if verbose else "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
        raise BenchmarkError(f"the {side} side failed (exit code {proc.returncode}):\n{tail}")
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.perf_counter() - t0
    return result


def _measured(results: list[dict]) -> list[dict]:
    """The measured (not warm-up) steps of a side's processes."""
    return [s for r in results for s in r["steps"] if not s["warmup"]]


def summarize_side(results: list[dict], shape: dict, device: str, lora: bool = False) -> dict:
    """A side's medians and memory; what depends on the machine's limits is added by apply_limits."""
    measured = _measured(results)
    gen_flops, upd_flops, rates = [], [], []
    for s in measured:
        g, u = step_flops(shape, s["prompt_lengths"], s["completion_lengths"], 2.0 if lora else 3.0)
        gen_flops.append(g)
        upd_flops.append(u)
        rates.append((g + u) / s["step_s"])
    mems = [r["memory"] for r in results]
    if device == "cuda":
        peak = max(m.get("train_peak_cuda_gb", math.nan) for m in mems)
        transient = max(m["train_peak_cuda_gb"] - m["steady_cuda_gb"] for m in mems)
        over_state = max(
            m["train_peak_cuda_gb"] - (shape["param_bytes"] + 3 * r["trainable_bytes"]) / GB
            for m, r in zip(mems, results)
        )
    else:
        peak = max(m["process_peak_rss_gb"] for m in mems)
        transient = max(m["train_peak_rss_gb"] - m["steady_rss_gb"] for m in mems)
        # on top of the trainer as built (libraries + weights): grads + Adam's two moments (fp32, like the weights)
        over_state = max(
            m["train_peak_rss_gb"] - m["after_load_rss_gb"] - 3 * r["trainable_bytes"] / GB
            for m, r in zip(mems, results)
        )
    step_s = _median([s["step_s"] for s in measured])
    generate_s = _median([s["generate_s"] for s in measured])
    update_s = _median([s["update_s"] for s in measured])
    gflops = _median(rates) / 1e9
    return {
        "step_s": step_s,
        "generate_s": generate_s,
        "update_s": update_s,
        "peak_gb": peak,
        "transient_gb": transient,
        "peak_over_state_gb": over_state,
        "gflops": gflops,
        "generate_gflops": _median([f / s["generate_s"] for f, s in zip(gen_flops, measured)])
        / 1e9,
        "update_gflops": _median([f / s["update_s"] for f, s in zip(upd_flops, measured)]) / 1e9,
        "step_gflop": _median([g + u for g, u in zip(gen_flops, upd_flops)]) / 1e9,
        "measured_steps": len(measured),
        "step_s_all": [s["step_s"] for s in measured],
        "generate_s_all": [s["generate_s"] for s in measured],
        "update_s_all": [s["update_s"] for s in measured],
        "tokens_per_step": sorted(
            {sum(s["prompt_lengths"]) + sum(s["completion_lengths"]) for s in measured}
        ),
        "completion_lengths": sorted({c for s in measured for c in s["completion_lengths"]}),
        "compute_dtypes": results[0]["compute_dtypes"],
        "optimizer": results[0].get("optimizer"),
        "autocast": results[0].get("autocast"),
        "hwm_reset": all(m.get("hwm_reset") for m in mems),
        "memory_per_process": mems,
        "setup_s": [r["setup_s"] for r in results],
        "trainable_bytes": results[0]["trainable_bytes"],
    }


def _fmt(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def format_table(summary: dict, sides: tuple[str, ...], device: str) -> str:
    mem = "peak GPU GB" if device == "cuda" else "peak RSS GB"
    cols = [
        "",
        "step s",
        "generate s",
        "update s",
        mem,
        "transient GB",
        "peak-state GB",
        "GFLOP/s",
        "% of peak",
    ]
    keys = [
        "step_s",
        "generate_s",
        "update_s",
        "peak_gb",
        "transient_gb",
        "peak_over_state_gb",
        "gflops",
        "pct_of_peak",
    ]
    digits = [3, 3, 3, 2, 2, 2, 1, 2]
    rows = [
        [LABELS[side]] + [_fmt(summary[side][k], d) for k, d in zip(keys, digits)] for side in sides
    ]
    rows += [
        [label] + [_fmt(ratio.get(k), 2) for k in keys]
        for label, ratio in summary["ratios"].items()
    ]
    return _markdown_table(cols, rows)


def format_roofline(summary: dict, sides: tuple[str, ...]) -> str:
    """Per side: the phases' times at the roofline, and the measured times as multiples of them."""
    phases = ("generate", "update", "step")
    cols = (
        ["", "generation dtype"]
        + [f"roofline {ph} s" for ph in phases]
        + [f"{ph} / roofline" for ph in phases]
    )
    rows = []
    for side in sides:
        roof = summary[side]["roofline"]
        rows.append(
            [LABELS[side], roof["generation_dtype"]]
            + [_fmt(roof[f"{ph}_s"], 4) for ph in phases]
            + [_fmt(roof[f"{ph}_multiple"], 1) for ph in phases]
        )
    return _markdown_table(cols, rows)


def _markdown_table(cols: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda cells: (
        "| "
        + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        + " |"
    )
    sep = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if i else "-" * (w + 2) for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([line(cols), sep] + [line(r) for r in rows])


def _ratio(a, b):
    if (
        a is None
        or b is None
        or b == 0
        or any(isinstance(x, float) and math.isnan(x) for x in (a, b))
    ):
        return None
    return a / b


def run_precision(
    precision: str, work: dict, args, workdir: Path, interpreters: dict[str, str], lora_r: int = 0
) -> dict:
    """Every side of `interpreters` (side -> the Python that runs its children), --repeats times."""
    spec = dict(work, precision=precision, lora_r=lora_r)
    sides = tuple(interpreters)
    results = {side: [] for side in sides}
    mode = f"lora{lora_r}" if lora_r else "full"
    for r in range(args.repeats):
        order = sides if r % 2 == 0 else sides[::-1]  # TRL, grpo, then grpo, TRL (ABBA)
        for side in order:
            print(
                f"[{precision}, {mode}] repeat {r + 1}/{args.repeats}: {side} ...",
                end="",
                file=sys.stderr,
                flush=True,
            )
            res = run_child(
                side,
                spec,
                workdir,
                f"{precision}-{mode}-{side}-{r}",
                args.verbose,
                interpreters[side],
            )
            print(f" {res['wall_s']:.1f} s", file=sys.stderr, flush=True)
            results[side].append(res)
    shape = next(iter(results.values()))[0]["shape"]
    summary = {
        side: summarize_side(results[side], shape, spec["device"], bool(lora_r)) for side in sides
    }
    same_work = len({tuple(summary[side]["tokens_per_step"]) for side in sides}) == 1
    return {
        "precision": precision,
        "mode": mode,
        "sides": sides,
        "spec": spec,
        "shape": shape,
        "same_tokens_per_step": same_work,
        "summary": summary,
        "raw": results,
    }


def generation_dtype(side: str, summary_side: dict, precision: str) -> str:
    """The dtype of the weights and KV cache in the decode roofline: the precision's (bfloat16 under
    --precision bf16, float32 otherwise), the same for the trl and grpo sides whatever they actually
    computed in (the footer shows that); on the grpo-vllm side, vLLM's model dtype."""
    vllm_dtype = summary_side["compute_dtypes"].get("generate") if side == VLLM_SIDE else None
    return vllm_dtype[0] if vllm_dtype else {"fp32": "float32", "bf16": "bfloat16"}[precision]


def apply_limits(run: dict, peak_flops: float, peak_kernel: str, bandwidth: float) -> None:
    """Add what depends on the machine's limits to a run: % of peak, the roofline per side and the
    ratio rows."""
    import torch

    run.update(peak_flops=peak_flops, peak_kernel=peak_kernel, bandwidth=bandwidth)
    passes = 2.0 if run["spec"].get("lora_r") else 3.0
    summary, shape = run["summary"], run["shape"]
    for side in run["sides"]:
        s = summary[side]
        s["pct_of_peak"] = 100.0 * s["gflops"] * 1e9 / peak_flops
        dtype = generation_dtype(side, s, run["precision"])
        element = getattr(torch, dtype).itemsize
        steps = _measured(run["raw"][side])
        roofs = [
            step_roofline(
                shape,
                st["prompt_lengths"],
                st["completion_lengths"],
                element,
                peak_flops,
                bandwidth,
                passes,
            )
            for st in steps
        ]
        roof = {
            "generate_s": _median([g for g, _ in roofs]),
            "update_s": _median([u for _, u in roofs]),
            "step_s": _median([g + u for g, u in roofs]),
        }
        last = [
            p + c - 1 for p, c in zip(steps[0]["prompt_lengths"], steps[0]["completion_lengths"])
        ]
        s["roofline"] = {
            "generation_dtype": dtype,
            "decode_weight_bytes": decode_bytes(shape, [], element),
            "last_decode_kv_bytes": decode_bytes(shape, last, element)
            - decode_bytes(shape, [], element),
            **roof,
            **{k[:-2] + "_multiple": _ratio(s[k], v) for k, v in roof.items()},
        }
    summary["ratios"] = {
        f"{LABELS[a]}/{LABELS[b]}": {
            k: _ratio(summary[a][k], summary[b][k])
            for k in (
                "step_s",
                "generate_s",
                "update_s",
                "peak_gb",
                "transient_gb",
                "peak_over_state_gb",
                "gflops",
                "pct_of_peak",
            )
        }
        for a, b in RATIOS
        if a in run["sides"] and b in run["sides"]
    }


def machine_info(device: str, threads: int) -> dict:
    import torch

    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    for module in ("transformers", "trl", "accelerate"):
        try:
            info[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - version is informational only
            info[module] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_report(run: dict, machine: dict, command: str) -> None:
    spec, summary, shape, sides = run["spec"], run["summary"], run["shape"], run["sides"]
    p = run["precision"]
    precision_text = (
        "fp32 weights and compute" if p == "fp32" else "fp32 master weights, bf16 autocast"
    )
    print()
    print(
        f"## grpo vs TRL GRPOTrainer: {spec['model_label']}, {p} ({precision_text}), {lora_label(spec)}"
    )
    print()
    print(format_table(summary, sides, spec["device"]))
    print()
    print(format_roofline(summary, sides))
    print()
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']} ({machine['torch_threads']} thread{'s' if machine['torch_threads'] != 1 else ''}), "
        f"transformers {machine['transformers']}, trl {machine['trl']}, device {spec['device']}"
        + (f" ({machine['gpu']})" if machine.get("gpu") else "")
        + (
            f", load average {machine['load_average']:.1f} at start"
            if machine.get("load_average") is not None
            else ""
        )
    )
    if VLLM_SIDE in sides:
        raw = run["raw"][VLLM_SIDE][0]
        versions = ", ".join(f"{m} {v}" for m, v in raw["versions"].items() if v)
        settings = ", ".join(f"{k}={v}" for k, v in VLLM_SETTINGS.items())
        print(
            f"{VLLM_SIDE}: grpo's Trainer with rollout.engine=vllm ({settings}), run by {raw['python']} ({versions})"
        )
    print(
        f"settings: {NUM_PROMPTS} prompts x {NUM_GENERATIONS} completions, exactly {spec['max_completion_length']} "
        f"completion tokens each (EOS ignored), {lora_label(spec)} on both sides, loss_type={spec['loss_type']}, beta=0, "
        f"lr={spec['learning_rate']}, "
        f"temperature=1.0, seed={spec['seed']}, 1 optimizer step per generation batch "
        f"(TRL: 16 completions per forward/backward; grpo: training.microbatch_tokens={spec['microbatch_tokens']}"
        f"{' (no split)' if not spec['microbatch_tokens'] else ''}); "
        f"{spec['warmup']} warm-up + {spec['steps']} measured steps per process, {spec['repeats']} process pairs "
        f"(ABBA order) -> medians over {summary[sides[0]]['measured_steps']} steps per side"
    )
    print(
        f"model: {shape['model_type']}, {shape['total_params'] / 1e6:.1f}M params "
        f"({shape['non_embedding_params'] / 1e6:.1f}M non-embedding, vocab {shape['vocab_size']}), "
        + (
            "grpo.models.tiny's model, saved once with save_pretrained"
            if spec["model_label"] == "tiny"
            else f"from {spec['model_dir']}"
        )
        + ", loaded by both sides with AutoModelForCausalLM.from_pretrained (float32)"
    )
    gflop = summary[sides[0]]["step_gflop"]
    tokens = ", ".join(f"{s}: {summary[s]['tokens_per_step']}" for s in sides)
    passes = (
        "2x forward update (no base weight gradients)"
        if spec.get("lora_r")
        else "3x forward update"
    )
    print(
        f"work: {gflop:.2f} GFLOP per step (1x forward generation + {passes}, attention included); "
        f"tokens per step {tokens}"
        + ("" if run["same_tokens_per_step"] else "  <-- DIFFERENT WORK")
    )
    print(
        f"limits (measured in this run, best of start and end): peak {run['peak_flops'] / 1e9:.1f} GFLOP/s "
        f"(best {p} matmul, {run['peak_kernel']}), memory bandwidth {run['bandwidth'] / 1e9:.1f} GB/s "
        f"(streaming read of {BANDWIDTH_BYTES / GB:g} GiB)"
    )
    reads = {}  # text -> the sides it describes
    for s in sides:
        r = summary[s]["roofline"]
        text = (
            f"{r['decode_weight_bytes'] / 1e6:.1f} MB of {r['generation_dtype']} weights + up to "
            f"{r['last_decode_kv_bytes'] / 1e6:.2f} MB of KV cache"
        )
        reads.setdefault(text, []).append(LABELS[s])
    roof = "; ".join(
        text if len(reads) == 1 else f"{', '.join(names)}: {text}" for text, names in reads.items()
    )
    print(
        "roofline: generate = prefill FLOPs / peak + per decode step max(FLOPs / peak, bytes read / bandwidth); "
        f"update = FLOPs / peak; bytes read per decode step ({roof})"
    )
    dt = "; ".join(
        f"{s}: "
        + ", ".join(
            f"{ph} {'/'.join(d)}" for ph, d in summary[s]["compute_dtypes"].items() if ph != "setup"
        )
        for s in sides
    )
    print(
        f"compute dtype of a decoder Linear: {dt}"
        + (f" ({VLLM_SIDE}'s generate: vLLM's model dtype)" if VLLM_SIDE in sides else "")
    )
    print("optimizer: " + ", ".join(f"{s}: {summary[s]['optimizer']}" for s in sides))
    if not all(summary[s]["hwm_reset"] for s in sides) and spec["device"] == "cpu":
        print("note: VmHWM could not be reset, so peak RSS includes model loading")
    print(f"command: {command}")


def print_lora_comparison(full: dict, adapted: dict) -> None:
    """LoRA against full fine-tuning, per side, from the same run."""
    keys = [
        ("step_s", "step s"),
        ("generate_s", "generate s"),
        ("update_s", "update s"),
        ("peak_gb", "peak GB"),
    ]
    rows = []
    for side in full["sides"]:
        f, a, label = full["summary"][side], adapted["summary"][side], LABELS[side]
        rows.append([f"{label} full"] + [_fmt(f[k], 3) for k, _ in keys])
        rows.append([f"{label} LoRA"] + [_fmt(a[k], 3) for k, _ in keys])
        rows.append([f"{label} LoRA/full"] + [_fmt(_ratio(a[k], f[k]), 2) for k, _ in keys])
    rows += [
        [f"{name}, LoRA"] + [_fmt(ratio.get(k), 2) for k, _ in keys]
        for name, ratio in adapted["summary"]["ratios"].items()
    ]
    print()
    print(f"## LoRA ({lora_label(adapted['spec'])}) against full fine-tuning, {full['precision']}")
    print()
    print(_markdown_table([""] + [c for _, c in keys], rows))


def base_spec(args, model_dir: Path, label: str, threads: int, device: str) -> dict:
    """The work both sides run (without the precision and LoRA rank, which run_precision adds)."""
    return {
        "model_dir": str(model_dir),
        "model_label": label,
        "max_completion_length": args.max_completion_length
        or DEFAULT_COMPLETION_LENGTH.get(label, 64),
        "learning_rate": args.learning_rate,
        "loss_type": args.loss_type,
        "seed": args.seed,
        "data_seed": 0,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": threads,
        "device": device,
        "microbatch_tokens": args.microbatch_tokens,
        "lora_alpha": args.lora_alpha,
    }


def parent_main(args) -> int:
    sides = tuple(side for side in SIDES if side in args.sides.split(","))
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown or not sides:
        raise BenchmarkError(f"--sides {args.sides}: a comma-separated list of {', '.join(SIDES)}")
    check_dependencies(sides)
    import torch

    device = _resolve_device(args.device)
    interpreters = dict.fromkeys(sides, sys.executable)  # side -> the Python that runs its children
    if args.vllm:
        interpreters[VLLM_SIDE] = vllm_interpreter(args.vllm_python, device, args.model)
    # tiny matrices: one thread (thread hand-offs cost more than the arithmetic); otherwise torch's default
    threads = args.threads or (1 if args.model == "tiny" else torch.get_num_threads())
    torch.set_num_threads(threads)
    precisions = PRECISIONS if args.precision == "both" else (args.precision,)
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        workdir = Path(tmp)
        model_dir, label = prepare_model(args.model, workdir)
        spec = base_spec(args, model_dir, label, threads, device)
        machine = machine_info(device, threads)
        size = args.peak_size or (8192 if device == "cuda" else 2048)
        before = measure_limits(precisions, device, size, 5)
        runs = {}
        ranks = [0] + ([args.lora] if args.lora else [])  # full fine-tuning, then LoRA
        for p in precisions:
            for rank in ranks:
                runs[f"{p}-lora{rank}" if rank else p] = run_precision(
                    p, spec, args, workdir, interpreters, rank
                )
        # the limits again after the runs (a shared machine can be faster at either end); keep the best of each
        after = measure_limits(precisions, device, size, 3)
        for run in runs.values():
            b, a = before[run["precision"]], after[run["precision"]]
            peak, kernel, _ = max(b, a, key=lambda m: m[0])
            apply_limits(run, peak, kernel, max(b[2], a[2]))
        for run in runs.values():
            print_report(run, machine, command)
        if args.lora:
            for p in precisions:
                print_lora_comparison(runs[p], runs[f"{p}-lora{args.lora}"])
    out = (
        Path(args.out)
        if args.out
        else REPO
        / "benchmarks"
        / "results"
        / f"vs_trl-{args.precision}-{label}{f'-lora{args.lora}' if args.lora else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "machine": machine,
        "matmul_size": size,
        "bandwidth_bytes": BANDWIDTH_BYTES,
        "runs": {
            p: {
                "settings": {k: v for k, v in r["spec"].items()},
                "peak_flops": r["peak_flops"],
                "peak_kernel": r["peak_kernel"],
                "bandwidth": r["bandwidth"],
                "shape": r["shape"],
                "same_tokens_per_step": r["same_tokens_per_step"],
                "summary": r["summary"],
                "raw": r["raw"],
            }
            for p, r in runs.items()
        },
    }
    for key, r in runs.items():
        payload["runs"][key]["mode"] = r["mode"]
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nresults: {out}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="gemma-3-270m",
        help="gemma-3-270m (embedded), tiny, or a save_pretrained directory",
    )
    ap.add_argument("--precision", choices=(*PRECISIONS, "both"), default="fp32")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument(
        "--warmup", type=int, default=1, help="warm-up steps per process (not measured; >= 1)"
    )
    ap.add_argument("--steps", type=int, default=3, help="measured steps per process")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="process pairs per side and precision (alternating order)",
    )
    ap.add_argument(
        "--max-completion-length", type=int, default=None, help="default: 64 (gemma), 16 (tiny)"
    )
    ap.add_argument("--learning-rate", type=float, default=1e-6)
    ap.add_argument(
        "--microbatch-tokens",
        type=int,
        default=640,
        help="grpo's training.microbatch_tokens (0: all 16 completions in one forward/backward, as TRL does)",
    )
    ap.add_argument("--loss-type", default="dapo", choices=("dapo", "grpo", "bnpo", "dr_grpo"))
    ap.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="also run LoRA with rank R on both sides (peft, all-linear), after full fine-tuning",
    )
    ap.add_argument(
        "--lora-alpha", type=float, default=16.0, help="LoRA alpha of --lora (both sides)"
    )
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads in both children (default: torch's default)",
    )
    ap.add_argument(
        "--peak-size",
        type=int,
        default=None,
        help="matmul size for the peak (default 2048 CPU, 8192 CUDA)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON results (default benchmarks/results/vs_trl-<precision>-<model>.json)",
    )
    ap.add_argument("--verbose", action="store_true", help="show the children's output")
    ap.add_argument(
        "--sides",
        default=",".join(SIDES),
        help="which of trl,grpo to run (default both; e.g. grpo where TRL is not installed)",
    )
    ap.add_argument(
        "--vllm",
        action="store_true",
        help=f"also run a {VLLM_SIDE} side: grpo with rollout.engine=vllm, in the vllm venv ({VLLM_HINT})",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the interpreter of the --vllm side (default .venv-vllm/bin/python); needs vllm and grpo",
    )
    # internal: one side in a child process
    ap.add_argument("--side", choices=(*SIDES, VLLM_SIDE), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the state held between steps is read after the warm-up)")
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1")
    if args.lora < 0 or args.lora_alpha <= 0:
        ap.error("--lora must be >= 0 (0: full fine-tuning only) and --lora-alpha > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return child_main(args) if args.side else parent_main(args)
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
