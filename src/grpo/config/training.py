"""The config's `training:`, `cpu:`, `eval:` and `logging:` sections: optimisation, the CPU
speed layer's settings, held-out evaluation and what the run reports; each section checks its
own fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo import registry
from grpo.config import safe_yaml
from grpo.config.checks import WholeConfig, one_of, positive
from grpo.config.errors import ConfigError


@dataclass
class TrainingConfig:
    max_steps: int = 100
    """Generation batches to train on (each gives num_iterations optimizer steps)."""
    per_device_train_batch_size: int = 8
    """Completions per minibatch (the unit the bnpo loss normalises over)."""
    microbatch_tokens: int = 0
    """Most token positions (prompt + completion, a shared prompt counted once) in one
    forward/backward: a minibatch is computed in micro-batches of whole groups (or rows)
    under this budget, so activation memory stays bounded. The gradient is the same.
    0: one forward/backward per minibatch."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step. Generation batch = per_device_train_batch_size x
    gradient_accumulation_steps x world size completions; a multiple of num_generations."""
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    """constant, linear (TRL's default) or cosine."""
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    bf16: bool | str = "auto"
    """bf16 autocast for generation and the update, with fp32 master weights: true, false, or
    auto (on a CUDA device that computes in bf16, Ampere and newer; off on the CPU, where a
    float32 run is the one the tests compare with TRL's)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    logprob_chunk_size: int = 4096
    """Completion tokens per chunk when computing logprobs from hidden states (each chunk
    is processed in vocabulary blocks sized to the device, so this rarely needs changing)."""
    seed: int = 42
    save_steps: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""
    save_total_limit: int = 0
    """Keep only the newest N checkpoint-*/ directories (0: keep all; final/ is always kept)."""
    max_consecutive_skips: int = 3
    """An optimizer pass whose loss or gradient is NaN or inf is skipped (weights and optimizer
    state untouched, counted in `train/skipped_updates`); this many skipped in a row stop the
    run (grpo.training.update.TrainingDiverged)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""
    sharding: str = "none"
    """none: under torchrun every rank holds the whole model (data parallel); fsdp: the
    parameters, gradients and optimizer state are sharded over the ranks with FSDP2
    (`fully_shard` per decoder layer), gathered whole for each rollout."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        one_of("training.lr_scheduler_type", self.lr_scheduler_type, registry.LR_SCHEDULES)
        one_of("training.sharding", self.sharding, ("none", "fsdp"))
        if self.sharding == "fsdp":
            _check_fsdp(cfg, world_size)
        one_of("training.device", self.device, ("auto", "cpu", "cuda"))
        if isinstance(self.bf16, str) and self.bf16 != "auto":
            raise ConfigError(
                f"training.bf16: expected true, false or auto, got {safe_yaml.shown(self.bf16)}"
            )
        positive("training.per_device_train_batch_size", self.per_device_train_batch_size)
        positive("training.gradient_accumulation_steps", self.gradient_accumulation_steps)
        G = cfg.rollout.num_generations
        batch = cfg.generation_batch_size(world_size)
        if batch % G != 0:
            lower = max(G, batch - batch % G)
            raise ConfigError(
                f"training.per_device_train_batch_size x gradient_accumulation_steps x world size = {batch} completions "
                f"per step is not a multiple of rollout.num_generations={G}; use a batch of "
                f"{lower} or {lower + G} (e.g. training.per_device_train_batch_size="
                f"{max(1, lower // (self.gradient_accumulation_steps * world_size))}) or change num_generations"
            )
        local = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if world_size > 1 and local % G != 0:
            raise ConfigError(
                f"training.per_device_train_batch_size x gradient_accumulation_steps = {local} completions per rank is "
                f"not a multiple of rollout.num_generations={G}: each of the {world_size} ranks generates whole groups "
                f"(a group never straddles ranks); make it "
                + (f"{local - local % G} or {local - local % G + G}" if local > G else f"{G}")
            )
        positive("training.max_steps", self.max_steps)
        positive("training.learning_rate", self.learning_rate, allow_zero=True)
        positive("training.warmup_steps", self.warmup_steps, allow_zero=True)
        positive("training.max_grad_norm", self.max_grad_norm, allow_zero=True)
        positive("training.logprob_chunk_size", self.logprob_chunk_size)
        positive("training.microbatch_tokens", self.microbatch_tokens, allow_zero=True)
        positive("training.save_steps", self.save_steps, allow_zero=True)
        positive("training.save_total_limit", self.save_total_limit, allow_zero=True)
        positive("training.max_consecutive_skips", self.max_consecutive_skips)


def _check_fsdp(cfg: WholeConfig, world_size: int) -> None:
    """What FSDP sharding does not cover yet, refused with the way out."""
    refused = [
        (cfg.model.lora.r > 0, "model.lora.r > 0 (LoRA)", "set model.lora.r=0"),
        (
            cfg.algorithm.beta > 0,
            "algorithm.beta > 0 (the KL reference is not sharded yet)",
            "set algorithm.beta=0",
        ),
        (
            cfg.algorithm.advantage_estimator == "gae",
            "advantage_estimator=gae (the critic is not sharded yet)",
            "use another estimator",
        ),
        (
            cfg.rollout.engine != "hf",
            f"rollout.engine={cfg.rollout.engine}",
            "set rollout.engine=hf",
        ),
        (
            cfg.cpu.decoding == "fused",
            "cpu.decoding=fused (it reads the weights outside the model's forward)",
            "set cpu.decoding=auto",
        ),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(
                f"training.sharding=fsdp does not support {what} yet; {fix}, or set training.sharding=none"
            )


@dataclass
class CPUConfig:
    """The CPU speed layer (grpo.cpu), installed by the backend on a CPU run; every setting
    changes speed and memory, never the values beyond float tolerance, and may change on resume."""

    enabled: bool = True
    """false: no CPU mechanism at all (plain PyTorch and transformers everywhere): correct and slower."""
    kernels: bool = True
    """float32 Linear layers (and the output layer) run through oneDNN instead of torch's default
    BLAS where it is faster (grpo.cpu.kernels.uses_onednn): the same float32 arithmetic, about twice
    the rate on AMD CPUs, where MKL is slow, and for decoding's few rows on any CPU (on Intel CPUs
    the update's products stay with MKL, which is faster there); and grouped-query attention lays
    the query heads that share a key/value head out as its queries (grpo.cpu.attention) instead of
    copying keys and values per query head. false: plain torch and transformers."""
    compile: str = "auto"
    """How the update's element-wise work runs: the output layer's tiles (grpo.cpu.tile_math: the
    log-sum-exp, the softmax gradient, the weight block's cast, the weight-gradient sum) and the
    decoder's RMS norms (grpo.cpu.compiled_norms). `compiled`, fused kernels built by torch.compile
    (a C++ compiler; cached on disk, compiled once per machine); `eager`, PyTorch operations one by
    one; `auto`: compiled for models whose output layer has at least 2^24 weights (Gemma-3-270M's
    has 168M) where the compiler works, eager elsewhere."""
    decoding: str = "auto"
    """How the `hf` engine runs a decoding step: `fused` (grpo.cpu.fused_decoding: fewer, larger
    operations; Gemma 3 and the Llama family), `plain` (transformers' modules), or `auto`: fused
    where it applies (a supported architecture with cpu.kernels, in bf16, or in float32 without a
    LoRA adapter), plain elsewhere."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        one_of("cpu.compile", self.compile, ("auto", "compiled", "eager"))
        one_of("cpu.decoding", self.decoding, registry.DECODING)


@dataclass
class EvalConfig:
    before: bool = False
    """Evaluate the starting model on the held-out problems before training."""
    after: bool = False
    """Evaluate the trained model after training."""
    every: int = 0
    """Evaluate every N steps (0: never during training)."""
    num_problems: int | None = None
    """Held-out problems to use (None: all)."""
    max_completion_length: int | None = None
    """Tokens per evaluation answer (None: rollout.max_completion_length)."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Decoding settings to report: 0 is greedy."""
    batch_size: int = 32
    seed: int = 1234
    instructions: list[str] = field(default_factory=list)
    """Task arithmetic: other wordings of the held-out prompts (`{expression}` is replaced by
    the problem), each evaluated beside the one trained on (data.arithmetic.instruction) and
    reported as "wording 2", "wording 3", ...: a gain that holds on a wording never trained on
    is not an artefact of one prompt."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        for i, instruction in enumerate(self.instructions):
            if "{expression}" not in instruction:
                raise ConfigError(
                    f"eval.instructions[{i}]: must contain {{expression}}, where the problem goes"
                )
        if self.instructions and cfg.data.task != "arithmetic":
            raise ConfigError(
                f"eval.instructions: rewords task arithmetic's prompts only, not {cfg.data.task!r}; "
                "remove it"
            )
        for temperature in self.temperatures:
            positive("eval.temperatures[]", temperature, allow_zero=True)
        positive("eval.every", self.every, allow_zero=True)
        positive("eval.batch_size", self.batch_size)
        if self.num_problems is not None:
            positive("eval.num_problems", self.num_problems)


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Console progress line every N steps (metrics.jsonl gets every step)."""
    sample_every: int = 10
    """Print a sample completion every N steps (0: never)."""
    report_to: list[str] = field(default_factory=list)
    """Extra trackers: tensorboard, wandb, trackio (imported only when listed)."""
    run_name: str | None = None

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        positive("logging.log_every", self.log_every)
        positive("logging.sample_every", self.sample_every, allow_zero=True)
        for name in self.report_to:
            one_of("logging.report_to[]", name, ("tensorboard", "wandb", "trackio"))
