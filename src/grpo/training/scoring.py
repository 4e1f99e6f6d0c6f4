"""The rewards phase: a rollout's completions scored by the run's reward functions, and the
tokens the loss counts.

The completions are decoded once and given to the reward functions as TRL does (text, or for
a conversational row the assistant's turns with the tool results); each function's rewards
(NaN where it returned None or failed) are combined with the reward weights
(grpo.algorithm.combine_rewards). The loss mask is the completion's tokens but the ones the
model did not sample (tool results), those of truncated completions with
mask_truncated_completions, and, for a run with a critic, those of a completion that got no
reward at all (its advantage would be the critic's own error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpo import algorithm
from grpo.rewards.reward_set import RewardSet
from grpo.tasks.data import Row, is_conversational
from grpo.training.batching import GenerationBatch
from grpo.training.sampling import Generated


@dataclass
class Scoring:
    """The rewards phase: `rewards` (the run's reward functions and weights) on a generated
    batch's decoded completions, with `progress()` (what TRL gives reward functions as
    `trainer_state`) and `reward_seed()`, both from where the batch was drawn, and the loss mask (`mask_truncated`: algorithm.mask_truncated_completions;
    `with_critic`: a completion without any reward leaves the loss)."""

    rewards: RewardSet
    num_generations: int
    mask_truncated: bool
    with_critic: bool
    progress: Callable[..., object]
    """progress(drawn): what reward functions get as `trainer_state` for a batch drawn at `drawn`
    (grpo.training.state.trainer_state; None: the train state's position now)."""
    reward_seed: Callable[..., int]
    """reward_seed(drawn): the seed the batch's reward calls draw from
    (grpo.training.state.reward_seed)."""

    def __call__(self, generated: Generated, num_generations: int | None = None) -> GenerationBatch:
        """The rewards of `generated` (one group of G per row, G = `num_generations` or the
        run's), and the tokens the loss counts. With episodes, each completion's prompt is the
        row's with its environment's observation, and the reward functions get the environments."""
        G = num_generations or self.num_generations
        rollout, texts = generated.rollout, generated.texts
        group_rows, environments = _completion_rows(
            generated.rows, G, generated.episodes, generated.columns
        )
        prompts = [row["prompt"] for row in group_rows]
        # with tools, a conversational row's completion is its turns and tool results, as in TRL
        messages = rollout.messages or [None] * len(texts)
        completions = [
            (turns or [{"role": "assistant", "content": text}]) if is_conversational(row) else text
            for row, text, turns in zip(group_rows, texts, messages)
        ]
        rewards_per_func = self.rewards.score(
            prompts,
            completions,
            generated.ids,
            group_rows,
            self.progress(generated.drawn),
            environments,
            seed=self.reward_seed(generated.drawn),  # reproducible draws, whenever it is scored
        )
        rewards = algorithm.combine_rewards(rewards_per_func, self.rewards.weights)
        return GenerationBatch(
            group_rows,
            prompts,
            completions,
            texts,
            rollout,
            rewards_per_func,
            rewards,
            loss_mask(rollout, rewards, self.mask_truncated, self.with_critic),
            # the columns its reward functions logged (log_extra), for the completions table
            extra_columns=self.rewards.last_extra,
        )


def _completion_rows(rows: list[Row], G: int, episodes, columns) -> tuple[list[Row], list | None]:
    """Each completion's row (its prompt's, with its environment's observation and the columns a
    rollout_func returned for it), and each completion's environment (None without)."""
    group_rows = [row for row in rows for _ in range(G)]
    environments = None
    if episodes is not None:
        from grpo.rollout.environments import with_observation

        group_rows = [with_observation(r, e.observation) for r, e in zip(group_rows, episodes)]
        environments = [e.environment for e in episodes]
    if columns:
        group_rows = [
            {**row, **{key: values[i] for key, values in columns.items()}}
            for i, row in enumerate(group_rows)
        ]
    return group_rows, environments


def loss_mask(
    rollout, rewards: torch.Tensor, mask_truncated: bool, with_critic: bool
) -> torch.Tensor:
    """[N, T] the completion tokens the loss counts (see the module's docstring)."""
    mask = rollout.completion_mask.clone()
    if rollout.tool_mask is not None:  # tool results were not sampled: no loss on them
        mask = mask * (1 - rollout.tool_mask.to(mask.device))
    if mask_truncated:
        mask[rollout.truncated] = 0
    # with a critic: a completion without a reward (every function failed) leaves the loss
    if with_critic:
        mask[~torch.isfinite(rewards).to(mask.device)] = 0
    return mask
