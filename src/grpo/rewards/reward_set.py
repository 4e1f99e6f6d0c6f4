"""Reward functions and how they are called.

A reward function follows TRL's convention:
    fn(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]
with one entry per completion; None means "does not apply" (a missing
reward, not a zero); an `async def` function is awaited.

`RewardSet.score` calls the batch's functions at the same time, each call
bounded by `rewards.timeout`, a user's functions in worker processes
(grpo.rewards.execution says where each runs and why). A function that
raises, returns anything but one real number or None per completion, hangs,
runs out of its worker's memory, exits or crashes never stops a run:
its rewards for the completions of that call are missing (NaN), the failure
is counted (`rewards/<name>/errors`, `rewards/<name>/timeouts` per step;
`failures` over the run), and the first of each kind is logged with its
traceback.

As in TRL, a function that takes **kwargs (or names them) also gets `log_metric(name,
value)` and `log_extra(column, values)` (grpo.rewards.worker.RewardLogs says what each
accepts): `take_logged_metrics()` hands the trainer the metrics logged since it last asked
(the mean of each name's values: a step's metric), and `last_extra` holds the extra columns
of the last batch scored.
When every function gives no reward for a completion, a warning shows that completion's
arguments, as TRL's does.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from grpo.algorithm import overlong_penalty
from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RewardsConfig
from grpo.registry import load_callable
from grpo.rewards.arithmetic import arithmetic_correct, arithmetic_format
from grpo.rewards.execution import Call, RewardExecutor
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
for _fn in BUILTIN.values():
    _fn.runs_in_process = True  # ours, quick and pure: a thread of the trainer, no worker process


def _math_answer(cfg: RewardsConfig) -> RewardFn:
    from grpo.rewards.math_answer import MathAnswer

    return MathAnswer(cfg.math_forms, cfg.math_timeout)


def _code_tests(cfg: RewardsConfig) -> RewardFn:
    from grpo.rewards.code import CodeTests

    reward = CodeTests(cfg.sandbox, cfg.code_reward)
    reward.runner.check()  # a sandbox that cannot run fails now, not after the model has loaded
    return reward


def _humaneval_tests(cfg: RewardsConfig) -> RewardFn:
    from grpo.rewards.code import HumanEvalTests

    reward = HumanEvalTests(cfg.sandbox, cfg.code_reward)
    reward.runner.check()
    return reward


CONFIGURED: dict[str, Callable[[RewardsConfig], RewardFn]] = {
    "math_answer": _math_answer,
    "code_tests": _code_tests,
    "humaneval_tests": _humaneval_tests,
}
"""Built-in rewards made from the rewards section's settings (math_forms, math_timeout)."""

CALL_ARGUMENTS = {
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_metric",
    "log_extra",
}


def overlong_reward(max_length: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong penalty as a reward function of the completion length."""

    def overlong(completion_ids, **kwargs) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids], device="cpu")
        return overlong_penalty(lengths, max_length, buffer).tolist()

    overlong.runs_in_process = True
    return overlong


def resolve(spec: str, cfg: RewardsConfig | None = None) -> tuple[str, RewardFn]:
    """A built-in name, `reward_model:PATH`, `package.module:function` or `path/to/file.py:function`."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if spec in CONFIGURED:
        return spec, CONFIGURED[spec](cfg or RewardsConfig())
    if spec.startswith("reward_model:"):
        from grpo.rewards.reward_model import reward_model

        return reward_model(spec, cfg or RewardsConfig())
    if ":" not in spec:
        raise ConfigError(
            f"rewards.funcs: unknown reward {spec!r}; use a built-in ({', '.join([*BUILTIN, *CONFIGURED])}) "
            "or 'module.path:function' or 'path/to/file.py:function'"
        )
    return spec.rsplit(":", 1)[1], load_callable(spec, "rewards.funcs")


def is_named_reward(spec: str) -> bool:
    """Whether `spec` is the name of a built-in reward (BUILTIN, CONFIGURED)."""
    return spec in BUILTIN or spec in CONFIGURED


def reward_function(given, cfg: RewardsConfig, tokenizer=None) -> tuple[str, RewardFn]:
    """A reward function passed from Python (GRPOTrainer's reward_funcs), named: a string or path
    is a built-in reward's name or else, as TRL reads it, a reward model's id or path
    (`reward_model:` optional); a sequence-classification model object is a reward model; any
    other callable is the function itself, under its `__name__`. `tokenizer`: a reward model's
    own (TRL's reward_processing_classes); the others take none."""
    from grpo.rewards.reward_model import is_reward_model, reward_model

    if isinstance(given, (str, Path)):
        spec = str(given)
        if is_named_reward(spec):
            return resolve(spec, cfg)
        return reward_model(spec, cfg, tokenizer)
    if is_reward_model(given):
        return reward_model(given, cfg, tokenizer)
    if not callable(given):
        raise TypeError(f"reward_funcs: {given!r} is neither a callable nor a model id/path")
    return getattr(given, "__name__", type(given).__name__), given


MAX_LOGGED_NAMES = 64
"""Metric names the reward functions may log (log_metric) in one step, all together."""
MAX_EXTRA_NAMES = 16
"""log_extra columns kept of one batch, all functions together."""

UNSCORED_WARNING = "All reward functions returned None for the following kwargs:"
"""TRL's words, which its users' tests look for."""


def _warn_unscored(unscored: torch.Tensor, inputs: dict) -> None:
    """TRL's warning when every function returned None for a completion: the first such
    completion's arguments (each cut to 200 characters)."""
    i = int(unscored.nonzero()[0, 0])
    shown = {
        key: _cut(values[i])
        for key, values in inputs.items()
        if isinstance(values, list) and key != "completion_ids"
    }
    log.warning(
        "%s\n%s\nPlease ensure that at least one reward function returns a valid reward "
        "(%d of %d completions of this batch have none).",
        UNSCORED_WARNING,
        shown,
        int(unscored.sum()),
        len(unscored),
    )


def _cut(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def check_signature(name: str, fn: RewardFn, columns: set[str] | None) -> None:
    """Fail at start-up when the function needs an argument that no row provides (`columns`
    None: not known before the first batch, a rollout_func returns some)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise ConfigError(
            f"reward function {name!r} must accept **kwargs (it receives every dataset column as a keyword)"
        )
    if columns is None:
        return
    available = CALL_ARGUMENTS | columns
    for p in params:
        if (
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and p.name not in available
        ):
            raise ConfigError(
                f"reward function {name!r} needs argument {p.name!r}, but the dataset has no such column "
                f"(columns: {sorted(columns)}); add the column or give the argument a default"
            )


@dataclass
class RewardSet:
    """The configured reward functions with their weights, and how they are called
    (`timeout`, `workers`, `isolation`, `worker_memory_mb`: the rewards section's keys)."""

    names: list[str]
    funcs: list[RewardFn]
    weights: torch.Tensor
    failures: dict[str, int] = field(default_factory=dict)
    """Failed calls (errors and timeouts) of each function over the run."""
    timeout: float = 60.0
    workers: int = 0
    isolation: str = "process"
    worker_memory_mb: int = 4096
    _executor: RewardExecutor | None = field(default=None, init=False, repr=False, compare=False)
    _since_step: defaultdict = field(
        default_factory=lambda: defaultdict(Counter), init=False, repr=False, compare=False
    )
    _seen: Counter = field(default_factory=Counter, init=False, repr=False, compare=False)
    _trainer_state: object = field(default=None, init=False, repr=False, compare=False)
    _logged: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _seed_given: int = field(default=0, init=False, repr=False, compare=False)
    _seed_uses: int = field(default=-1, init=False, repr=False, compare=False)
    last_extra: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The log_extra columns of the last batch scored: one value per completion (None where no
    function logged one)."""

    @classmethod
    def from_config(
        cls,
        cfg: "RewardsConfig",
        max_completion_length: int,
        columns: set[str] | None,
        funcs: dict[str, RewardFn] | None = None,
        failures: dict[str, int] | None = None,
        environment_rewards: dict[str, RewardFn] | None = None,
    ) -> "RewardSet":
        """The configured reward functions (or `funcs`, given directly from Python),
        with their weights, plus DAPO's overlong penalty when configured, plus
        `environment_rewards` (grpo.rollout.environments: those of environments that score
        themselves, weight 1, as TRL adds them); `failures` continues the failure counts of a
        restored run."""
        if funcs is None:
            resolved = [resolve(spec, cfg) for spec in cfg.funcs]
        else:
            resolved = list(funcs.items())
        weights = cfg.weights if cfg.weights is not None else [1.0] * len(resolved)
        if len(weights) != len(resolved):
            raise ConfigError(
                f"rewards.weights: {len(weights)} weights for {len(resolved)} reward functions; give one weight each"
            )
        rewards = cls(
            [],
            [],
            torch.zeros(0, device="cpu"),
            timeout=cfg.timeout,
            workers=cfg.workers,
            isolation=cfg.isolation,
            worker_memory_mb=cfg.worker_memory_mb,
        )
        for (name, fn), weight in zip(resolved, weights):
            check_signature(name, fn, columns)
            rewards.add(name, fn, weight)
        if cfg.overlong_buffer is not None:
            rewards.add(
                "overlong",
                overlong_reward(max_completion_length, cfg.overlong_buffer),
                cfg.overlong_weight,
            )
        for name, fn in (environment_rewards or {}).items():
            if name in rewards.names:
                raise ConfigError(
                    f"rewards.funcs: {name!r} is both a reward function and an environment class whose get_reward "
                    "scores its rollouts; their metrics would mix, so rename one"
                )
            rewards.add(name, fn, 1.0)
        if not rewards.names:
            raise ConfigError(
                "rewards.funcs: empty, and no environment scores its rollouts (get_reward); name at least one "
                "reward function (e.g. [arithmetic_correct])"
            )
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
        self.weights = torch.cat([self.weights, torch.tensor([weight], device="cpu")])
        self.failures[name] = 0
        if self._executor is not None:  # its workers loaded the functions before this one
            self._executor.close()
            self._executor = None

    def start(self) -> None:
        """Starts the worker processes now rather than at the first batch, so that a function they
        cannot load fails at start-up (ConfigError)."""
        self.executor.start()

    @property
    def executor(self) -> RewardExecutor:
        if self._executor is None:
            self._executor = RewardExecutor(
                self.names,
                self.funcs,
                self.timeout,
                self.workers,
                self.isolation,
                self.worker_memory_mb,
            )
        return self._executor

    def score(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        rows: list[dict],
        trainer_state: object = None,
        environments: list | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """[N, K] rewards, NaN where missing. `rows` are the dataset rows, one per completion.
        `trainer_state` (TRL's keyword: global_step, max_steps, epoch) goes to every function; left
        out (an evaluation), the last one given; none is passed before any was. `environments`
        (one per completion, grpo.rollout.environments) goes to the functions that run in the
        trainer's process (RewardExecutor). `seed`: what the calls draw from (RewardExecutor's
        Seeds; a training batch's, grpo.training.state.reward_seed); left out (an evaluation), or
        given again, the last one given counted on by the batches scored since (0 before any)."""
        self._trainer_state = trainer_state if trainer_state is not None else self._trainer_state
        batch_seed = self._batch_seed(seed)
        columns = {key: [r.get(key) for r in rows] for key in rows[0] if key != "prompt"}
        inputs = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
        }
        if self._trainer_state is not None:
            inputs["trainer_state"] = self._trainer_state
        if environments is not None:
            inputs["environments"] = environments
        n = len(completions)
        out = torch.full((n, len(self.funcs)), float("nan"), device="cpu")
        extra: dict[str, list] = {}
        failed = torch.zeros(n, dtype=torch.bool, device="cpu")
        for k, calls in enumerate(self.executor(inputs, n, batch_seed)):
            for call in calls:
                if call.status == "ok":
                    out[call.start : call.stop, k] = torch.tensor(
                        call.values, dtype=torch.float32, device="cpu"
                    )
                    self._keep_logs(call, extra, n)
                else:
                    self._failed(self.names[k], call)
                    failed[call.start : call.stop] = True
        self.last_extra = extra
        # every function said None (a failure is logged as such already)
        unscored = torch.isnan(out).all(dim=1) & ~failed if len(self.funcs) else failed
        if unscored.any():
            self._seen["all", "none"] += 1
            seen = self._seen["all", "none"]
            if seen & (seen - 1) == 0:  # 1, 2, 4, 8, ...: a warning that fades
                _warn_unscored(unscored, inputs)
        return out

    def _batch_seed(self, seed: int | None) -> int:
        """This batch's seed: a new `seed` as given; the batches after it (an evaluation's, without
        one, or given the same again) get it counted on, so no two batches draw alike."""
        if seed is not None and seed != self._seed_given:
            self._seed_given, self._seed_uses = seed, 0
        else:
            self._seed_uses += 1
        if self._seed_uses == 0:
            return self._seed_given
        key = f"{self._seed_given}+{self._seed_uses}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")

    def _keep_logs(self, call: Call, extra: dict[str, list], n: int) -> None:
        """A call's log_metric values (at most MAX_LOGGED_NAMES names a step) and log_extra columns
        (placed at its completions: a worker's chunk is a slice of the batch)."""
        logs = call.logs or {}
        for name, values in logs.get("metrics", {}).items():
            if name not in self._logged and len(self._logged) >= MAX_LOGGED_NAMES:
                if name not in self._seen_names_over:
                    self._seen_names_over.add(name)
                    log.warning(
                        "log_metric(%r): more than %d metric names logged by reward functions in a step; "
                        "the others are dropped",
                        name,
                        MAX_LOGGED_NAMES,
                    )
                continue
            total, count = values  # RewardLogs keeps each name's sum and count
            kept = self._logged.setdefault(name, [0.0, 0])
            kept[0] += total
            kept[1] += count
        for column, values in logs.get("extra", {}).items():
            if column not in extra and len(extra) >= MAX_EXTRA_NAMES:
                continue
            extra.setdefault(column, [None] * n)[call.start : call.start + len(values)] = values

    def take_logged_metrics(self) -> dict[str, float]:
        """The mean of each metric the reward functions logged (log_metric) since the last call."""
        metrics = {name: total / count for name, (total, count) in self._logged.items() if count}
        self._logged = {}
        return metrics

    _seen_names_over: set = field(default_factory=set, init=False, repr=False, compare=False)

    def _failed(self, name: str, call: Call) -> None:
        """Counted; the first failure of each kind logged whole, later ones now and then in a line."""
        kind = "timeouts" if call.status == "timeout" else "errors"
        self.failures[name] += 1
        self._since_step[name][kind] += 1
        self._seen[name, call.status] += 1
        seen = self._seen[name, call.status]
        what = {"error": "failed", "crashed": "crashed its worker", "timeout": "timed out"}[
            call.status
        ]
        if seen == 1:
            log.warning(
                "reward function %r %s on completions %d..%d; their rewards are missing. Only this first time is "
                "logged in full; later ones are counted (rewards/%s/%s):\n%s",
                name,
                what,
                call.start,
                call.stop - 1,
                name,
                kind,
                call.message.rstrip(),
            )
        elif seen & (seen - 1) == 0:  # 2, 4, 8, ...: a reminder that fades
            log.warning("reward function %r has %s %d times so far", name, what, seen)

    def step_failures(self) -> dict[str, dict[str, int]]:
        """Failed calls of each function since the last time asked ({"errors": n, "timeouts": n}):
        a step's, however many batches it scored."""
        counts = {
            name: {
                "errors": self._since_step[name]["errors"],
                "timeouts": self._since_step[name]["timeouts"],
            }
            for name in self.names
        }
        self._since_step.clear()
        return counts

    def close(self) -> None:
        """Ends the worker processes, and the workers of in-process rewards that have them (math_answer's);
        scoring again starts them anew."""
        if self._executor is not None:
            self._executor.close()
            self._executor = None
        for fn in self.funcs:
            if getattr(fn, "runs_in_process", False) and callable(getattr(fn, "close", None)):
                fn.close()
