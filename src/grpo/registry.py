"""Named, pluggable parts: one registry per kind, an implementation imported only when chosen.

Every choice a config makes between implementations (an advantage estimator,
a multi-objective aggregation, a policy loss, a loss aggregation, a rollout
engine, a task) is a name looked up in one of the registries below. The config
check asks a registry for its names, so a wrong name fails at start-up with the
list of known ones, before torch is imported; the implementation behind a name
is imported on first use, so an engine that needs vLLM costs nothing until it
is picked.

Estimators, aggregations and losses are registered where they are defined, by a
decorator on the definition; the tables here say only which module defines each
built-in name (importing the module registers it):

    # grpo/algorithm/advantages.py
    @ADVANTAGE_ESTIMATORS.register("rloo")
    def rloo_advantages(inputs: AdvantageInputs) -> torch.Tensor: ...

The other kinds name `module:attribute`. User code registers its own the same way
(a name registered from user code replaces a built-in one of that name):

    from grpo.algorithm import AdvantageInputs
    from grpo.registry import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(inputs: AdvantageInputs):  # the whole batch's rewards, [N]
        return inputs.rewards - inputs.rewards.nanmean()

Keyword arguments of `register` become attributes of the registered object, which
say what it needs: `needs_values=True` (an estimator computed from the critic's
values, `gae`: the run then trains a critic), `folds_correction=True` (a policy loss
that takes the rollout correction's weights itself, `vespo`).

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
    """Names -> implementations for the config key `key`.

    `entries` say where each built-in name is defined: `package.module` (importing it
    registers the name, with `register`) or `package.module:attribute`. Nothing is
    imported until a name is asked for with `get`."""

    def __init__(self, key: str, entries: dict[str, str]):
        self.key = key
        self._targets: dict[str, str | Any] = dict(entries)  # a location until first use

    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def __iter__(self):
        return iter(self.names())

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
            module, _, attribute = target.partition(":")
            imported = importlib.import_module(module)  # a module of definitions registers them
            if attribute:
                self._targets[name] = getattr(imported, attribute)
            target = self._targets[name]
            if isinstance(target, str):
                raise RuntimeError(f"{self.key}: {module} does not register {name!r}")
        return target

    def register(self, name: str, **attributes: Any) -> Callable[[Any], Any]:
        """Decorator: add (or replace) `name` with the decorated object, which gets `attributes`
        (e.g. `needs_values=True`) as attributes of its own."""

        def add(obj: Any) -> Any:
            location = self._targets.get(name)
            if isinstance(location, str) and location.partition(":")[0] != getattr(
                obj, "__module__", None
            ):
                # the built-in's module first, so that importing it later cannot undo this
                self.get(name)
            for attribute, value in attributes.items():
                setattr(obj, attribute, value)
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
        "grpo": "grpo.algorithm.advantages",
        "dr_grpo": "grpo.algorithm.advantages",
        "rloo": "grpo.algorithm.advantages",
        "reinforce_pp": "grpo.algorithm.advantages",
        "gae": "grpo.algorithm.values",
    },
)
"""fn(inputs: AdvantageInputs) -> advantages [N] (or [N, T]: per token); see grpo.algorithm.advantages.
`needs_values=True`: computed from the critic's values (inputs.values), so the run trains a critic."""

MULTI_OBJECTIVE_AGGREGATIONS = Registry(
    "algorithm.multi_objective_aggregation",
    {
        "sum_then_normalize": "grpo.algorithm.advantages",
        "normalize_then_sum": "grpo.algorithm.advantages",
    },
)
"""fn(inputs: AdvantageInputs, estimator) -> advantages: how several reward functions reach the
advantages (the estimator on their weighted sum, or GDPO's own); see grpo.algorithm.advantages."""

POLICY_LOSSES = Registry(
    "algorithm.policy_loss",
    {
        "clipped": "grpo.algorithm.losses",
        "cispo": "grpo.algorithm.losses",
        "sapo": "grpo.algorithm.losses",
        "vespo": "grpo.algorithm.losses",
    },
)
"""fn(logp, old_logp, advantages [N] or [N, T], mask, params: PolicyLossParams) -> (per-token loss, stats);
see grpo.algorithm.losses. Attributes: `folds_correction=True` (vespo) also takes
`correction_weights=` (the rollout correction's weights, or None) and applies them itself;
`caveat(params) -> str | None`, a setting's caveat logged once; `sequence_metrics` {metric: stat},
stats summed over sequences and logged as their mean."""

LOSS_AGGREGATIONS = Registry(
    "algorithm.loss_type",
    {
        "grpo": "grpo.algorithm.losses",
        "bnpo": "grpo.algorithm.losses",
        "dr_grpo": "grpo.algorithm.losses",
        "dapo": "grpo.algorithm.losses",
        "luspo": "grpo.algorithm.losses",
    },
)
"""fn(per_token_loss, mask, norm: LossNormalisers) -> scalar; see grpo.algorithm.losses (a
`caveat(params)` attribute as for policy losses)."""

ROLLOUT_ENGINES = Registry(
    "rollout.engine",
    {
        "hf": "grpo.rollout.hf:TransformersEngine",
        "vllm": "grpo.rollout.vllm:VLLMEngine",
        "server": "grpo.rollout.server:ServerEngine",
    },
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
            "rollout_wait",
            "stale_ratio_drift",
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
