"""TRL's `_generate` output: a grpo Rollout as the lists per completion TRL 1.16's generation
step returns."""

from __future__ import annotations


def trl_generation(rollout, prompts: list, extra: dict, tokenizer) -> tuple:
    """A Rollout as the first six items of TRL's _generate: (prompt_ids, completion_ids,
    tool_mask, completions, logprobs, extra_fields), lists per completion."""
    prompt_ids = [
        row[mask.bool()].tolist() for row, mask in zip(rollout.prompt_ids, rollout.prompt_mask)
    ]
    lengths = rollout.completion_mask.sum(dim=1).tolist()
    completion_ids = [row[:n].tolist() for row, n in zip(rollout.completion_ids, lengths)]
    tool_mask = logprobs = None
    if rollout.tool_mask is not None:
        tool_mask = [
            [1 - t for t in row[:n].tolist()] for row, n in zip(rollout.tool_mask, lengths)
        ]
    if rollout.sampling_logprobs is not None:
        logprobs = [row[:n].tolist() for row, n in zip(rollout.sampling_logprobs, lengths)]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
    if prompts and isinstance(prompts[0], list):  # conversational: the messages, as TRL's
        messages = rollout.messages or [None] * len(texts)
        completions = [m or [{"role": "assistant", "content": x}] for m, x in zip(messages, texts)]
    else:
        completions = texts
    return prompt_ids, completion_ids, tool_mask, completions, logprobs, dict(extra)
