"""Reward functions and how they are called.

A reward function follows TRL's convention:
    fn(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]
with one entry per completion; None means "does not apply" (a missing
reward, not a zero). A function that raises or returns the wrong shape never
kills a run: its rewards for that batch are missing and the failure is counted.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from grpo.algorithm import overlong_penalty
from grpo.config import ConfigError, RewardsConfig
from grpo.rewards.arithmetic import arithmetic_correct, arithmetic_format
from grpo.rewards.format import think_format, think_format_lenient, think_tag_count

log = logging.getLogger(__name__)

RewardFn = Callable[..., list]

BUILTIN: dict[str, RewardFn] = {
    "arithmetic_correct": arithmetic_correct,
    "arithmetic_format": arithmetic_format,
    "think_format": think_format,
    "think_format_lenient": think_format_lenient,
    "think_tag_count": think_tag_count,
}


def _math_answer(cfg: RewardsConfig) -> RewardFn:
    from grpo.rewards.math_answer import MathAnswer

    return MathAnswer(cfg.math_forms, cfg.math_timeout)


CONFIGURED: dict[str, Callable[[RewardsConfig], RewardFn]] = {"math_answer": _math_answer}
"""Built-in rewards made from the rewards section's settings (math_forms, math_timeout)."""

CALL_ARGUMENTS = {"prompts", "completions", "completion_ids"}


def overlong_reward(max_length: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong penalty as a reward function of the completion length."""

    def overlong(completion_ids, **kwargs) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids])
        return overlong_penalty(lengths, max_length, buffer).tolist()

    return overlong


def resolve(spec: str, cfg: RewardsConfig | None = None) -> tuple[str, RewardFn]:
    """A built-in name, `package.module:function` or `path/to/file.py:function`."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if spec in CONFIGURED:
        return spec, CONFIGURED[spec](cfg or RewardsConfig())
    if ":" not in spec:
        raise ConfigError(
            f"rewards.funcs: unknown reward {spec!r}; use a built-in ({', '.join([*BUILTIN, *CONFIGURED])}) "
            "or 'module.path:function' or 'path/to/file.py:function'"
        )
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"rewards.funcs: {spec!r}: file {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(f"grpo_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import
        raise ConfigError(f"rewards.funcs: cannot import {target!r} for {spec!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rewards.funcs: {target!r} has no function {name!r}")
    return name, fn


def check_signature(name: str, fn: RewardFn, columns: set[str]) -> None:
    """Fail at start-up when the function needs an argument that no row provides."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ConfigError(
            f"reward function {name!r} must accept **kwargs (it receives every dataset column as a keyword)"
        )
    available = CALL_ARGUMENTS | columns
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in available:
            raise ConfigError(
                f"reward function {name!r} needs argument {p.name!r}, but the dataset has no such column "
                f"(columns: {sorted(columns)}); add the column or give the argument a default"
            )


@dataclass
class RewardSet:
    """The configured reward functions with their weights."""

    names: list[str]
    funcs: list[RewardFn]
    weights: torch.Tensor
    failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(
        cls,
        cfg: "RewardsConfig",
        max_completion_length: int,
        columns: set[str],
        funcs: dict[str, RewardFn] | None = None,
        failures: dict[str, int] | None = None,
    ) -> "RewardSet":
        """The configured reward functions (or `funcs`, given directly from Python),
        with their weights, plus DAPO's overlong penalty when configured; `failures`
        continues the failure counts of a restored run."""
        if funcs is None:
            resolved = [resolve(spec, cfg) for spec in cfg.funcs]
        else:
            resolved = list(funcs.items())
        weights = cfg.weights if cfg.weights is not None else [1.0] * len(resolved)
        if len(weights) != len(resolved):
            raise ConfigError(f"rewards.weights: {len(weights)} weights for {len(resolved)} reward functions; give one weight each")
        rewards = cls([], [], torch.zeros(0))
        for (name, fn), weight in zip(resolved, weights):
            check_signature(name, fn, columns)
            rewards.add(name, fn, weight)
        if cfg.overlong_buffer is not None:
            rewards.add("overlong", overlong_reward(max_completion_length, cfg.overlong_buffer), cfg.overlong_weight)
        if failures is not None:
            if set(failures) != set(rewards.names):
                raise ConfigError(
                    f"rewards.funcs: the run being restored had reward functions {sorted(failures)}, this config has "
                    f"{sorted(rewards.names)}; restore with the same rewards"
                )
            rewards.failures = dict(failures)
        return rewards

    def add(self, name: str, fn: RewardFn, weight: float) -> None:
        self.names.append(name)
        self.funcs.append(fn)
        self.weights = torch.cat([self.weights, torch.tensor([weight])])
        self.failures[name] = 0

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], rows: list[dict]) -> torch.Tensor:
        """[N, K] rewards, NaN where missing. `rows` are the dataset rows, one per completion."""
        columns: dict[str, list[Any]] = {}
        for key in rows[0]:
            if key != "prompt":
                columns[key] = [r.get(key) for r in rows]
        out = torch.full((len(completions), len(self.funcs)), float("nan"))
        for k, (name, fn) in enumerate(zip(self.names, self.funcs)):
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
                out[:, k] = torch.tensor(_as_rewards(values, len(completions)), dtype=torch.float32)
            except Exception as e:  # a failing reward never kills the run
                self.failures[name] += 1
                log.warning("reward function %r failed on this batch (%s: %s); its rewards are missing", name, type(e).__name__, e)
        return out


def _as_rewards(values: Any, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
        raise TypeError(f"expected a list of {n} floats or None, got {got}")
    rewards = []
    for v in values:
        if v is None:
            rewards.append(math.nan)
        else:
            try:
                rewards.append(float(v))
            except (TypeError, ValueError):
                raise TypeError(f"expected float or None, got {v!r}") from None
    return rewards
