"""TRL's `GRPOConfig` / `GRPOTrainer` names on top of grpo's one trainer.

A TRL script runs here by changing its import to `from grpo import GRPOConfig,
GRPOTrainer`. `GRPOConfig` takes TRL's field names with TRL 1.16's defaults
(which differ from grpo's own in places: bf16 and gradient checkpointing on,
logging every 10 steps, a checkpoint every 500, three epochs) and turns them
into grpo's `Config` through `MAPPING`, the one table of which TRL field sets
which grpo key. A TRL field outside the table is either listed in `NO_EFFECT`
(accepted, named in a warning) or refused by name with what to use instead:
a setting is never dropped silently. `GRPOTrainer` turns TRL's arguments
(model object or name, reward callables or model ids, a datasets.Dataset,
IterableDataset or rows, a peft LoraConfig) into `grpo.training.trainer.Trainer`'s and
delegates to it.

Units: TRL counts `max_steps`, `save_steps`, `logging_steps` and `eval_steps`
in optimizer steps; a grpo step is one generation batch, which is
`num_iterations` optimizer steps, so those counts are divided by
num_iterations (rounded up). `per_device_train_batch_size` counts completions,
in both.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from grpo.config import schema as config_module
from grpo.config.errors import ConfigError
from grpo.config.schema import Config

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------
# GRPOConfig
# --------------------------------------------------------------------------


@dataclass
class _Fields:
    """TRL's GRPOConfig fields that grpo implements, with TRL 1.16's defaults."""

    output_dir: str | None = None
    """None: `trainer_output`, as in transformers."""
    overwrite_output_dir: bool = False
    """(transformers < 5) Train into a directory that already holds a run, deleting its checkpoints."""
    # generation
    num_generations: int = 8
    max_completion_length: int = 512
    max_prompt_length: int | None = None
    """(TRL < 1.0; gone from 1.16) Prompts longer than this keep their last tokens."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    """None: off (rollout.min_p 0)."""
    repetition_penalty: float = 1.0
    generation_kwargs: dict | str | None = None
    """Sampling settings by the names transformers' GenerationConfig and vLLM's SamplingParams
    give them (a dict, or its JSON text); each overrides the field of the same meaning.
    Only those grpo's engines implement are taken (GENERATION_KWARGS), any other is refused."""
    chat_template_kwargs: dict | str | None = None
    """Extra variables for the chat template (e.g. {"enable_thinking": False}): data.chat_template_kwargs."""
    generation_batch_size: int | None = None
    """Only per_device_train_batch_size x gradient_accumulation_steps (grpo's one batch)."""
    steps_per_generation: int | None = None
    """Only gradient_accumulation_steps (grpo generates once per step)."""
    # algorithm
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "dapo"
    """TRL's one name for grpo's two choices: cispo and sapo set algorithm.policy_loss (with the
    aggregation TRL uses with each, dapo and grpo); the others are aggregations of `clipped`."""
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    use_bias_correction_kl: bool = True
    """TRL 1.16's default, True: the KL term weighted by the importance ratio
    (algorithm.kl_bias_correction, whose own default in grpo's YAML is false)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    top_entropy_quantile: float = 1.0
    max_tool_calling_iterations: int | None = None
    """Most turns with tool calls per completion (rollout.max_tool_calls). None (TRL's "no limit"):
    rollout.max_tool_calls' default, 5; rollout.max_completion_length bounds a completion either way."""
    # generation with vLLM (grpo's `vllm` engine, colocated in the training process)
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    """Only colocate: grpo's vllm engine runs in the training process (no server)."""
    vllm_enable_sleep_mode: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    vllm_importance_sampling_correction: bool = True
    """With use_vllm, as in TRL: algorithm.rollout_correction = vllm_importance_sampling_mode."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    """Only None (grpo's correction has an upper bound only)."""
    """Taken over the tokens of one forward pass, as TRL does (algorithm.entropy_mask_scope=batch)."""
    scale_rewards: str | bool = "group"
    importance_sampling_level: str = "token"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None
    sync_ref_model: bool = False
    ref_model_sync_steps: int = 512
    ref_model_mixup_alpha: float = 0.6
    # optimisation
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    """An int counts optimizer steps; a float below 1 is a fraction of them (as in transformers)."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    shuffle_dataset: bool = True
    """Draw the prompts in a shuffled order, reshuffled every epoch (data_seed); False: in the
    dataset's order (data.shuffle)."""
    disable_dropout: bool = False
    """Only False: the update runs the model in training mode, with whatever dropout it was built with."""
    optim: str = "adamw_torch_fused"
    """AdamW only: adamw_torch_fused or adamw_torch (grpo picks the fused kernel where it exists)."""
    max_grad_norm: float = 1.0
    per_device_train_batch_size: int = 8
    """Completions (not prompts) per device and micro-step, as in TRL."""
    gradient_accumulation_steps: int = 1
    max_steps: int = -1
    """Optimizer steps; -1: from num_train_epochs and the dataset's size."""
    num_train_epochs: float = 3.0
    seed: int = 42
    data_seed: int | None = None
    """Seed of the prompt order; None: `seed`."""
    bf16: bool | None = None
    """None: on (TRL's default), unless fp16 is asked for."""
    gradient_checkpointing: bool = True
    activation_checkpointing: bool | None = None
    """transformers 5's name for gradient_checkpointing; wins when set."""
    trust_remote_code: bool = False
    use_cpu: bool = False
    # logging, saving, evaluation
    logging_steps: float = 10
    """The console line's interval (metrics.jsonl and log_history get every step)."""
    report_to: str | list[str] = "none"
    log_completions: bool = False
    """Sample completions (one per group, four groups) to the console, samples.jsonl and the
    wandb/trackio/TensorBoard completions table every logging_steps (grpo's logging.sample_every)."""
    run_name: str | None = None
    save_strategy: str = "steps"
    """no, steps or epoch (final/ is always written at the end)."""
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    """no, steps or epoch: held-out evaluation of eval_dataset during training."""
    eval_steps: float | None = None
    """None: logging_steps."""
    eval_on_start: bool = False
    """Evaluate before the first step (grpo's eval.before); needs eval_dataset."""
    num_generations_eval: int | None = None
    """Completions per held-out prompt in the loss-and-rewards part of an evaluation (TRL's);
    None: num_generations."""
    per_device_eval_batch_size: int = 8
    grpo_overrides: list[str] = field(default_factory=list)
    """grpo's own settings that TRL has no field for, as `section.key=value` (e.g.
    ["rewards.isolation=thread", "rewards.timeout=30"]); applied last."""


class GRPOConfig(_Fields):
    """TRL's GRPOConfig: its fields that grpo implements (`_Fields`), with TRL 1.16's defaults.
    `to_config(num_rows)` is the grpo `Config` they stand for; `MAPPING` says which grpo key
    each field sets. A NO_EFFECT field is accepted with a warning, any other TRL field refused."""

    def __init__(self, *args, **kwargs):
        refused = [name for name in kwargs if name not in _FIELD_NAMES and name not in NO_EFFECT]
        if refused:
            raise TypeError("; ".join(_refusal(name) for name in refused))
        self.ignored = {name: kwargs.pop(name) for name in list(kwargs) if name in NO_EFFECT}
        """The NO_EFFECT fields given, which this run does not use."""
        super().__init__(*args, **kwargs)
        named = sorted(
            name for name, value in self.ignored.items() if value is not None and value is not False
        )
        if (
            named
        ):  # a switch left off (use_vllm=False, push_to_hub=False) changes nothing either way
            warnings.warn(
                f"GRPOConfig: accepted but without effect in grpo (it has no vLLM, Hub, launcher or dataloader "
                f"settings): {', '.join(named)}",
                stacklevel=2,
            )

    # -------------------------------------------------------------- the mapping

    def steps(self, num_rows: int | None) -> int:
        """grpo steps (generation batches) that TRL's max_steps / num_train_epochs stand for."""
        if self.max_steps > 0:
            return math.ceil(self.max_steps / self._mu)
        if num_rows is None:
            raise ConfigError(
                "GRPOConfig.num_train_epochs: needs the dataset's size; set max_steps, or pass train_dataset"
            )
        return max(1, math.ceil(self.num_train_epochs * num_rows / self._prompts_per_step()))

    def _prompts_per_step(self) -> int:
        return max(
            1,
            self.per_device_train_batch_size
            * self.gradient_accumulation_steps
            // max(1, self.num_generations),
        )

    @property
    def _mu(self) -> int:
        """num_iterations, at least 1 here: a bad value is grpo's config check to report."""
        return max(1, self.num_iterations)

    def _in_steps(self, value: float, num_rows: int | None, strategy: str, what: str) -> int:
        """A TRL interval (optimizer steps, a fraction of the run below 1, or one epoch) in grpo steps."""
        if strategy == "no":
            return 0
        if strategy == "epoch":
            if num_rows is None:
                raise ConfigError(
                    f"GRPOConfig.{what}: 'epoch' needs the dataset's size; pass train_dataset or use 'steps'"
                )
            return max(1, math.ceil(num_rows / self._prompts_per_step()))
        if strategy != "steps":
            raise ConfigError(f"GRPOConfig.{what}: {strategy!r} is not one of no, steps, epoch")
        if 0 < value < 1:
            return max(1, math.ceil(value * self.steps(num_rows)))
        return max(1, math.ceil(value / self._mu))

    def to_config(self, num_rows: int | None = None, extra: dict[str, Any] | None = None) -> Config:
        """grpo's Config for these settings; `num_rows`: the training set's size (for epochs);
        `extra`: more grpo keys (dotted) from GRPOTrainer's own arguments (peft_config's);
        grpo_overrides still win over both."""
        self._check()
        data: dict[str, Any] = {}
        for name, (key, convert) in MAPPING.items():
            value = convert(self, num_rows) if convert else getattr(self, name)
            if value is not _UNSET:
                _set_dotted(data, key, value)
        for key, derive in DERIVED.items():
            value = derive(self)
            if value is not _UNSET:
                _set_dotted(data, key, value)
        for name, value in _json_dict(self.generation_kwargs, "generation_kwargs").items():
            key = _generation_key(name, value)
            if key is not None:
                _set_dotted(data, key, value)
        for key, value in (extra or {}).items():
            _set_dotted(data, key, value)
        try:
            return config_module.from_dict(data, self.grpo_overrides)
        except ConfigError as error:
            raise ConfigError(_with_fields(str(error))) from None

    def _check(self) -> None:
        """TRL values that name something grpo does not do."""
        derived = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.generation_batch_size not in (None, derived):
            raise ConfigError(
                f"GRPOConfig.generation_batch_size={self.generation_batch_size}: grpo generates "
                f"per_device_train_batch_size x gradient_accumulation_steps = {derived} completions per step; "
                "set those two instead and leave generation_batch_size unset"
            )
        if self.steps_per_generation not in (None, self.gradient_accumulation_steps):
            raise ConfigError(
                "GRPOConfig.steps_per_generation: grpo generates once per gradient_accumulation_steps micro-steps; "
                "leave it unset (use num_iterations to reuse a generation batch)"
            )
        if self.disable_dropout:
            raise ConfigError(
                "GRPOConfig.disable_dropout=True is not implemented; build the model with dropout 0 "
                "(e.g. from_pretrained(name, attention_dropout=0.0)) and pass it"
            )
        if self.vllm_mode != "colocate":
            raise ConfigError(
                f"GRPOConfig.vllm_mode={self.vllm_mode!r}: grpo's vllm engine runs colocated in the training process "
                "(no vLLM server); use vllm_mode='colocate' (TRL's default)"
            )
        if (
            self.use_vllm
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_clip_max is None
        ):
            raise ConfigError(
                "GRPOConfig.vllm_importance_sampling_clip_max=None: grpo's correction needs an upper bound; "
                "set it (TRL's default is 3.0) or vllm_importance_sampling_correction=False"
            )
        if self.vllm_importance_sampling_clip_min is not None:
            raise ConfigError(
                "GRPOConfig.vllm_importance_sampling_clip_min: grpo's correction has an upper bound only; "
                "leave it None"
            )
        if self.optim not in ("adamw_torch_fused", "adamw_torch"):
            raise ConfigError(
                f"GRPOConfig.optim={self.optim!r}: grpo trains with AdamW only; use adamw_torch_fused or adamw_torch"
            )
        if self.save_strategy == "best" or self.eval_strategy not in ("no", "steps", "epoch"):
            raise ConfigError(
                "GRPOConfig.save_strategy/eval_strategy: use no, steps or epoch ('best' is not implemented)"
            )


_FIELD_NAMES = {f.name for f in dataclasses.fields(_Fields)}

_UNSET = object()


def _report_to(a: GRPOConfig, n) -> list[str]:
    names = [a.report_to] if isinstance(a.report_to, str) else list(a.report_to)
    if "all" in names:
        raise ConfigError(
            "GRPOConfig.report_to: 'all' is not supported; name them: tensorboard, wandb, trackio"
        )
    return [name for name in names if name != "none"]


def _ref_sync(a: GRPOConfig, n):
    return math.ceil(a.ref_model_sync_steps / a._mu) if a.sync_ref_model else _UNSET


def _correction(a: GRPOConfig) -> str:
    return (
        a.vllm_importance_sampling_mode
        if a.use_vllm and a.vllm_importance_sampling_correction
        else "none"
    )


def _warmup(a: GRPOConfig, n) -> int:
    if 0 < a.warmup_steps < 1:  # a fraction of the optimizer steps
        return round(a.warmup_steps * a.steps(n) * a._mu)
    return int(a.warmup_steps)


LOSS_TYPE_AGGREGATION = {"cispo": "dapo", "sapo": "grpo", "vespo": "dapo"}
"""TRL loss types that are a policy loss in grpo, and the aggregation TRL uses with each."""

DERIVED: dict[str, Callable[[GRPOConfig], Any]] = {
    # keys set by no single TRL field: TRL's loss_type also picks the per-token objective,
    # and its entropy threshold is over one forward pass's tokens
    "algorithm.policy_loss": lambda a: (
        a.loss_type if a.loss_type in LOSS_TYPE_AGGREGATION else "clipped"
    ),
    "algorithm.entropy_mask_scope": lambda a: "batch" if a.top_entropy_quantile < 1 else _UNSET,
}

MAPPING: dict[str, tuple[str, Callable[[GRPOConfig, int | None], Any] | None]] = {
    # TRL field: (grpo key, how its value is computed; None: the field's value as it is)
    "output_dir": ("output_dir", lambda a, n: a.output_dir or "trainer_output"),
    "overwrite_output_dir": ("overwrite_output_dir", None),
    "num_generations": ("rollout.num_generations", None),
    "max_completion_length": ("rollout.max_completion_length", None),
    "max_prompt_length": ("rollout.max_prompt_length", None),
    "temperature": ("rollout.temperature", None),
    "top_p": ("rollout.top_p", None),
    "top_k": ("rollout.top_k", None),
    "min_p": ("rollout.min_p", lambda a, n: 0.0 if a.min_p is None else a.min_p),
    "repetition_penalty": ("rollout.repetition_penalty", None),
    "chat_template_kwargs": (
        "data.chat_template_kwargs",
        lambda a, n: _json_dict(a.chat_template_kwargs, "chat_template_kwargs"),
    ),
    "beta": ("algorithm.beta", None),
    "epsilon": ("algorithm.epsilon", None),
    "epsilon_high": ("algorithm.epsilon_high", None),
    "delta": ("algorithm.delta", None),
    "loss_type": (
        "algorithm.loss_type",
        lambda a, n: LOSS_TYPE_AGGREGATION.get(a.loss_type, a.loss_type),
    ),
    "sapo_temperature_pos": ("algorithm.sapo_temperature_pos", None),
    "sapo_temperature_neg": ("algorithm.sapo_temperature_neg", None),
    "vespo_k_pos": ("algorithm.vespo_k_pos", None),
    "vespo_lambda_pos": ("algorithm.vespo_lambda_pos", None),
    "vespo_k_neg": ("algorithm.vespo_k_neg", None),
    "vespo_lambda_neg": ("algorithm.vespo_lambda_neg", None),
    "off_policy_mask_threshold": ("algorithm.off_policy_mask_threshold", None),
    "use_bias_correction_kl": ("algorithm.kl_bias_correction", None),
    "multi_objective_aggregation": ("algorithm.multi_objective_aggregation", None),
    "entropy_coef": ("algorithm.entropy_coef", None),
    "use_adaptive_entropy": ("algorithm.use_adaptive_entropy", None),
    "entropy_target": ("algorithm.entropy_target", None),
    "entropy_coef_delta": ("algorithm.entropy_coef_delta", None),
    "entropy_coef_min": ("algorithm.entropy_coef_min", None),
    "entropy_coef_max": ("algorithm.entropy_coef_max", None),
    "top_entropy_quantile": ("algorithm.top_entropy_quantile", None),
    "max_tool_calling_iterations": (
        "rollout.max_tool_calls",
        lambda a, n: (
            _UNSET if a.max_tool_calling_iterations is None else a.max_tool_calling_iterations
        ),
    ),
    "use_vllm": ("rollout.engine", lambda a, n: "vllm" if a.use_vllm else "hf"),
    # the vllm engine's settings, set only when it is used (the engine's own defaults otherwise)
    "vllm_enable_sleep_mode": (
        "rollout.vllm.sleep_mode",
        lambda a, n: a.vllm_enable_sleep_mode if a.use_vllm else _UNSET,
    ),
    "vllm_gpu_memory_utilization": (
        "rollout.vllm.gpu_memory_utilization",
        lambda a, n: a.vllm_gpu_memory_utilization if a.use_vllm else _UNSET,
    ),
    # TRL corrects for vLLM's sampling only when it generates with vLLM
    "vllm_importance_sampling_correction": (
        "algorithm.rollout_correction",
        lambda a, n: _correction(a),
    ),
    "vllm_importance_sampling_mode": ("algorithm.rollout_correction", lambda a, n: _correction(a)),
    "vllm_importance_sampling_clip_max": (
        "algorithm.rollout_correction_cap",
        lambda a, n: a.vllm_importance_sampling_clip_max if a.use_vllm else _UNSET,
    ),
    # TRL reads True/False as group/none
    "scale_rewards": (
        "algorithm.scale_rewards",
        lambda a, n: {True: "group", False: "none"}.get(a.scale_rewards, a.scale_rewards),
    ),
    "importance_sampling_level": ("algorithm.importance_sampling_level", None),
    "num_iterations": ("algorithm.num_iterations", None),
    "mask_truncated_completions": ("algorithm.mask_truncated_completions", None),
    "reward_weights": ("rewards.weights", None),
    "sync_ref_model": ("algorithm.ref_sync_steps", _ref_sync),
    "ref_model_sync_steps": ("algorithm.ref_sync_steps", _ref_sync),
    "ref_model_mixup_alpha": (
        "algorithm.ref_sync_alpha",
        lambda a, n: a.ref_model_mixup_alpha if a.sync_ref_model else _UNSET,
    ),
    "learning_rate": ("training.learning_rate", None),
    "lr_scheduler_type": ("training.lr_scheduler_type", None),
    "warmup_steps": ("training.warmup_steps", _warmup),
    "weight_decay": ("training.weight_decay", None),
    "adam_beta1": ("training.adam_beta1", None),
    "adam_beta2": ("training.adam_beta2", None),
    "adam_epsilon": ("training.adam_epsilon", None),
    "max_grad_norm": ("training.max_grad_norm", None),
    "per_device_train_batch_size": ("training.per_device_train_batch_size", None),
    "gradient_accumulation_steps": ("training.gradient_accumulation_steps", None),
    "max_steps": ("training.max_steps", lambda a, n: a.steps(n)),
    "num_train_epochs": ("training.max_steps", lambda a, n: a.steps(n)),
    "seed": ("training.seed", None),
    "data_seed": ("data.seed", lambda a, n: a.seed if a.data_seed is None else a.data_seed),
    "shuffle_dataset": ("data.shuffle", lambda a, n: a.shuffle_dataset),
    "bf16": ("training.bf16", lambda a, n: True if a.bf16 is None else a.bf16),
    "gradient_checkpointing": (
        "training.gradient_checkpointing",
        lambda a, n: (
            a.gradient_checkpointing
            if a.activation_checkpointing is None
            else a.activation_checkpointing
        ),
    ),
    "activation_checkpointing": (
        "training.gradient_checkpointing",
        lambda a, n: (
            a.gradient_checkpointing
            if a.activation_checkpointing is None
            else a.activation_checkpointing
        ),
    ),
    "trust_remote_code": ("model.trust_remote_code", None),
    "use_cpu": ("training.device", lambda a, n: "cpu" if a.use_cpu else "auto"),
    "logging_steps": (
        "logging.log_every",
        lambda a, n: a._in_steps(a.logging_steps, n, "steps", "logging_steps"),
    ),
    "report_to": ("logging.report_to", _report_to),
    # TRL logs completions every logging_steps when asked, and none otherwise
    "log_completions": (
        "logging.sample_every",
        lambda a, n: (
            a._in_steps(a.logging_steps, n, "steps", "logging_steps") if a.log_completions else 0
        ),
    ),
    "run_name": ("logging.run_name", None),
    "save_strategy": (
        "training.save_steps",
        lambda a, n: a._in_steps(a.save_steps, n, a.save_strategy, "save_steps"),
    ),
    "save_steps": (
        "training.save_steps",
        lambda a, n: a._in_steps(a.save_steps, n, a.save_strategy, "save_steps"),
    ),
    "save_total_limit": ("training.save_total_limit", lambda a, n: a.save_total_limit or 0),
    "eval_strategy": (
        "eval.every",
        lambda a, n: a._in_steps(a.eval_steps or a.logging_steps, n, a.eval_strategy, "eval_steps"),
    ),
    "eval_steps": (
        "eval.every",
        lambda a, n: a._in_steps(a.eval_steps or a.logging_steps, n, a.eval_strategy, "eval_steps"),
    ),
    "per_device_eval_batch_size": ("eval.batch_size", None),
    "eval_on_start": ("eval.before", None),
}
"""Every GRPOConfig field, and the grpo key it sets, but CHECKED_ONLY's."""

CHECKED_ONLY = (
    "generation_kwargs",
    "generation_batch_size",
    "steps_per_generation",
    "disable_dropout",
    "optim",
    "vllm_mode",
    "vllm_importance_sampling_clip_min",
    "grpo_overrides",
    "num_generations_eval",
)
"""Fields that set no key: grpo has one value for each (refused otherwise, in `_check`),
generation_kwargs (its entries set the keys of GENERATION_KWARGS) and grpo_overrides."""

GENERATION_KWARGS = {
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "min_p": "rollout.min_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "max_new_tokens": "rollout.max_completion_length",
    "max_tokens": "rollout.max_completion_length",
    "stop": "rollout.stop_strings",
    "stop_strings": "rollout.stop_strings",
    "ignore_eos": "rollout.ignore_eos",
    "min_new_tokens": "rollout.min_new_tokens",
    "min_tokens": "rollout.min_new_tokens",
}
"""generation_kwargs entries grpo implements (transformers' and vLLM's names) -> grpo keys."""


def _json_dict(value, field_name: str) -> dict:
    """A dict field that may be given as JSON text (as transformers' argument parser leaves it)."""
    if value is None:
        return {}
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError as error:
            raise ConfigError(
                f"GRPOConfig.{field_name}: not JSON ({error}); pass a dict or its JSON text"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"GRPOConfig.{field_name}: expected a dict, got {type(value).__name__}")
    return value


def _generation_key(name: str, value) -> str | None:
    """The grpo key a generation_kwargs entry sets (None: do_sample=True, what grpo does anyway)."""
    if name == "do_sample":
        if value is True:
            return None
        raise ConfigError(
            "GRPOConfig.generation_kwargs['do_sample']: grpo always samples in training "
            "(evaluation decodes greedily and at temperature 1 by itself); remove it"
        )
    if name not in GENERATION_KWARGS:
        raise ConfigError(
            f"GRPOConfig.generation_kwargs[{name!r}]: not implemented by grpo's engines; "
            f"those taken are {', '.join(sorted(GENERATION_KWARGS))}"
        )
    return GENERATION_KWARGS[name]


NO_EFFECT = {
    # generation servers and kernels grpo does not have; its own engine generates
    "vllm_model_impl",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_group_port",
    "vllm_max_model_length",
    "vllm_tensor_parallel_size",
    "vllm_importance_sampling_cap",
    "use_transformers_paged",
    "use_transformers_continuous_batching",
    "cache_implementation",
    "use_cache",
    "ds3_gather_for_generation",
    "pad_to_multiple_of",
    "use_liger_kernel",
    "torch_compile",
    "tf32",
    # the Hub, distributed launchers, dataloaders and console verbosity
    "push_to_hub",
    "hub_model_id",
    "hub_strategy",
    "hub_token",
    "hub_private_repo",
    "hub_always_push",
    "hub_revision",
    "log_completions_hub_repo",
    "ddp_find_unused_parameters",
    "ddp_backend",
    "ddp_timeout",
    "local_rank",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_drop_last",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "remove_unused_columns",
    "logging_strategy",
    "logging_first_step",
    "logging_dir",
    "log_level",
    "log_level_replica",
    "disable_tqdm",
    "num_completions_to_print",
    "log_unique_prompts",
    "log_on_each_node",
    "skip_memory_metrics",
    "do_train",
    "do_eval",
    "do_predict",
    "project",
    "trackio_space_id",
    "save_only_model",
    "save_on_each_node",
    "save_safetensors",
    "include_num_input_tokens_seen",
    "average_tokens_across_devices",
}
"""TRL fields accepted and named in a warning: they change nothing about what is trained here
(grpo generates with its own engine, logs every step, and sets up its own processes and devices:
torchrun's, when it starts them)."""

_HINTS = {
    "fp16": "train in bf16 (bf16=True, the default) or load the model in float16 (grpo_overrides=['model.dtype=float16'])",
    "lr_scheduler_kwargs": "use lr_scheduler_type constant, linear or cosine with warmup_steps",
    "warmup_ratio": "use warmup_steps (a float below 1 is a fraction of the run)",
    "model_init_kwargs": "load the model yourself and pass it, or set grpo_overrides=['model.dtype=bfloat16']",
    "resume_from_checkpoint": "pass it to train(resume_from_checkpoint=...)",
    "cast_lm_head_to_fp32": "grpo's output layer runs in the training precision and takes its softmax, logprobs "
    "and entropy in float32; for a float32 product too, train in float32 (bf16=False)",
    "deepspeed": "grpo shards with FSDP2 itself: run `grpo train` under torchrun with training.sharding=fsdp",
    "fsdp": "run `grpo train` under torchrun with training.sharding=fsdp (grpo's own FSDP2)",
    "auto_find_batch_size": "set per_device_train_batch_size yourself",
}


def _tools(tools) -> list:
    """GRPOTrainer's tools=: functions (sync or async) with type hints and a docstring."""
    if tools is None:
        return []
    if callable(tools) or isinstance(tools, str):
        tools = [tools]
    tools = list(tools)
    for tool in tools:
        if not callable(tool):
            raise TypeError(
                f"GRPOTrainer: tools= takes functions (with type hints and a docstring), got {type(tool).__name__}"
            )
    return tools


def _refusal(name: str) -> str:
    hint = _HINTS.get(
        name, "remove it (grpo's own settings go in grpo_overrides=['section.key=value'])"
    )
    return f"GRPOConfig: grpo does not implement TRL's `{name}`; {hint}"


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *sections, key = dotted.split(".")
    for section in sections:
        data = data.setdefault(section, {})
    data[key] = value


def _with_fields(message: str) -> str:
    """A grpo config error, with the GRPOConfig fields that set the key it names."""
    names = sorted(
        {name for name, (key, _) in MAPPING.items() if f"{key}:" in message or f"{key}=" in message}
    )
    return f"{message} (GRPOConfig: {', '.join(names)})" if names else message


# --------------------------------------------------------------------------
# GRPOTrainer
# --------------------------------------------------------------------------


class GRPOTrainer:
    """TRL's GRPOTrainer arguments, trained by grpo.training.trainer.Trainer.

    `model`: a model object (then `processing_class` is its tokenizer, or is loaded from the
    model's `name_or_path`) or a name or path for grpo's loader. `reward_funcs`: a callable,
    a grpo reward name, a reward model's id or path, or a list of them. `train_dataset`: a
    datasets.Dataset or IterableDataset, a list of row dicts or a .jsonl path, with a `prompt`
    column (text or chat messages) and any columns the reward functions take; reward
    functions also get `trainer_state` (global_step, max_steps, epoch), as in TRL.
    `peft_config`: a peft.LoraConfig, trained as grpo's LoRA (model.lora).

    An IterableDataset is read up front, as far as one run goes: its first max_steps x
    prompts-per-step rows (max_steps is then required, as in TRL), drawn in a shuffled order
    like a Dataset's; a stream that ends sooner is gone through again, epoch after epoch,
    and an empty one is an error. A held-out IterableDataset is read to eval.num_problems
    rows (grpo_overrides), or whole up to EVAL_STREAM_LIMIT rows."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_func=None,
        **unknown,
    ):
        if "reward_processing_class" in unknown:
            raise TypeError(
                "GRPOTrainer: unknown argument reward_processing_class=; TRL's is reward_processing_classes= "
                "(plural), the tokenizers of reward models given by id; a reward function needs none"
            )
        if unknown:
            raise TypeError(f"GRPOTrainer: unknown argument(s) {', '.join(sorted(unknown))}")
        if optimizers != (None, None):
            raise NotImplementedError(
                "GRPOTrainer: optimizers= is not supported; grpo builds AdamW from learning_rate, weight_decay and adam_*"
            )
        if _rerun_by_a_spawned_worker():
            raise RuntimeError(
                "GRPOTrainer: a reward worker process (rewards.isolation=process) imported the training script, "
                'which trains at its top level; train under `if __name__ == "__main__":` or use '
                "grpo_overrides=['rewards.isolation=thread']"
            )
        if (reward_funcs is None or reward_funcs == []) and environment_factory is None:
            raise ValueError(
                "GRPOTrainer: No reward source provided; pass reward_funcs (a callable, a grpo reward name, "
                "a reward model's id or path, or a list of them), or an environment_factory whose "
                "environment defines get_reward"
            )
        if args is None:  # TRL's default: a directory named after the model
            name = (
                model
                if isinstance(model, (str, Path))
                else getattr(model, "name_or_path", "") or "model"
            )
            args = GRPOConfig(output_dir=f"{Path(str(name)).name}-GRPO")
        if train_dataset is None:
            train_dataset = _environment_owned_rows(environment_factory, args)
        self.args = args
        self._peft_model = None
        if _is_peft_model(model):
            if peft_config is not None:
                raise ConfigError(
                    "GRPOTrainer: model is a PeftModel and peft_config is given; pass one: the PeftModel (its "
                    "adapter is trained) or the base model with peft_config (merge_and_unload the PeftModel first)"
                )
            self._peft_model = model
            model, lora = _adopt_peft_model(model)
        else:
            lora = lora_keys(peft_config, model) if peft_config is not None else None
        reward_funcs = [] if reward_funcs is None else reward_funcs
        lora = {**(lora or {}), "rewards.funcs": _reward_specs(reward_funcs)}
        if _is_iterable_dataset(train_dataset):
            if args.max_steps <= 0:
                raise ValueError(
                    "GRPOTrainer: train_dataset is an IterableDataset, which has no length to count epochs in; "
                    "set GRPOConfig.max_steps"
                )
            self.config = self.args.to_config(None, lora)
            c = self.config
            train_rows = _take(
                train_dataset,
                "train_dataset",
                c.training.max_steps * (c.generation_batch_size() // c.rollout.num_generations),
            )
        else:
            train_rows = _rows(train_dataset, "train_dataset")
            self.config = self.args.to_config(len(train_rows), lora)
        # TRL's default prompt, for rows an environment sets the task of
        if environment_factory is not None:
            train_rows = [
                {"prompt": [{"role": "user", "content": ""}], **row} for row in train_rows
            ]
        self.eval_dataset = eval_dataset
        """The held-out data as passed: one dataset, or a dict (or DatasetDict) of named ones."""
        if _is_dataset_dict(eval_dataset):
            if self.config.eval.before or self.config.eval.every:
                raise ConfigError(
                    "GRPOTrainer: eval_dataset is a dict of datasets, and grpo evaluates one held-out set during "
                    "training (eval_strategy, eval_on_start); pass one dataset, or evaluate each after training "
                    "with trainer.evaluate()"
                )
            eval_rows = None
        else:
            eval_rows = _eval_rows(eval_dataset, self.config)
        if isinstance(model, (str, Path)):
            self.config.model.name = str(model)
            model = None
            if processing_class is not None:
                from grpo.models.loading import load_model_and_tokenizer

                model, _ = load_model_and_tokenizer(self.config.model)
        elif processing_class is None:
            processing_class = _tokenizer_of(model)
        if processing_class is not None:
            from grpo.models.loading import _prepare_tokenizer

            # left padding and a pad token, as grpo's loader gives
            _prepare_tokenizer(processing_class)
        self._reward_funcs = _reward_funcs(reward_funcs, reward_processing_classes, self.config)
        """The reward functions passed, by name (those of environments are added by the Trainer)."""
        self.rollout_func = rollout_func
        """TRL's attribute: the rollout_func passed, or None; the one here is what rollouts call."""
        self.reward_processing_classes = _processing_classes(
            reward_processing_classes, len(self._reward_funcs)
        )
        """One per reward function, as TRL keeps them (None where the function needs none or a
        reward model uses its own tokenizer)."""
        _script_rewards_in_threads(self._reward_funcs, self.config, self.args.grpo_overrides)
        _warn_length_weighted_sequences(self.args)
        from transformers import TrainerControl

        from grpo.training.callbacks import Callbacks

        self.callback_handler = Callbacks(callbacks or (), args=self.args, control=TrainerControl())
        """The callbacks (transformers.TrainerCallback objects), called with this GRPOConfig as
        `args`, a RunState as `state` and a transformers.TrainerControl as `control`."""
        self.state = self.callback_handler.state
        """TrainerState's names: global_step, max_steps, epoch, log_history, ... (optimizer steps)."""
        self._inputs = dict(
            model=model,
            tokenizer=processing_class,
            train_rows=train_rows,
            eval_rows=eval_rows,
            reward_funcs=self._reward_funcs,
            tools=_tools(tools),
            environment_factory=environment_factory,
            # TRL calls it with the trainer it was given to
            rollout_func=None if rollout_func is None else partial(_call_rollout_func, self),
        )
        from grpo.training.evaluate import held_out_group_evaluation

        # TRL's group evaluation in every evaluation's row; TRL raises for a row naming no
        # environment in train(): checked when train() starts (Trainer.check_environment_rows)
        self._hooks = dict(
            callbacks=self.callback_handler,
            extra_evaluation=held_out_group_evaluation(
                self.args.num_generations_eval or self.args.num_generations
            ),
        )
        from grpo.run import checkpoint
        from grpo.training.build import build_parts
        from grpo.training.trainer import Trainer

        # An output_dir holding a run is refused by grpo unless resumed, but whether train() will
        # resume is not known yet: built here as if it may be overwritten (which happens only when
        # training starts), and train() refuses it there unless resuming or overwrite_output_dir.
        self._holds_run = (
            bool(checkpoint.checkpoints(Path(self.config.output_dir)))
            and not self.config.overwrite_output_dir
        )
        start = self.config
        if self._holds_run:
            start = copy.deepcopy(self.config)
            start.overwrite_output_dir = True
        self.trainer = Trainer(build_parts(start, **self._inputs), **self._hooks)
        self.model, self.processing_class = self._policy(), self.trainer.tokenizer

    def _policy(self):
        """The model trained, as TRL hands it back: the PeftModel passed, or the PeftModel grpo
        made from peft_config (its base model is grpo's policy module, adapted in place), else
        grpo's policy module."""
        if self._peft_model is not None:
            return self._peft_model
        from grpo.models.lora import peft_model

        return peft_model(self.trainer.model) or self.trainer.model

    # -------------------------------------------------------------- callbacks (transformers' names)

    def add_callback(self, callback) -> None:
        """Adds a callback (a TrainerCallback object, or its class)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        """Removes and returns the callback (or the first of that class); None when absent."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        """Removes the callback (or the first of that class)."""
        self.callback_handler.remove(callback)

    @property
    def control(self):
        """The transformers.TrainerControl the callbacks act on."""
        return self.callback_handler.control

    @property
    def reward_funcs(self) -> list:
        """The reward functions, as TRL lists them: those passed, then one per environment class
        with get_reward (and grpo's overlong penalty when configured)."""
        return list(self.trainer.rewards.funcs)

    @property
    def reward_func_names(self) -> list[str]:
        return list(self.trainer.rewards.names)

    @property
    def reward_weights(self):
        """The reward functions' weights (a tensor, as in TRL)."""
        return self.trainer.rewards.weights.clone()

    @property
    def tools(self) -> list:
        """The tools as functions: those passed, then each environment's methods (of its first
        instance), as TRL lists them."""
        if "trainer" not in vars(self):
            return vars(self).get("_assembled_tools")
        tools = list(self.trainer.tool_functions)
        environments = self.trainer.environments
        for functions in (environments.tool_functions if environments else {}).values():
            tools += [f for f in functions if f not in tools]
        return tools

    @tools.setter
    def tools(self, value) -> None:
        # the tools' schemas are in the prompts and the rollout engine from construction on, so a
        # built trainer's cannot change; an object put together without __init__ (as TRL's tests
        # assemble one) holds what it is given
        if "trainer" in vars(self):
            raise ConfigError(
                "GRPOTrainer.tools: a built trainer's tools are fixed (their schemas are in its prompts); "
                "pass tools= to GRPOTrainer"
            )
        vars(self)["_assembled_tools"] = value

    @property
    def environments(self) -> list | None:
        """The last batch's environments, one per completion (TRL's attribute); None without
        environment_factory."""
        if self.trainer.environments is None:
            return None
        return [episode.environment for episode in self.trainer.episodes]

    @property
    def _env_tools(self) -> dict:
        """TRL's per-environment tool lists: {name (None for a single factory): functions}."""
        return self.trainer.environments.tool_functions if self.trainer.environments else {}

    @property
    def _environment_pool(self) -> dict:
        """TRL's pools of reusable instances: {name: [environments]}."""
        return self.trainer.environments.pool if self.trainer.environments else {}

    def _generate(self, prompts: list) -> tuple:
        """TRL's generation step, for code written against it: completions for `prompts`, one per
        completion (a row's prompt repeated, as TRL's batch holds them), by the rollout_func when
        there is one, else by the rollout engine with the training sampling settings (tools and
        environments too), from seeds drawn from torch's global generator (the run's own is not
        touched). Returns TRL 1.16's tuple (prompt_ids, completion_ids, tool_mask, completions,
        logprobs, extra_fields, images, tool_images): lists per completion; tool_mask 1 on the
        model's tokens and 0 on tool results (None without them); images None and tool_images
        empty (grpo trains text models)."""
        from grpo.rollout.custom import read_output, require_keys
        from grpo.rollout.types import prompt_seeds
        from grpo.training import sampling

        prompts = copy.deepcopy(prompts)
        if self.rollout_func is not None:
            output = self.rollout_func(prompts, self)
            require_keys(output)  # TRL's first check, before anything of the run is read
            t = self.trainer
            rollout, extra = read_output(
                output, len(prompts), **sampling.rollout_limits(t.engine, t.model, t.sampling)
            )
        else:
            t = self.trainer
            rows = [{"prompt": prompt} for prompt in prompts]
            with t.backend.generation(t.model):
                rollout, context = t.sample(rows, 1, t.sampling, prompt_seeds(None, len(rows)))
            extra = {}
        return _trl_generation(rollout, prompts, extra, self.trainer.tokenizer) + (None, [])

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's attribute): entropy_coef, as the adaptive
        controller has moved it (use_adaptive_entropy)."""
        control = self.trainer.state.entropy
        return control.coef if control is not None else self.args.entropy_coef

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL adds a mixture-of-experts model's router load-balancing loss when its config has
        output_router_logits; grpo does not (warned at start for such a model): always False."""
        return False

    @property
    def ref_model(self):
        """The KL reference (TRL's attribute): None when beta is 0 (no reference is used) or with
        LoRA (the policy with its adapter switched off is the reference, as in TRL); otherwise
        the frozen copy of the starting policy."""
        reference = self.trainer.reference
        if not reference.enabled:
            return None
        return getattr(reference, "model", None)

    def train(self, resume_from_checkpoint: str | bool | None = None):
        """Trains to max_steps; `resume_from_checkpoint`: a checkpoint directory, or True for the
        latest one in output_dir. Returns TRL's TrainOutput-like (global_step, training_loss, metrics)."""
        self.trainer.check_environment_rows()
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        elif self._holds_run:
            from grpo.run.runlog import check_output_dir

            try:
                check_output_dir(Path(self.config.output_dir), overwrite=False)
            except ConfigError as error:
                raise ConfigError(
                    f"{error}. From GRPOTrainer: train(resume_from_checkpoint=True) continues it; "
                    "GRPOConfig(overwrite_output_dir=True) starts afresh"
                ) from None
        self.trainer.train()
        last = self.state.log_history[-1] if self.state.log_history else {}
        summary = (
            {
                k: v
                for k, v in last.items()
                if k.startswith("train_") or k in ("total_flos", "epoch")
            }
            if "train_runtime" in last
            else {}
        )
        return TrainOutput(self.state.global_step, summary.get("train_loss", 0.0), summary)

    def _resume(self, checkpoint_path: str | bool) -> None:
        from grpo.run import checkpoint
        from grpo.training.build import build_parts
        from grpo.training.trainer import Trainer

        path = (
            checkpoint.latest_checkpoint(Path(self.config.output_dir))
            if checkpoint_path is True
            else Path(checkpoint_path)
        )
        if path is None:
            raise ValueError(
                f"train(resume_from_checkpoint=True): no checkpoint in {self.config.output_dir}"
            )
        # the trainer built at construction holds no training yet: replace it by one that resumes
        self.trainer.rewards.close()
        self.trainer = Trainer(build_parts(self.config, **self._inputs, resume=path), **self._hooks)
        self.model, self._holds_run = self._policy(), False

    def save_model(self, output_dir: str | None = None) -> None:
        """The policy and tokenizer, loadable with from_pretrained (default: output_dir)."""
        directory = Path(output_dir or self.config.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)

    def evaluate(
        self,
        eval_dataset=None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Held-out evaluation of `eval_dataset` (default: the trainer's), its metrics keyed
        `{metric_key_prefix}_...`; a dict of datasets (or a DatasetDict) is evaluated one by one,
        each under `{metric_key_prefix}_{name}_...`, as transformers does.

        Two measures, both logged (log_history, on_evaluate; eval.jsonl for the second):
        TRL's (grpo.training.evaluate.group_evaluation: num_generations_eval sampled
        completions per prompt, their `loss`, `reward`, `reward_std`, `rewards/<name>/mean`,
        `completions/...`), and grpo's (one greedy and one temperature-1 completion per
        prompt, eval.temperatures: `{decoding}/accuracy` by the task's scorer and
        `{decoding}/mean_reward`). Then `runtime`, `samples_per_second`, `steps_per_second`
        and `epoch`. `ignore_keys` (model outputs to leave out, in transformers) has nothing
        to act on here."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("GRPOTrainer.evaluate: needs eval_dataset (here or at construction)")
        if _is_dataset_dict(dataset):
            metrics: dict[str, float] = {}
            for name, split in dataset.items():
                metrics.update(self.evaluate(split, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        import time

        from grpo.tasks.scorers import AnswerScorer, RewardScorer, has_integer_answers
        from grpo.training.evaluate import Evaluator, group_evaluation
        from grpo.training.trainer import eval_metrics

        t, started = self.trainer, time.monotonic()
        rows = (
            t.task.eval_rows
            if eval_dataset is None and t.task.eval_rows
            else _eval_rows(dataset, self.config)
        )
        scorer = AnswerScorer() if has_integer_answers(rows) else RewardScorer()
        evaluator = Evaluator(
            self.config, t.engine, t.tokenizer, rows, scorer, t.rewards, t.backend
        )
        step = t.state.step
        with t.backend.generation(t.model):
            results = t.log.evaluation(
                "evaluate",
                step,
                len(evaluator.rows),
                evaluator.num_batches,
                lambda progress: evaluator("evaluate", step, progress),
            )
        G = self.args.num_generations_eval or self.args.num_generations
        metrics = {
            f"{metric_key_prefix}_{k}": v for k, v in group_evaluation(t, evaluator.rows, G).items()
        }
        metrics.update(eval_metrics(results, metric_key_prefix))
        runtime = max(time.monotonic() - started, 1e-9)
        batches = math.ceil(len(evaluator.rows) * G / max(1, self.args.per_device_eval_batch_size))
        metrics[f"{metric_key_prefix}_runtime"] = round(runtime, 4)
        metrics[f"{metric_key_prefix}_samples_per_second"] = round(len(evaluator.rows) / runtime, 3)
        metrics[f"{metric_key_prefix}_steps_per_second"] = round(batches / runtime, 3)
        t._sync_run_state()
        t._log_row(metrics)
        metrics["epoch"] = self.state.epoch
        self.callback_handler.fire("on_evaluate", metrics=metrics)
        return metrics

    # -------------------------------------------------------------- TRL's helpers

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """TRL's: the tokens (where `mask` is 1) whose entropy is at or above the `threshold`
        quantile of the masked entropies, one threshold over the whole tensor (grpo's
        algorithm.entropy_mask with quantile 1 - threshold, scope batch; one process's tokens)."""
        from grpo.algorithm import entropy_mask

        if not 0.0 <= threshold <= 1.0:
            raise ValueError(
                f"get_high_entropy_mask: threshold must be in [0, 1], got {threshold!r}"
            )
        return entropy_mask(entropies, mask, 1.0 - threshold, "batch")

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's off-policy sequence mask (DeepSeek-V3.2): [B, 1], 1.0 to keep a completion (its
        advantage >= 0, or its mean per-token KL(pi_old || pi_theta) <= the threshold), 0.0 to
        drop it; grpo's algorithm.off_policy_mask."""
        from grpo import algorithm

        off_policy_mask = getattr(algorithm, "off_policy_mask", None)
        if off_policy_mask is None:
            raise NotImplementedError(
                "GRPOTrainer.get_off_policy_mask: grpo.algorithm has no off_policy_mask in this version; "
                "upgrade grpo"
            )
        return off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )


@dataclass
class TrainOutput:
    global_step: int
    training_loss: float
    metrics: dict


def _is_dataset_dict(dataset) -> bool:
    """A dict of named datasets: a dict, a datasets.DatasetDict or IterableDatasetDict."""
    return isinstance(dataset, dict)  # DatasetDict and IterableDatasetDict are dicts


def _is_peft_model(model) -> bool:
    peft = sys.modules.get("peft")  # not imported: then it cannot be one
    return peft is not None and isinstance(model, peft.PeftModel)


def _adopt_peft_model(model) -> tuple[Any, dict[str, Any]]:
    """A peft.PeftModel holding one plain LoRA adapter, as grpo's LoRA holds its own: the
    transformers model inside (adapted in place) with the wrapper kept beside it
    (grpo.models.lora.peft_model), and the model.lora keys of that adapter. Its adapter is the
    one trained, from the weights it has; anything grpo's LoRA cannot train is refused by name."""
    import peft

    from grpo.models import lora

    configs = dict(model.peft_config)
    if list(configs) != [lora.POLICY_ADAPTER]:
        raise ConfigError(
            f"GRPOTrainer: model is a PeftModel with adapters {sorted(configs)}; grpo trains one LoRA adapter "
            f"named {lora.POLICY_ADAPTER!r}: pass a PeftModel made with get_peft_model(model, LoraConfig(...)), "
            "or the base model with peft_config"
        )
    config = configs[lora.POLICY_ADAPTER]
    if not isinstance(config, peft.LoraConfig):
        raise ConfigError(
            f"GRPOTrainer: model is a PeftModel with a {type(config).__name__} adapter; grpo trains LoRA adapters "
            "only: use peft.LoraConfig"
        )
    if config.inference_mode:
        raise ConfigError(
            "GRPOTrainer: model is a PeftModel loaded for inference (its adapter is frozen); load it with "
            "PeftModel.from_pretrained(base_model, path, is_trainable=True)"
        )
    inner = model.get_base_model()
    keys = lora_keys(config, inner)
    object.__setattr__(inner, lora._WRAPPER, model)
    return inner, keys


def _reward_specs(funcs) -> list[str]:
    """What rewards.funcs records of the reward functions passed (one entry each, so that
    reward_weights is checked against their number): a name or path as given, a callable's name."""
    funcs = funcs if isinstance(funcs, list) else [funcs]
    return [
        str(fn)
        if isinstance(fn, (str, Path))
        else getattr(fn, "__name__", None)
        or getattr(getattr(fn, "config", None), "name_or_path", None)
        or type(fn).__name__
        for fn in funcs
    ]


def _warn_length_weighted_sequences(args: GRPOConfig) -> None:
    """TRL's warning: a sequence-level ratio (GSPO) with a loss that sums token contributions."""
    if args.importance_sampling_level == "sequence" and args.loss_type in (
        "bnpo",
        "dr_grpo",
        "dapo",
        "cispo",
    ):
        import logging

        logging.getLogger(__name__).warning(
            "importance_sampling_level='sequence' with loss_type=%r: that loss sums per-token contributions, which "
            "weights each sequence by its completion length instead of optimising the per-sequence (GSPO) "
            "objective; set loss_type='grpo' for the GSPO paper's setup",
            args.loss_type,
        )


def _call_rollout_func(trainer: "GRPOTrainer", prompts, _grpo_trainer):
    return trainer.rollout_func(prompts, trainer)


def _trl_generation(rollout, prompts: list, extra: dict, tokenizer) -> tuple:
    """A Rollout as the first six items of TRL's _generate: (prompt_ids, completion_ids,
    tool_mask, completions, logprobs, extra_fields), lists per completion."""
    prompt_ids = [
        row[mask.bool()].tolist() for row, mask in zip(rollout.prompt_ids, rollout.prompt_mask)
    ]
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    completion_ids = [row[:n].tolist() for row, n in zip(rollout.completion_ids, lengths)]
    tool_mask = logprobs = None
    if rollout.tool_mask is not None:
        tool_mask = [
            [1 - t for t in row[:n].tolist()] for row, n in zip(rollout.tool_mask, lengths)
        ]
    if rollout.sampling_logprobs is not None:
        logprobs = [row[:n].tolist() for row, n in zip(rollout.sampling_logprobs, lengths)]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    if prompts and isinstance(prompts[0], list):  # conversational: the messages, as TRL's
        messages = rollout.messages or [None] * len(texts)
        completions = [m or [{"role": "assistant", "content": x}] for m, x in zip(messages, texts)]
    else:
        completions = texts
    return prompt_ids, completion_ids, tool_mask, completions, logprobs, dict(extra)


def _environment_owned_rows(environment_factory, args: GRPOConfig) -> list[dict]:
    """TRL's rows when no train_dataset is given: an environment whose reset sets each task owns
    the data; one generation batch of empty prompts, gone through max_steps times."""
    if environment_factory is None:
        raise ValueError(
            "GRPOTrainer: `train_dataset` is required unless an `environment_factory` is provided (a "
            "datasets.Dataset, a list of dicts or a .jsonl path)"
        )
    if isinstance(environment_factory, dict):
        raise ValueError(
            "GRPOTrainer: a dict environment_factory (several environments) requires a `train_dataset` with an "
            "`environment` column naming each row's environment; give one, or a single factory"
        )
    if args.max_steps <= 0:
        raise ValueError(
            "GRPOTrainer: without a train_dataset (the environment's reset() sets each task), max_steps sets the "
            "length of training; set GRPOConfig(max_steps=...)"
        )
    prompts = max(
        1,
        args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations,
    )
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(prompts)]


def _rows(dataset, what: str) -> list[dict]:
    if isinstance(dataset, (str, Path)):
        from grpo.tasks.data import read_jsonl

        return read_jsonl(dataset, "prompt")
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        return dataset.to_list()
    if isinstance(dataset, list) and all(isinstance(row, dict) for row in dataset):
        return [dict(row) for row in dataset]
    raise TypeError(
        f"GRPOTrainer: {what} must be a datasets.Dataset or IterableDataset, a list of dicts or a .jsonl path, got {type(dataset).__name__}"
    )


EVAL_STREAM_LIMIT = 10_000
"""The most held-out rows read from an IterableDataset without eval.num_problems: one that
goes on past it may be endless, and is refused."""


def _is_iterable_dataset(dataset) -> bool:
    datasets = sys.modules.get("datasets")  # not imported: then it cannot be one
    return datasets is not None and isinstance(dataset, datasets.IterableDataset)


def _take(dataset, what: str, count: int) -> list[dict]:
    """The first `count` rows of an IterableDataset (fewer when it ends sooner)."""
    import itertools

    rows = [dict(row) for row in itertools.islice(iter(dataset), count)]
    if not rows:
        raise ValueError(f"GRPOTrainer: {what} (an IterableDataset) yielded no rows")
    return rows


def _eval_rows(dataset, cfg: Config) -> list[dict] | None:
    if dataset is None:
        return None
    if not _is_iterable_dataset(dataset):
        return _rows(dataset, "eval_dataset")
    wanted = cfg.eval.num_problems
    rows = _take(dataset, "eval_dataset", wanted or EVAL_STREAM_LIMIT + 1)
    if wanted is None and len(rows) > EVAL_STREAM_LIMIT:
        raise ValueError(
            f"GRPOTrainer: eval_dataset is an IterableDataset of more than {EVAL_STREAM_LIMIT} rows (maybe endless); "
            "say how many to hold out with GRPOConfig(grpo_overrides=['eval.num_problems=N'])"
        )
    return rows


# --------------------------------------------------------------------------
# peft_config: a peft.LoraConfig as grpo's model.lora
# --------------------------------------------------------------------------

LORA_MAPPING = {
    "r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "target_modules": "model.lora.target_modules",
}
"""LoraConfig field -> the grpo key it sets."""

LORA_DESCRIPTIVE = {
    "task_type",
    "peft_type",
    "peft_version",
    "auto_mapping",
    "base_model_name_or_path",
    "runtime_config",
}
"""LoraConfig fields peft fills in itself or that describe the wrapper rather than the adapter
(task_type is checked on its own). Any other field off peft's default is refused by name."""


def lora_keys(peft_config, model=None) -> dict[str, Any]:
    """The grpo keys (model.lora.*) a peft.LoraConfig stands for; a ConfigError naming each of
    its settings that grpo's plain LoRA does not honour (DoRA, biases, rank patterns, ...)."""
    import peft

    if not isinstance(peft_config, peft.LoraConfig):
        raise TypeError(
            f"GRPOTrainer: peft_config must be a peft.LoraConfig (grpo trains LoRA adapters), "
            f"got {type(peft_config).__name__}"
        )
    task = peft_config.task_type
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ConfigError(
            f"GRPOTrainer: peft_config.task_type={task!s}: grpo trains causal language models; "
            "use task_type='CAUSAL_LM' or leave it unset"
        )
    default = peft.LoraConfig()
    refused = [
        f.name
        for f in dataclasses.fields(peft_config)
        if f.name not in LORA_MAPPING
        and f.name not in LORA_DESCRIPTIVE
        and getattr(peft_config, f.name) != getattr(default, f.name)
    ]
    if refused:
        settings = ", ".join(f"{name}={getattr(peft_config, name)!r}" for name in refused)
        raise ConfigError(
            f"GRPOTrainer: peft_config sets {settings}, which grpo's LoRA does not implement (plain adapters from "
            "r, lora_alpha, lora_dropout and target_modules); leave them at peft's defaults"
        )
    return {
        "model.lora.r": peft_config.r,
        "model.lora.alpha": float(peft_config.lora_alpha),
        "model.lora.dropout": float(peft_config.lora_dropout),
        "model.lora.target_modules": _lora_targets(peft_config.target_modules, model),
    }


def _lora_targets(targets, model) -> list[str]:
    if isinstance(targets, str):
        if targets == "all-linear":
            return ["all-linear"]
        raise ConfigError(
            f"GRPOTrainer: peft_config.target_modules={targets!r}: a string other than 'all-linear' is a regular "
            "expression in peft, which grpo does not take; list the module names instead (e.g. ['q_proj', 'v_proj'])"
        )
    if targets is not None:
        return sorted(targets)  # peft keeps a list as a set: no order to keep
    # peft's own choice for the architecture, as get_peft_model makes it
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS,
    )

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULTS:
        return sorted(PEFT_DEFAULTS[model_type])
    warnings.warn(
        "GRPOTrainer: peft_config.target_modules=None and the model's type is not known here (peft picks per "
        "architecture): adapting every Linear layer (target_modules='all-linear'); set target_modules to choose",
        stacklevel=4,
    )
    return ["all-linear"]


def _tokenizer_of(model):
    name = getattr(model, "name_or_path", "") or ""
    if not name:
        raise ValueError(
            "GRPOTrainer: processing_class is required for a model built in memory (pass its tokenizer)"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _processing_classes(classes, count: int) -> list:
    """TRL's reading: None is None for each reward function; one tokenizer is a list of one."""
    if classes is None:
        return [None] * count
    return list(classes) if isinstance(classes, list) else [classes]


def _reward_funcs(funcs, processing_classes, cfg: Config) -> dict[str, Callable]:
    """Named reward functions, as TRL names them (the function's __name__, a model by its path)."""
    from grpo.rewards import reward_set as rewards

    funcs = funcs if isinstance(funcs, list) else [funcs]
    classes = _processing_classes(processing_classes, len(funcs))
    if len(classes) != len(funcs):
        raise ValueError(
            f"GRPOTrainer: the number of reward_processing_classes ({len(classes)}) must match the number "
            f"of reward_funcs ({len(funcs)}); give a list with one per reward function (None for a "
            "function, or for a reward model's own tokenizer)"
        )
    named: dict[str, Callable] = {}
    for fn, tokenizer in zip(funcs, classes):
        if isinstance(fn, (str, Path)):
            spec = str(fn)
            is_model = spec not in rewards.BUILTIN and spec not in rewards.CONFIGURED
            if tokenizer is not None and not is_model:
                raise ValueError(
                    f"GRPOTrainer: reward_processing_classes for {fn}: only a reward model takes a tokenizer; "
                    "pass None for it"
                )
            if is_model:
                from grpo.rewards.reward_model import from_spec

                name, fn = from_spec(spec, cfg.rewards, tokenizer)
            else:
                name, fn = rewards.resolve(spec, cfg.rewards)
        elif type(fn).__name__.endswith("ForSequenceClassification"):  # a reward model object
            from grpo.rewards.reward_model import RewardModel

            fn = RewardModel.from_model(
                fn,
                tokenizer,
                device=cfg.rewards.reward_model_device,
                batch_size=cfg.rewards.reward_model_batch_size,
            )
            name = fn.__name__
        elif callable(fn):
            name = getattr(fn, "__name__", type(fn).__name__)
        else:
            raise TypeError(
                f"GRPOTrainer: reward_funcs: {fn!r} is neither a callable nor a model id/path"
            )
        base, k = name, 1
        while name in named:  # two functions of one name each keep their own column
            k += 1
            name = f"{base}_{k}"
        named[name] = fn
    return named


def _script_rewards_in_threads(
    funcs: dict[str, Callable], cfg: Config, overrides: list[str]
) -> None:
    """Reward functions defined in the script itself run in threads of the trainer, unless
    rewards.isolation is set: a worker process loads them by importing the script again, and a
    TRL script trains at its top level (no `if __name__ == "__main__":`), so every worker
    would run the whole training."""
    in_script = [
        name for name, fn in funcs.items() if getattr(fn, "__module__", None) == "__main__"
    ]
    if (
        in_script
        and cfg.rewards.isolation == "process"
        and not any(o.startswith("rewards.isolation=") for o in overrides)
    ):
        cfg.rewards.isolation = "thread"
        warnings.warn(
            f"GRPOTrainer: reward functions defined in the script ({', '.join(in_script)}) run in threads of the "
            "trainer; to run them in worker processes (a hang or crash costs a worker, not the run), train under "
            "`if __name__ == \"__main__\":` and pass grpo_overrides=['rewards.isolation=process']",
            stacklevel=3,
        )


def _rerun_by_a_spawned_worker() -> bool:
    """Whether this call comes from the top level of a script that a spawned process is importing
    (as `__mp_main__`): an unguarded training script, re-run by a reward worker."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False
