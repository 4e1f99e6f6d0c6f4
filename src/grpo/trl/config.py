"""TRL's `GRPOConfig`: its field names with TRL 1.16's defaults, as grpo's `Config`.

TRL 1.16's defaults differ from grpo's own in places: bf16 and gradient
checkpointing on, logging every 10 steps, a checkpoint every 500, three
epochs. `MAPPING` is the one table of which TRL field sets which grpo key
(`DERIVED`: the keys no single field sets). A field that means what a grpo key means, with
its default, is one row of `SAME_MEANING` and nothing more: its type, default and docs are the
grpo key's, declared once in grpo's config. A TRL field outside the table is
either listed in `NO_EFFECT` (accepted, named in a warning) or refused by
name with what to use instead: a setting is never dropped silently.

Units: TRL counts `max_steps`, `save_steps`, `logging_steps` and `eval_steps`
in optimizer steps; a grpo step is one generation batch, which is
`num_iterations` optimizer steps, so those counts are divided by
num_iterations (rounded up). `per_device_train_batch_size` counts completions,
in both.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from grpo.config.errors import ConfigError
from grpo.config.loading import from_dict, set_dotted
from grpo.config.schema import Config

SAME_MEANING: dict[str, str] = {
    # TRL field: the grpo key of the same meaning and default (types, defaults and docs are grpo's)
    "overwrite_output_dir": "overwrite_output_dir",
    "num_generations": "rollout.num_generations",
    "max_completion_length": "rollout.max_completion_length",
    "max_prompt_length": "rollout.max_prompt_length",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "repetition_penalty": "rollout.repetition_penalty",
    "beta": "algorithm.beta",
    "epsilon": "algorithm.epsilon",
    "epsilon_high": "algorithm.epsilon_high",
    "delta": "algorithm.delta",
    "sapo_temperature_pos": "algorithm.sapo_temperature_pos",
    "sapo_temperature_neg": "algorithm.sapo_temperature_neg",
    "vespo_k_pos": "algorithm.vespo_k_pos",
    "vespo_lambda_pos": "algorithm.vespo_lambda_pos",
    "vespo_k_neg": "algorithm.vespo_k_neg",
    "vespo_lambda_neg": "algorithm.vespo_lambda_neg",
    "off_policy_mask_threshold": "algorithm.off_policy_mask_threshold",
    "multi_objective_aggregation": "algorithm.multi_objective_aggregation",
    "entropy_coef": "algorithm.entropy_coef",
    "use_adaptive_entropy": "algorithm.use_adaptive_entropy",
    "entropy_target": "algorithm.entropy_target",
    "entropy_coef_delta": "algorithm.entropy_coef_delta",
    "entropy_coef_min": "algorithm.entropy_coef_min",
    "entropy_coef_max": "algorithm.entropy_coef_max",
    "top_entropy_quantile": "algorithm.top_entropy_quantile",
    "importance_sampling_level": "algorithm.importance_sampling_level",
    "num_iterations": "algorithm.num_iterations",
    "mask_truncated_completions": "algorithm.mask_truncated_completions",
    "reward_weights": "rewards.weights",
    "learning_rate": "training.learning_rate",
    "lr_scheduler_type": "training.lr_scheduler_type",
    "weight_decay": "training.weight_decay",
    "adam_beta1": "training.adam_beta1",
    "adam_beta2": "training.adam_beta2",
    "adam_epsilon": "training.adam_epsilon",
    "max_grad_norm": "training.max_grad_norm",
    "per_device_train_batch_size": "training.per_device_train_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "seed": "training.seed",
    "trust_remote_code": "model.trust_remote_code",
    "run_name": "logging.run_name",
    "eval_on_start": "eval.before",
}


def _shared_fields() -> list[tuple[str, Any, Any]]:
    """SAME_MEANING's fields as dataclass fields: each grpo key's own type and default."""
    sections = {f.name: f for f in dataclasses.fields(Config)}
    fields = []
    for name, key in SAME_MEANING.items():
        section, _, leaf = key.rpartition(".")
        owner = sections[section].default_factory if section else Config
        declared = {f.name: f for f in dataclasses.fields(owner)}[leaf]
        default = (
            field(default_factory=declared.default_factory)
            if declared.default is dataclasses.MISSING
            else field(default=declared.default)
        )
        fields.append((name, declared.type, default))
    return fields


_Shared = dataclasses.make_dataclass("_Shared", _shared_fields())
"""TRL's fields that mean what a grpo key means, with its default: declared once, in grpo's config."""


@dataclass
class _Fields(_Shared):
    """TRL's GRPOConfig fields that grpo implements, with TRL 1.16's defaults, besides those of
    SAME_MEANING (`_Shared`): the fields whose default or meaning is TRL's own."""

    output_dir: str | None = None
    """None: `trainer_output`, as in transformers."""
    # generation
    min_p: float | None = None
    """None: off (rollout.min_p 0)."""
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
    loss_type: str = "dapo"
    """TRL's one name for grpo's two choices: cispo and sapo set algorithm.policy_loss (with the
    aggregation TRL uses with each, dapo and grpo); the others are aggregations of `clipped`."""
    use_bias_correction_kl: bool = True
    """TRL 1.16's default, True: the KL term weighted by the importance ratio
    (algorithm.kl_bias_correction, whose own default in grpo's YAML is false)."""
    max_tool_calling_iterations: int | None = None
    """Most turns with tool calls per completion (rollout.max_tool_calls). None (TRL's "no limit"):
    rollout.max_tool_calls' default, 5; rollout.max_completion_length bounds a completion either way."""
    # generation with vLLM (grpo's `vllm` engine, colocated in the training process)
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    """colocate: grpo's vllm engine in the training process; server: grpo's server engine
    (rollout.engine: server) against a generation server, `grpo serve`."""
    vllm_enable_sleep_mode: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    vllm_importance_sampling_correction: bool = True
    """With use_vllm, as in TRL: algorithm.rollout_correction = vllm_importance_sampling_mode."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    """Only None (grpo's correction has an upper bound only)."""
    vllm_server_base_url: str | None = None
    """With vllm_mode='server': the server's URL (rollout.server.url); None:
    http://vllm_server_host:vllm_server_port."""
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the server (rollout.server.timeout)."""
    vllm_group_port: int = 51216
    """The weight-transfer group's port (rollout.server.group_port)."""
    """Taken over the tokens of one forward pass, as TRL does (algorithm.entropy_mask_scope=batch)."""
    scale_rewards: str | bool = "group"
    sync_ref_model: bool = False
    ref_model_sync_steps: int = 512
    ref_model_mixup_alpha: float = 0.6
    # optimisation
    warmup_steps: float = 0
    """An int counts optimizer steps; a float below 1 is a fraction of them (as in transformers)."""
    shuffle_dataset: bool = True
    """Draw the prompts in a shuffled order, reshuffled every epoch (data_seed); False: in the
    dataset's order (data.shuffle)."""
    disable_dropout: bool = False
    """Only False: the update runs the model in training mode, with whatever dropout it was built with."""
    optim: str = "adamw_torch_fused"
    """AdamW only: adamw_torch_fused or adamw_torch (grpo picks the fused kernel where it exists)."""
    max_steps: int = -1
    """Optimizer steps; -1: from num_train_epochs and the dataset's size."""
    num_train_epochs: float = 3.0
    data_seed: int | None = None
    """Seed of the prompt order; None: `seed`."""
    bf16: bool | None = None
    """None: on (TRL's default), unless fp16 is asked for."""
    gradient_checkpointing: bool = True
    activation_checkpointing: bool | None = None
    """transformers 5's name for gradient_checkpointing; wins when set."""
    use_cpu: bool = False
    # logging, saving, evaluation
    logging_steps: float = 10
    """The console line's interval (metrics.jsonl and log_history get every step)."""
    report_to: str | list[str] = "none"
    log_completions: bool = False
    """Sample completions (one per group, four groups) to the console, samples.jsonl and the
    wandb/trackio/TensorBoard completions table every logging_steps (grpo's logging.sample_every)."""
    save_strategy: str = "steps"
    """no, steps or epoch (final/ is always written at the end)."""
    save_steps: float = 500
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    """no, steps or epoch: held-out evaluation of eval_dataset during training."""
    eval_steps: float | None = None
    """None: logging_steps."""
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
                set_dotted(data, key, value)
        for key, derive in DERIVED.items():
            value = derive(self)
            if value is not _UNSET:
                set_dotted(data, key, value)
        for name, value in _json_dict(self.generation_kwargs, "generation_kwargs").items():
            key = _generation_key(name, value)
            if key is not None:
                set_dotted(data, key, value)
        for key, value in (extra or {}).items():
            set_dotted(data, key, value)
        overrides = self.grpo_overrides
        if not isinstance(overrides, (list, tuple)) or not all(
            isinstance(o, str) for o in overrides
        ):
            raise ConfigError(
                f"grpo_overrides: a list of 'section.key=value' strings, got {str(overrides)[:80]!r}; "
                "e.g. grpo_overrides=['rollout.max_staleness=2']"
            )
        try:
            return from_dict(data, overrides)
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
        if self.vllm_mode not in ("colocate", "server"):
            raise ConfigError(
                f"GRPOConfig.vllm_mode={self.vllm_mode!r}: colocate (grpo's vllm engine in the training process) "
                "or server (a generation server started with `grpo serve`)"
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


def _correction(a: GRPOConfig):
    """TRL corrects for vLLM's sampling only when it generates with vLLM; otherwise grpo's own
    default stands (`auto`: none for a synchronous run, as TRL)."""
    if not a.use_vllm:
        return _UNSET
    return a.vllm_importance_sampling_mode if a.vllm_importance_sampling_correction else "none"


def _served(a: GRPOConfig) -> bool:
    """TRL's server mode: generation by a server (grpo's `server` engine)."""
    return a.use_vllm and a.vllm_mode == "server"


def _server_url(a: GRPOConfig):
    """TRL's server address: vllm_server_base_url, else host and port (only in server mode)."""
    if not _served(a):
        return _UNSET
    return a.vllm_server_base_url or f"http://{a.vllm_server_host}:{a.vllm_server_port}"


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
    **{name: (key, None) for name, key in SAME_MEANING.items()},
    "output_dir": ("output_dir", lambda a, n: a.output_dir or "trainer_output"),
    "min_p": ("rollout.min_p", lambda a, n: 0.0 if a.min_p is None else a.min_p),
    "chat_template_kwargs": (
        "data.chat_template_kwargs",
        lambda a, n: _json_dict(a.chat_template_kwargs, "chat_template_kwargs"),
    ),
    "loss_type": (
        "algorithm.loss_type",
        lambda a, n: LOSS_TYPE_AGGREGATION.get(a.loss_type, a.loss_type),
    ),
    "use_bias_correction_kl": ("algorithm.kl_bias_correction", None),
    "max_tool_calling_iterations": (
        "rollout.max_tool_calls",
        lambda a, n: (
            _UNSET if a.max_tool_calling_iterations is None else a.max_tool_calling_iterations
        ),
    ),
    "use_vllm": ("rollout.engine", lambda a, n: "vllm" if a.use_vllm else "hf"),
    # vllm_mode='server': grpo's server engine against `grpo serve` (after use_vllm: it wins)
    "vllm_mode": ("rollout.engine", lambda a, n: "server" if _served(a) else _UNSET),
    "vllm_server_base_url": ("rollout.server.url", lambda a, n: _server_url(a)),
    "vllm_server_host": ("rollout.server.url", lambda a, n: _server_url(a)),
    "vllm_server_port": ("rollout.server.url", lambda a, n: _server_url(a)),
    "vllm_server_timeout": (
        "rollout.server.timeout",
        lambda a, n: a.vllm_server_timeout if _served(a) else _UNSET,
    ),
    "vllm_group_port": (
        "rollout.server.group_port",
        lambda a, n: a.vllm_group_port if _served(a) else _UNSET,
    ),
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
    "sync_ref_model": ("algorithm.ref_sync_steps", _ref_sync),
    "ref_model_sync_steps": ("algorithm.ref_sync_steps", _ref_sync),
    "ref_model_mixup_alpha": (
        "algorithm.ref_sync_alpha",
        lambda a, n: a.ref_model_mixup_alpha if a.sync_ref_model else _UNSET,
    ),
    "warmup_steps": ("training.warmup_steps", _warmup),
    "max_steps": ("training.max_steps", lambda a, n: a.steps(n)),
    "num_train_epochs": ("training.max_steps", lambda a, n: a.steps(n)),
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
}
"""Every GRPOConfig field, and the grpo key it sets, but CHECKED_ONLY's."""

CHECKED_ONLY = (
    "generation_kwargs",
    "generation_batch_size",
    "steps_per_generation",
    "disable_dropout",
    "optim",
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


def _refusal(name: str) -> str:
    hint = _HINTS.get(
        name, "remove it (grpo's own settings go in grpo_overrides=['section.key=value'])"
    )
    return f"GRPOConfig: grpo does not implement TRL's `{name}`; {hint}"


def _with_fields(message: str) -> str:
    """A grpo config error, with the GRPOConfig fields that set the key it names."""
    names = sorted(
        {name for name, (key, _) in MAPPING.items() if f"{key}:" in message or f"{key}=" in message}
    )
    return f"{message} (GRPOConfig: {', '.join(names)})" if names else message


def warn_length_weighted_sequences(args: GRPOConfig) -> None:
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
