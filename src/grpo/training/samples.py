"""A step's sample completions for samples.jsonl and the trackers' completions table: every
rank's groups, in rank order, with each reward function's column and those the reward
functions logged (log_extra); with tools, the tool results set apart in the text."""

from __future__ import annotations

from grpo.training.batching import GenerationBatch


def log_samples(
    run_log,
    backend,
    tokenizer,
    reward_names: list[str],
    num_generations: int,
    step: int,
    batch: GenerationBatch,
) -> None:
    """A few of the step's completions (from every rank's groups, in rank order, one per group of
    `num_generations`) to samples.jsonl (`run_log`, grpo.run.runlog.RunLog), each with its reward
    functions' columns."""
    names = reward_names
    texts = batch.completion_texts
    if batch.rollout.tool_mask is not None:  # the tool results set apart
        from grpo.rollout.multiturn import marked_texts

        texts = marked_texts(tokenizer, batch.rollout)
    parts = backend.all_gather_object(
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
    run_log.samples(
        step,
        prompts,
        texts,
        rewards,
        num_generations,
        reward_columns=columns,
        extra_columns=extra,
    )
