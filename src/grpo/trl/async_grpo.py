"""TRL's experimental asynchronous trainer, `AsyncGRPOConfig` and `AsyncGRPOTrainer`, with TRL
1.16's field names and defaults, on grpo's generation ahead of training (grpo.training.ahead):

    from grpo import AsyncGRPOConfig, AsyncGRPOTrainer      # was: from trl.experimental.async_grpo

A TRL script that trains with TRL's trains here with only that import changed, against a
generation server started with `grpo serve` at `vllm_server_base_url`. The fields and where they go:

    vllm_server_base_url, vllm_server_timeout    rollout.server.url, .timeout (rollout.engine: server)
    request_timeout, weight_sync_timeout         rollout.server.request_timeout, .weight_sync_timeout
    max_staleness, weight_sync_steps             rollout.max_staleness, rollout.weight_sync_steps
    dtype                                        model.dtype ("auto" refused: grpo holds one named dtype)
    the sampling and TrainingArguments fields    as GRPOConfig maps them (grpo.trl.config)

with TRL 1.16's async defaults (learning_rate 1e-6, a constant schedule, logging every step,
max_completion_length 2048, max_staleness 4, a server at http://localhost:8000, ...). What only
sets how much TRL keeps in flight or how it batches (max_inflight_tasks, queue_maxsize,
heartbeat_stale_after_s, token_budget, fork_threshold_tokens, num_completions_to_print,
ignore_data_skip) is accepted and, when set, named in one warning: grpo generates one batch at a
time, at most max_staleness + 1 batches ahead, every wait bounded by the request timeout. What
would change what is trained is refused by name: model_init_kwargs, dtype "auto",
router_aux_loss_coef (grpo adds no router loss), a rollout_worker or weight_transfer of TRL's
internals, and every GRPOConfig field TRL's AsyncGRPOConfig does not have (TypeError, as TRL's).

What differs from TRL's trainer by design (docs/trl-compatibility.md): TRL drops samples that
grew staler than max_staleness while they waited, so which samples train depends on timing;
grpo samples the batch of step s from the weights after step max(0, s - 1 - max_staleness)
(a fixed schedule, reproducible and resumable to the bit). TRL clips the ratio against the
sampler's logprobs; grpo clips against the policy the update starts from and weights each token
by its truncated importance ratio against the sampler (algorithm.rollout_correction: auto).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from grpo.config.errors import ConfigError
from grpo.trl import config as trl_config
from grpo.trl.config import NO_EFFECT, GRPOConfig
from grpo.trl.trainer import GRPOTrainer

TRAINING_ARGUMENTS = frozenset(
    {
        "activation_checkpointing",
        "adam_beta1",
        "adam_beta2",
        "adam_epsilon",
        "bf16",
        "data_seed",
        "eval_on_start",
        "eval_steps",
        "eval_strategy",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "learning_rate",
        "logging_steps",
        "lr_scheduler_type",
        "max_grad_norm",
        "max_steps",
        "num_train_epochs",
        "optim",
        "output_dir",
        "per_device_eval_batch_size",
        "per_device_train_batch_size",
        "report_to",
        "run_name",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "seed",
        "use_cpu",
        "warmup_steps",
        "weight_decay",
    }
)
"""transformers' TrainingArguments that grpo's GRPOConfig implements (TRL's AsyncGRPOConfig has them too)."""
SAMPLING = frozenset(
    {
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "chat_template_kwargs",
        "max_tool_calling_iterations",
        "trust_remote_code",
        "epsilon",
        "epsilon_high",
        "log_completions",
        "vllm_server_base_url",
        "vllm_server_timeout",
    }
)
"""AsyncGRPOConfig's own fields that GRPOConfig has, with the same meaning."""
ASYNC_KEYS = {
    "request_timeout": "rollout.server.request_timeout",
    "weight_sync_timeout": "rollout.server.weight_sync_timeout",
    "max_staleness": "rollout.max_staleness",
    "weight_sync_steps": "rollout.weight_sync_steps",
    "dtype": "model.dtype",
}
"""AsyncGRPOConfig's own fields that set a grpo key GRPOConfig has no field for."""
THROUGHPUT = {
    "max_inflight_tasks": -1,
    "queue_maxsize": 1024,
    "heartbeat_stale_after_s": 300.0,
    "token_budget": None,
    "fork_threshold_tokens": 1024,
    "num_completions_to_print": None,
    "ignore_data_skip": True,
}
"""Fields (and TRL's defaults) that set only what TRL keeps in flight, how it batches or prints."""
CHECKED = ("model_init_kwargs", "router_aux_loss_coef")
"""Fields refused unless left at TRL's default (None; router_aux_loss_coef 0.0 too)."""
ACCEPTED = TRAINING_ARGUMENTS | SAMPLING | set(ASYNC_KEYS) | set(THROUGHPUT) | set(CHECKED)
GRPO_OWN = frozenset({"grpo_overrides"})
"""grpo's own field, as GRPOConfig has it: grpo keys set directly (['section.key=value']), the
way to every setting TRL's fields do not reach."""


@dataclass(init=True, repr=False, eq=False)
class _AsyncFields(GRPOConfig):
    """TRL 1.16's AsyncGRPOConfig defaults, over GRPOConfig's fields."""

    learning_rate: float = 1e-6
    lr_scheduler_type: str = "constant"
    logging_steps: float = 1
    max_completion_length: int = 2048
    vllm_server_base_url: str = "http://localhost:8000"
    model_init_kwargs: dict | str | None = None
    dtype: str = "float32"
    router_aux_loss_coef: float | None = None
    fork_threshold_tokens: int = 1024
    request_timeout: int = 600
    weight_sync_timeout: int = 1800
    token_budget: int | None = None
    max_inflight_tasks: int = -1
    max_staleness: int = 4
    queue_maxsize: int = 1024
    weight_sync_steps: int = 1
    heartbeat_stale_after_s: float = 300.0
    num_completions_to_print: int | None = None
    ignore_data_skip: bool = True


class AsyncGRPOConfig(_AsyncFields):
    """TRL's AsyncGRPOConfig (see the module's docstring): `AsyncGRPOConfig(output_dir, **fields)`."""

    def __init__(self, output_dir: str | None = None, **kwargs):
        refused = [n for n in kwargs if n not in ACCEPTED | GRPO_OWN and n not in NO_EFFECT]
        if refused:
            raise TypeError("; ".join(_refusal(name) for name in refused))
        ignored = {n: kwargs.pop(n) for n in list(kwargs) if n in NO_EFFECT}
        _AsyncFields.__init__(self, output_dir=output_dir, **kwargs)
        self.ignored = ignored
        """The fields given that change nothing here (NO_EFFECT, and THROUGHPUT's when set)."""
        # TRL's asynchronous trainer generates on a server; its correction is grpo's `auto`
        self.use_vllm, self.vllm_mode = True, "server"
        self.vllm_importance_sampling_correction = False
        changed = {n: getattr(self, n) for n, d in THROUGHPUT.items() if getattr(self, n) != d}
        named = sorted({*changed, *(n for n, v in ignored.items() if v not in (None, False))})
        if named:
            warnings.warn(
                f"AsyncGRPOConfig: accepted but without effect in grpo (it generates one batch at a time, "
                f"at most max_staleness + 1 ahead, and batches the update by its own settings): "
                f"{', '.join(named)}",
                stacklevel=2,
            )

    def to_config(self, num_rows: int | None = None, extra: dict[str, Any] | None = None):
        """grpo's Config (GRPOConfig.to_config) with the asynchronous keys; `extra` and
        grpo_overrides win, as there."""
        self._check_async()
        keys = {key: getattr(self, name) for name, key in ASYNC_KEYS.items()}
        keys["algorithm.rollout_correction"] = "auto"
        return super().to_config(num_rows, {**keys, **(extra or {})})

    def _check_async(self) -> None:
        if self.model_init_kwargs is not None:
            raise ConfigError(_refusal("model_init_kwargs"))
        if self.router_aux_loss_coef not in (None, 0.0):
            raise ConfigError(_refusal("router_aux_loss_coef"))
        if self.dtype == "auto":
            raise ConfigError(
                "AsyncGRPOConfig.dtype='auto': grpo holds the weights in one named dtype; set float32 (TRL's "
                "default), bfloat16 or float16"
            )


def _refusal(name: str) -> str:
    hints = {
        "model_init_kwargs": "load the model yourself and pass it, or set dtype (model.dtype)",
        "router_aux_loss_coef": "grpo adds no routers' load-balancing loss; leave it None",
    }
    if name in hints:
        return f"AsyncGRPOConfig: grpo does not implement TRL's `{name}`; {hints[name]}"
    if name in {f.name for f in dataclasses.fields(GRPOConfig)}:
        return (
            f"AsyncGRPOConfig: unexpected field `{name}` (GRPOConfig has it; TRL's AsyncGRPOConfig does "
            "not); use GRPOConfig, or set grpo's key in grpo_overrides=['section.key=value']"
        )
    return trl_config._refusal(name).replace("GRPOConfig:", "AsyncGRPOConfig:", 1)


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL's AsyncGRPOTrainer: `model` (a name or path, or a model object), `reward_funcs`,
    `args` (AsyncGRPOConfig), `train_dataset`, `processing_class`, `callbacks`, `optimizers`,
    `peft_config`, trained by grpo generating ahead on a `grpo serve` server. `tools` and
    `environment_factory` are refused by the run's build (not generated ahead yet), and TRL's
    `rollout_worker` and `weight_transfer` (its internals) here."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
    ):
        for name, value in (
            ("rollout_worker", rollout_worker),
            ("weight_transfer", weight_transfer),
        ):
            if value is not None:
                raise ConfigError(
                    f"AsyncGRPOTrainer({name}=...): TRL's internal {name} is not grpo's; grpo generates on "
                    "the `grpo serve` server at vllm_server_base_url and pushes the weights itself: leave it None"
                )
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = AsyncGRPOConfig(f"{str(name).split('/')[-1]}-AsyncGRPO")
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(
                f"AsyncGRPOTrainer(args=...) takes an AsyncGRPOConfig, got {type(args).__name__}"
            )
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )
