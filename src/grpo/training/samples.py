"""A step's sample completions for samples.jsonl and the trackers' completions table: every
rank's groups, in rank order, with each reward function's column and those the reward
functions logged (log_extra); with tools, the tool results set apart in the text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.training.batching import GenerationBatch

if TYPE_CHECKING:
    from grpo.training.build import RunParts


def log_samples(run: RunParts, step: int, batch: GenerationBatch) -> None:
    """A few of the step's completions (from every rank's groups, in rank order) to samples.jsonl."""
    names = run.rewards.names
    texts = batch.completion_texts
    if batch.rollout.tool_mask is not None:  # the tool results set apart
        from grpo.rollout.multiturn import marked_texts

        texts = marked_texts(run.tokenizer, batch.rollout)
    parts = run.backend.all_gather_object(
        (
            batch.prompts,
            texts,
            batch.rewards.tolist(),
            batch.rewards_per_func.T.tolist(),
            batch.extra_columns,
        )
    )
    prompts, texts, rewards = ([x for part in parts for x in part[k]] for k in range(3))
    columns = {name: [x for part in parts for x in part[3][k]] for k, name in enumerate(names)}
    extra = {}  # log_extra's columns, None for the completions of a rank that logged none
    for column in dict.fromkeys(c for part in parts for c in part[4]):
        extra[column] = [x for part in parts for x in part[4].get(column, [None] * len(part[0]))]
    run.log.samples(
        step,
        prompts,
        texts,
        rewards,
        run.cfg.rollout.num_generations,
        reward_columns=columns,
        extra_columns=extra,
    )
