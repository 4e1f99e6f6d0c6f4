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

from typing import TYPE_CHECKING

import torch

from grpo import algorithm
from grpo.tasks.data import Row, is_conversational
from grpo.training.batching import GenerationBatch
from grpo.training.state import reward_seed, trainer_state

if TYPE_CHECKING:
    from grpo.training.build import RunParts


def score(
    run: RunParts,
    rows: list[Row],
    rollout,
    num_generations: int | None = None,
    episodes=None,
    columns: dict[str, list] | None = None,
) -> GenerationBatch:
    """The rewards of a rollout of `rows` (one group of G per row, G = `num_generations` or
    rollout.num_generations), and the tokens the loss counts. `episodes` (grpo.training.sampling):
    each completion's environment; its prompt is the row's with the environment's observation,
    and the reward functions get the environments. `columns`: values per completion a
    rollout_func returned, given to the reward functions as dataset columns are."""
    G = num_generations or run.cfg.rollout.num_generations
    ids = [
        c[m.bool()].tolist()
        for c, m in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu())
    ]
    texts = run.tokenizer.batch_decode(ids, skip_special_tokens=True)
    group_rows, environments = _completion_rows(rows, G, episodes, columns)
    prompts = [row["prompt"] for row in group_rows]
    # with tools, a conversational row's completion is its turns and tool results, as in TRL
    messages = rollout.messages or [None] * len(texts)
    completions = [
        (turns or [{"role": "assistant", "content": text}]) if is_conversational(row) else text
        for row, text, turns in zip(group_rows, texts, messages)
    ]
    rewards_per_func = run.rewards.score(
        prompts,
        completions,
        ids,
        group_rows,
        trainer_state(run.state, run.cfg),
        environments,
        seed=reward_seed(run.state, run.cfg, run.backend.rank),  # reproducible draws
    )
    rewards = algorithm.combine_rewards(rewards_per_func, run.rewards.weights)
    return GenerationBatch(
        group_rows,
        prompts,
        completions,
        texts,
        rollout,
        rewards_per_func,
        rewards,
        loss_mask(rollout, rewards, run.cfg.algorithm.mask_truncated_completions, run.critic),
        # the columns its reward functions logged (log_extra), for the completions table
        extra_columns=run.rewards.last_extra,
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


def loss_mask(rollout, rewards: torch.Tensor, mask_truncated: bool, critic) -> torch.Tensor:
    """[N, T] the completion tokens the loss counts (see the module's docstring)."""
    mask = rollout.completion_mask.clone()
    if rollout.tool_mask is not None:  # tool results were not sampled: no loss on them
        mask = mask * (1 - rollout.tool_mask.to(mask.device))
    if mask_truncated:
        mask[rollout.truncated] = 0
    # with a critic: a completion without a reward (every function failed) leaves the loss
    if critic is not None:
        mask[~torch.isfinite(rewards).to(mask.device)] = 0
    return mask
