"""Named, pluggable parts: one registry per kind, an implementation imported only when chosen.

Every choice a config makes between implementations (an advantage estimator,
a policy loss, a loss aggregation, a rollout engine, a task) is a name looked
up in one of the registries below. The config check asks a registry for its
names, so a wrong name fails at start-up with the list of known ones, before
torch is imported; the implementation behind a name is imported on first use,
so an engine that needs vLLM costs nothing until it is picked.

Adding an implementation is one line here (a name and `module:attribute`), or,
from user code, a decorator:

    from grpo.registry import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(rewards, group_size, *, scale_rewards): ...

`load_callable` imports the user functions a config names by `module:function` or
`path/to/file.py:function` (reward functions, tools).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

from grpo.config.errors import ConfigError

_file_modules = itertools.count()


def load_callable(spec: str, key: str) -> Callable:
    """The function a config names as `package.module:function` or `path/to/file.py:function`
    (user code: reward functions, tools); a ConfigError naming `key` and the fix otherwise.
    A file is imported as a module of its own unique name, registered in sys.modules, so its
    functions pickle by reference for a worker process."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ConfigError(
            f"{key}: {spec!r}: expected 'module:function' (e.g. mytools:calculator) or "
            "'path/to/file.py:function'"
        )
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(
                    f"{key}: {spec!r}: file {path} does not exist (a relative path is looked for from the "
                    "working directory, then beside the config file); give the file's path"
                )
            module_name = f"grpo_user_{path.stem}_{next(_file_modules)}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import
        raise ConfigError(
            f"{key}: cannot import {target!r} for {spec!r}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r}: {target} has no function {name!r}")
    return fn


class Registry:
    """Names -> implementations for the config key `key`."""

    def __init__(self, key: str, entries: dict[str, str]):
        self.key = key
        self._targets: dict[str, str | Any] = dict(entries)  # "module:attribute" until first use

    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def check(self, name: Any) -> None:
        """A ConfigError naming the key and the known names when `name` is not one of them."""
        if name in self._targets:
            return
        names = self.names()
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{self.key}: {name!r} is not one of {', '.join(names)}{hint}")

    def get(self, name: str) -> Any:
        """The implementation registered as `name`, imported on first use."""
        self.check(name)
        target = self._targets[name]
        if isinstance(target, str):
            module, attribute = target.split(":")
            target = self._targets[name] = getattr(importlib.import_module(module), attribute)
        return target

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: add (or replace) `name` with the decorated object."""

        def add(obj: Any) -> Any:
            self._targets[name] = obj
            return obj

        return add

    def unregister(self, name: str) -> None:
        """Remove `name` (e.g. a test's own entry)."""
        self.check(name)
        del self._targets[name]


# The registries. Each entry's signature is documented where its kind is defined.

ADVANTAGE_ESTIMATORS = Registry(
    "algorithm.advantage_estimator",
    {
        "grpo": "grpo.algorithm.advantages:grpo_advantages",
        "dr_grpo": "grpo.algorithm.advantages:dr_grpo_advantages",
        "rloo": "grpo.algorithm.advantages:rloo_advantages",
        "reinforce_pp": "grpo.algorithm.advantages:reinforce_pp_advantages",
        # needs the critic's values: the trainer computes it with grpo.algorithm.values.gae_advantages
        "gae": "grpo.algorithm.values:gae_estimator",
    },
)
"""fn(rewards [N], group_size, *, scale_rewards) -> advantages [N]; see grpo.algorithm.advantages."""

POLICY_LOSSES = Registry(
    "algorithm.policy_loss",
    {
        "clipped": "grpo.algorithm.losses:clipped_policy_loss",
        "cispo": "grpo.algorithm.losses:cispo_policy_loss",
        "sapo": "grpo.algorithm.losses:sapo_policy_loss",
        "vespo": "grpo.algorithm.losses:vespo_policy_loss",
    },
)
"""fn(logp, old_logp, advantages [N] or [N, T], mask, params: PolicyLossParams) -> (per-token loss, stats);
see grpo.algorithm.losses. A loss with the attribute `folds_correction = True` (vespo) also takes
`correction_weights=` (the rollout correction's weights, or None) and applies them itself."""

LOSS_AGGREGATIONS = Registry(
    "algorithm.loss_type",
    {
        "grpo": "grpo.algorithm.losses:per_sequence_mean",
        "bnpo": "grpo.algorithm.losses:minibatch_token_mean",
        "dr_grpo": "grpo.algorithm.losses:fixed_length_mean",
        "dapo": "grpo.algorithm.losses:batch_token_mean",
        "luspo": "grpo.algorithm.losses:sequence_sum_mean",
    },
)
"""fn(per_token_loss, mask, norm: LossNormalisers) -> scalar; see grpo.algorithm.losses."""

ROLLOUT_ENGINES = Registry(
    "rollout.engine",
    {"hf": "grpo.rollout.hf:TransformersEngine", "vllm": "grpo.rollout.vllm:VLLMEngine"},
)
"""A grpo.rollout.base.RolloutEngine class, built as cls(model, tokenizer, cfg, decoding) (grpo.rollout.base.create_engine)."""

TASKS = Registry(
    "data.task",
    {
        "arithmetic": "grpo.tasks.arithmetic:arithmetic_task",
        "jsonl": "grpo.tasks.jsonl:jsonl_task",
        "gsm8k": "grpo.tasks.math_tasks:gsm8k_task",
        "math": "grpo.tasks.math_tasks:math_task",
        "code": "grpo.tasks.code:code_task",
        "humaneval": "grpo.tasks.humaneval:humaneval_task",
        "hf": "grpo.tasks.hf:hf_task",
    },
)
"""fn(cfg: Config) -> grpo.tasks.Task."""

# Plain choices that select a formula inside one implementation.
SCALE_REWARDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_LEVELS = ("token", "sequence")
LR_SCHEDULES = ("constant", "linear", "cosine")
DECODING = ("auto", "fused", "plain")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")

HEALTH_CHECKS = Registry(
    "health.fail_on",
    {
        name: f"grpo.health.checks:{name}"
        for name in (
            "no_learning_signal",
            "zero_loss",
            "all_truncated",
            "reward_failing",
            "constant_reward",
            "entropy_collapse",
            "entropy_blowup",
            "kl_runaway",
            "clip_ratio_high",
            "grad_norm_spike",
            "nonfinite_updates",
            "heldout_not_improving",
            "length_hacking",
            "reward_tradeoff",
            "lr_too_small",
            "lr_too_large",
        )
    },
)
"""fn(view: grpo.health.checks.View) -> grpo.health.checks.Finding | None, run on every step in
this order; see grpo.health.checks and docs/health.md."""
