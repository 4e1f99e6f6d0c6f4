"""The advantages phase: once per step, over the step's final batch.

The registered estimator (algorithm.advantage_estimator) through the registered
multi-objective aggregation (algorithm.multi_objective_aggregation), on every rank's
completions (whole groups each, in rank order: what one process would see), then this rank's
rows; an estimator that `needs_values` (gae) also gets the critic's values, the completion and
loss masks, per token (padded to the widest rank's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpo.algorithm import AdvantageInputs
from grpo.training.batching import GenerationBatch


@dataclass
class Advantages:
    """The estimator and the aggregation, resolved from the registries at build, with the
    settings they read (G, scale_rewards, the reward weights, gae's gamma, lambda and
    whitening) and the backend that gathers every rank's rows."""

    estimator: Callable
    aggregation: Callable
    num_generations: int
    scale_rewards: str
    reward_weights: object
    gamma: float
    lam: float
    whiten: bool
    backend: object

    def __call__(self, batch: GenerationBatch, values: torch.Tensor | None) -> torch.Tensor:
        """The step's advantages, computed once over its final batch: [N], or [N, T] per token."""
        inputs, mine = self.inputs(batch, values)
        everyone = self.aggregation(inputs, self.estimator)
        if everyone.dim() == 1:
            return everyone[mine]
        return everyone[mine, : batch.rollout.completion_ids.shape[1]]

    def inputs(
        self, batch: GenerationBatch, values: torch.Tensor | None
    ) -> tuple[AdvantageInputs, slice]:
        """The estimator's inputs, of every rank's completions (per-token tensors padded to the
        widest rank's), and the rows of them that are this rank's."""
        backend = self.backend
        rewards, mine = backend.gather_rows(batch.rewards)
        per_token = {}
        if values is not None:
            tensors = {
                "values": values,
                "completion_mask": batch.rollout.completion_mask,
                "loss_mask": batch.loss_mask,
            }
            widest = max(backend.all_gather_object(values.shape[1]))
            per_token = {
                name: backend.gather_rows(_padded(tensor, widest))[0]
                for name, tensor in tensors.items()
            }
        inputs = AdvantageInputs(
            rewards,
            self.num_generations,
            self.scale_rewards,
            rewards_per_func=backend.gather_rows(batch.rewards_per_func)[0],
            reward_weights=self.reward_weights,
            gamma=self.gamma,
            lam=self.lam,
            whiten=self.whiten,
            **per_token,
        )
        return inputs, mine


def _padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T] right-padded with zeros to [N, width] (a narrower rank's tokens)."""
    missing = width - tensor.shape[1]
    return torch.nn.functional.pad(tensor, (0, missing)) if missing else tensor
