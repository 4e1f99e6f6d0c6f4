"""A step's metrics (TRL's names where the meaning is the same) and the timer of its phases."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from grpo import algorithm
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
        m[f"rewards/{name}/failures"] = failures[name]
        for kind, count in (step_failures or {}).get(name, {}).items():
            m[f"rewards/{name}/{kind}"] = count
    for status, count in (sandbox or {}).items():
        m[f"sandbox/{status}"] = count
    if dynamic_sampling:
        m["sampling/rounds"] = batch.sampling_rounds
        m["sampling/zero_std_groups_kept"] = batch.zero_std_groups_kept
    return m
