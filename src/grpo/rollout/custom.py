"""TRL's `rollout_func`: a rollout the user writes.

`rollout_func(prompts, trainer)` gets one prompt per completion, as the dataset has them (text
or chat messages, not templated), each row's prompt repeated rollout.num_generations times in
a row (group-major, as TRL's batch holds them), and the trainer. It returns a dict:

    prompt_ids       one list of token ids per completion: the prompt as the model saw it
    completion_ids   one list per completion: the tokens the update trains on
    logprobs         one list per completion, as long as its completion_ids: each token's
                     log-probability under the policy that sampled it
    env_mask         optional, as long as completion_ids: 1 for the model's tokens, 0 for tokens
                     an environment wrote (left out of the loss, as tool results are)
    anything else    a list with one value per completion (or one value for all), given to the
                     reward functions under its key, as a dataset column is

TRL's optional `logprob_token_ids` is accepted and not used. Every list is checked before
anything is trained on: the counts, the lengths (a completion of at most
rollout.max_completion_length tokens), token ids within the vocabulary and finite logprobs;
whatever is wrong is refused with one line naming the key and the completion. A completion
that does not end with an end-of-sequence token is counted as truncated.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from grpo.config.errors import ConfigError
from grpo.rollout.types import Rollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
IGNORED = ("logprob_token_ids",)


def require_keys(output: Any) -> None:
    """That a rollout_func's output is a dict holding the required keys (TRL's first check)."""
    if not isinstance(output, dict):
        raise ConfigError(
            f"rollout_func returned a {type(output).__name__}; return a dict with {', '.join(REQUIRED)}"
        )
    missing = [key for key in REQUIRED if key not in output]
    if missing:
        raise ConfigError(f"rollout_func must return keys {missing} in its output dict")


def read_output(
    output: Any,
    n: int,
    *,
    vocab_size: int,
    max_completion_length: int,
    pad_token_id: int,
    eos_token_ids,
) -> tuple[Rollout, dict[str, list]]:
    """A rollout_func's output for `n` completions, checked (module docstring): the rollout, and
    the other values for the reward functions (one per completion each)."""
    require_keys(output)
    prompt_ids = _token_lists(output["prompt_ids"], "prompt_ids", n, vocab_size)
    completion_ids = _token_lists(output["completion_ids"], "completion_ids", n, vocab_size)
    for i, ids in enumerate(completion_ids):
        if len(ids) > max_completion_length:
            raise ConfigError(
                f"rollout_func: completion_ids[{i}] has {len(ids)} tokens, more than "
                f"rollout.max_completion_length={max_completion_length}; cut it or raise max_completion_length"
            )
        if not prompt_ids[i]:
            raise ConfigError(f"rollout_func: prompt_ids[{i}] is empty; give the prompt's tokens")
    logprobs = _aligned(output["logprobs"], "logprobs", completion_ids, float)
    env_mask = output.get("env_mask")
    tool = None
    if env_mask is not None:
        tool = [[1 - m for m in row] for row in _aligned(env_mask, "env_mask", completion_ids, int)]
    columns = {}
    for key, values in output.items():
        if key in REQUIRED or key in IGNORED or key == "env_mask":
            continue
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"rollout_func: returned key {key!r} is not a column name")
        if isinstance(values, list):
            if len(values) != n:
                raise ConfigError(
                    f"rollout_func: {key!r} has {len(values)} values for {n} completions; give one each"
                )
            columns[key] = list(values)
        else:
            columns[key] = [values] * n
    eos = set(eos_token_ids)
    return _rollout(prompt_ids, completion_ids, logprobs, tool, eos, pad_token_id), columns


def _token_lists(value, key: str, n: int, vocab_size: int) -> list[list[int]]:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        count = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise ConfigError(
            f"rollout_func: {key} has {count} entries for {n} prompts; return one list of token ids per "
            "prompt it was given (each row's prompt comes num_generations times)"
        )
    lists = []
    for i, ids in enumerate(value):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        ):
            raise ConfigError(
                f"rollout_func: {key}[{i}] is not a list of token ids below the vocabulary's size {vocab_size}"
            )
        lists.append(list(ids))
    return lists


def _aligned(value, key: str, completion_ids: list[list[int]], kind: type) -> list[list]:
    """Per-token values, one list per completion, as long as its completion_ids."""
    if not isinstance(value, (list, tuple)) or len(value) != len(completion_ids):
        raise ConfigError(
            f"rollout_func: {key} must hold one list per completion ({len(completion_ids)})"
        )
    rows = []
    for i, (row, ids) in enumerate(zip(value, completion_ids)):
        row = row.tolist() if isinstance(row, torch.Tensor) else row
        if not isinstance(row, (list, tuple)) or len(row) != len(ids):
            raise ConfigError(
                f"rollout_func: {key}[{i}] must have one value per token of completion_ids[{i}] ({len(ids)})"
            )
        if kind is float and not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x <= 0
            for x in row
        ):
            raise ConfigError(
                f"rollout_func: {key}[{i}] holds a value that is not a finite log-probability (<= 0)"
            )
        if kind is int and not all(x in (0, 1) for x in row):
            raise ConfigError(f"rollout_func: {key}[{i}] must hold 0s and 1s")
        rows.append([kind(x) for x in row])
    return rows


def _rollout(prompt_ids, completion_ids, logprobs, tool, eos: set, pad: int) -> Rollout:
    N = len(prompt_ids)
    lp = max(len(p) for p in prompt_ids)
    lc = max(1, max(len(c) for c in completion_ids))
    prompts = torch.full((N, lp), pad, dtype=torch.long, device="cpu")
    prompt_mask = torch.zeros((N, lp), dtype=torch.long, device="cpu")
    ids = torch.full((N, lc), pad, dtype=torch.long, device="cpu")
    mask = torch.zeros((N, lc), dtype=torch.long, device="cpu")
    sampled = torch.zeros((N, lc), dtype=torch.float32, device="cpu")
    tool_mask = torch.zeros((N, lc), dtype=torch.long, device="cpu") if tool is not None else None
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        prompts[i, lp - len(p) :] = torch.tensor(p, device="cpu")
        prompt_mask[i, lp - len(p) :] = 1
        ids[i, : len(c)] = torch.tensor(c, dtype=torch.long, device="cpu")
        mask[i, : len(c)] = 1
        sampled[i, : len(c)] = torch.tensor(logprobs[i], dtype=torch.float32, device="cpu")
        if tool_mask is not None:
            tool_mask[i, : len(c)] = torch.tensor(tool[i], dtype=torch.long, device="cpu")
    truncated = torch.tensor([not c or c[-1] not in eos for c in completion_ids], device="cpu")
    return Rollout(prompts, prompt_mask, ids, mask, truncated, sampled, tool_mask)
