"""A step's metrics (TRL's names where the meaning is the same), the timer of its phases, and
the closing row of a run (`summary_row`)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo import algorithm
from grpo.sandbox import take_counts
from grpo.training.batching import GenerationBatch


class PhaseTimer:
    """Seconds spent in each named phase of a step (`with timer("generate"): ...`), summed
    when a phase runs more than once (dynamic sampling generates several rounds)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self, tokens: int) -> dict[str, float]:
        """time/step (every phase), time/<phase>, and tokens_per_second over the whole step."""
        total = sum(self.seconds.values())
        return {
            "time/step": total,
            **{f"time/{phase}": s for phase, s in self.seconds.items()},
            "tokens_per_second": tokens / max(total, 1e-9),
        }


def nanmean(x: torch.Tensor) -> float:
    present = ~torch.isnan(x)
    return float(x[present].mean()) if present.any() else math.nan


def _model_lengths(rollout) -> torch.Tensor:
    """[N] tokens each completion's model wrote: tool results (Rollout.tool_mask) are not
    counted in the completion length metrics, as in TRL."""
    if rollout.tool_mask is None:
        return rollout.lengths
    return rollout.lengths - (rollout.tool_mask * rollout.completion_mask).sum(-1)


@dataclass
class Outcome:
    """What a step's metrics read of its generation batch: per completion, the rewards, lengths
    and truncated flags; and how dynamic sampling filled it."""

    rewards: torch.Tensor  # [N]
    rewards_per_func: torch.Tensor  # [N, K]
    lengths: torch.Tensor  # [N]
    truncated: torch.Tensor  # [N] bool
    sampling_rounds: int = 1
    zero_std_groups_kept: int = 0

    @classmethod
    def of(cls, batch: GenerationBatch, backend=None) -> "Outcome":
        """The batch's outcome; with a backend, every rank's completions (whole groups each) in
        rank order, so that the metrics are the global batch's."""
        columns = (
            batch.rewards,
            batch.rewards_per_func,
            _model_lengths(batch.rollout),
            batch.rollout.truncated,
        )
        if backend is not None:
            columns = tuple(backend.gather_rows(c)[0] for c in columns)
        return cls(*columns, batch.sampling_rounds, batch.zero_std_groups_kept)


def sum_counts(parts: list[dict]) -> dict:
    """Count dictionaries (nested: name -> kind -> count) added key by key, e.g. every rank's."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            total[key] = (
                sum_counts([total.get(key, {}), value])
                if isinstance(value, dict)
                else total.get(key, 0) + value
            )
    return total


def batch_metrics(
    batch: Outcome,
    group_size: int,
    reward_names: list[str],
    failures: dict[str, int],
    dynamic_sampling: bool,
    step_failures: dict[str, dict[str, int]] | None = None,
    sandbox: dict[str, int] | None = None,
) -> dict[str, float]:
    """Rewards, their spread within groups, completion lengths, and dynamic sampling's rounds;
    the step's failed reward calls (`step_failures`: name -> errors, timeouts) beside the run's
    `failures`, and the step's sandbox outcomes (`sandbox`: status -> count)."""
    lengths = batch.lengths.float()
    truncated = batch.truncated
    group_std = algorithm.group_reward_std(batch.rewards, group_size)
    m = {
        "reward": nanmean(batch.rewards),
        "reward_std": float(group_std.mean()),
        "frac_reward_zero_std": float((group_std == 0).float().mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
        "completions/mean_terminated_length": float(lengths[~truncated].mean())
        if (~truncated).any()
        else 0.0,
    }
    for k, name in enumerate(reward_names):
        column = batch.rewards_per_func[:, k]
        m[f"rewards/{name}/mean"] = nanmean(column)
        m[f"rewards/{name}/std"] = float(algorithm.nan_std(column, dim=0))
        # the share of completions it gave no reward (None, or a failed call): what health reads
        m[f"rewards/{name}/missing"] = float(torch.isnan(column).float().mean())
        m[f"rewards/{name}/failures"] = failures[name]
        for kind, count in (step_failures or {}).get(name, {}).items():
            m[f"rewards/{name}/{kind}"] = count
    for status, count in (sandbox or {}).items():
        m[f"sandbox/{status}"] = count
    if dynamic_sampling:
        m["sampling/rounds"] = batch.sampling_rounds
        m["sampling/zero_std_groups_kept"] = batch.zero_std_groups_kept
    return m


@dataclass
class StepMetrics:
    """A step's metrics, from what it reads: the backend (every rank's counts), the reward set
    (names, failures, what the functions logged), the engine (its tools' counts, if it has tools),
    the prompt encoder (truncated prompts), the train state (step, tokens, learning rate), G and
    whether dynamic sampling runs; and the closing row's (`summary`) optimizer steps per step,
    completions per step and logging interval."""

    backend: Any
    rewards: Any
    engine: Any
    prompts: Any
    state: Any
    num_generations: int
    dynamic_sampling: bool
    num_iterations: int = 1
    samples_per_step: int = 1
    log_every: int = 1
    source: Any = None
    """The rollout source, whose own metrics (`take_metrics`: its engine's pushes, generating
    ahead's) the row takes last."""

    def summary(self, history: list[dict], runtime: float, steps: int) -> dict[str, Any]:
        """The run's closing row (`summary_row`) over this train() call's `steps` steps."""
        return summary_row(
            history, runtime, steps, self.num_iterations, self.samples_per_step, self.log_every
        )

    def start(self) -> None:
        """The step's sandbox and reward-failure counts are its own, not those of the set-up's
        checks or an evaluation between steps; so are what its reward functions log and its tool
        calls."""
        take_counts()
        self.rewards.step_failures()
        self.rewards.take_logged_metrics()
        take_tool_counts = getattr(self.engine, "take_counts", None)
        if take_tool_counts is not None:
            take_tool_counts()

    def __call__(
        self, batch: GenerationBatch, update_stats: dict, timer: PhaseTimer
    ) -> dict[str, float]:
        """The step's metrics over every rank (the update's come reduced already); the phases'
        times are this rank's. Counts the step's tokens into the run's (`tokens_seen`)."""
        ro, b, r, state = batch.rollout, self.backend, self.rewards, self.state
        tokens = int(b.sum(int(ro.completion_mask.sum() + ro.prompt_mask.sum())))
        state.tokens_seen += tokens
        logged = _mean_over_ranks(b.all_gather_object(r.take_logged_metrics()))
        tools = self._tool_metrics()
        # the counts of every rank: the run's reward failures, the step's, the sandbox's, truncated prompts
        failures, step_failures, sandbox, truncated = (
            sum_counts(parts)
            for parts in zip(
                *b.all_gather_object(
                    (
                        dict(r.failures),
                        r.step_failures(),
                        take_counts(),
                        {"prompts": self.prompts.take_truncated()},
                    )
                )
            )
        )
        metrics = {
            "step": state.step,
            **batch_metrics(
                Outcome.of(batch, b),
                self.num_generations,
                r.names,
                failures,
                self.dynamic_sampling,
                step_failures,
                sandbox,
            ),
            **update_stats,
            "prompts/truncated": truncated["prompts"],
            **tools,
            "learning_rate": state.scheduler.get_last_lr()[0],
            "num_tokens": state.tokens_seen,
            **timer.metrics(tokens),
            **(self.source.take_metrics() if self.source is not None else {}),
        }
        # what the reward functions logged (log_metric); a name of grpo's own metrics keeps grpo's
        return {**metrics, **{name: v for name, v in logged.items() if name not in metrics}}

    def _tool_metrics(self) -> dict[str, float]:
        """The tools' metrics since the last step (grpo.rollout.tools.tool_metrics), over every
        rank; none without tools."""
        take = getattr(self.engine, "take_counts", None)
        if take is None:
            return {}
        from grpo.rollout.tools import tool_metrics

        return tool_metrics(sum_counts(self.backend.all_gather_object(take())))


def _mean_over_ranks(parts: list[dict[str, float]]) -> dict[str, float]:
    """Each name's mean over the ranks that logged it."""
    names = dict.fromkeys(name for part in parts for name in part)
    return {
        name: sum(p[name] for p in parts if name in p) / sum(name in p for p in parts)
        for name in names
    }


def summary_row(
    history: list[dict],
    runtime: float,
    steps: int,
    num_iterations: int,
    samples_per_step: int,
    log_every: int,
) -> dict[str, Any]:
    """transformers' closing row: train_loss (the mean of the steps' losses), the speeds over this
    train() call's optimizer steps (`steps` grpo steps of num_iterations each), total_flos (not
    counted by grpo: always 0); and, as TRL's does, the mean of each metric over the steps since
    the last logging_steps boundary (none when the last step is on one)."""
    optimizer_steps, every = steps * num_iterations, log_every
    losses = [r["loss"] for r in history if math.isfinite(r.get("loss", math.nan))]
    row: dict[str, Any] = {}
    if every and history and history[-1]["step"] % every:
        since = [r for r in history if r["step"] > history[-1]["step"] // every * every]
        for key in since[0]:
            values = [
                r[key]
                for r in since
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ]
            if key != "step":
                row[key] = sum(values) / len(values) if values else None
    runtime = max(runtime, 1e-9)
    return {
        **row,
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(optimizer_steps * samples_per_step / runtime, 3),
        "train_steps_per_second": round(optimizer_steps / runtime, 3),
        "total_flos": 0.0,
        "train_loss": sum(losses) / len(losses) if losses else 0.0,
    }
