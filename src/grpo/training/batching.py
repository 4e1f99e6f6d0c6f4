"""The generation batch, and how it is cut into minibatches and micro-batches.

A generation batch is every completion of one step with its rewards (the
advantages phase computes their advantages from it, grpo.training.advantages). The update walks it in minibatches (one optimizer step per
`gradient_accumulation_steps` of them, as in TRL) and computes each minibatch
in micro-batches bounded by a token budget, so activation memory stays bounded
whatever the batch size. Both splits keep a group's completions together (the
shared prompt is computed once per piece) and neither changes the gradient:
the loss is normalised by counts of the whole batch (grpo.algorithm.losses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.rollout.types import Rollout
from grpo.tasks.data import Row


@dataclass
class GenerationBatch:
    """Everything the update needs about one generation batch (N completions)."""

    rows: list[Row]  # dataset row of each completion (each prompt's row repeated G times)
    prompts: list[Any]  # prompt as given to reward functions
    completions: list[Any]  # completion as given to reward functions
    completion_texts: list[str]
    rollout: Rollout
    rewards_per_func: torch.Tensor  # [N, K], NaN = missing
    rewards: torch.Tensor  # [N] weighted total, NaN = all missing
    loss_mask: torch.Tensor  # [N, T] completion tokens that count in the loss
    sampling_rounds: int = 1
    zero_std_groups_kept: int = 0
    # the columns reward functions logged (log_extra): one value per completion, None where absent
    extra_columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, rows: torch.Tensor) -> "GenerationBatch":
        """The completions at indices `rows`, in that order."""
        idx = rows.tolist()
        return GenerationBatch(
            [self.rows[i] for i in idx],
            [self.prompts[i] for i in idx],
            [self.completions[i] for i in idx],
            [self.completion_texts[i] for i in idx],
            self.rollout.select(rows),
            self.rewards_per_func[rows],
            self.rewards[rows],
            self.loss_mask[rows],
            extra_columns={c: [v[i] for i in idx] for c, v in self.extra_columns.items()},
        )

    @staticmethod
    def concat(parts: list["GenerationBatch"], pad_token_id: int) -> "GenerationBatch":
        """The completions of `parts` one after another (widths padded to the widest)."""
        rollout = Rollout.concat([p.rollout for p in parts], pad_token_id)
        T = rollout.completion_ids.shape[1]
        return GenerationBatch(
            [r for p in parts for r in p.rows],
            [x for p in parts for x in p.prompts],
            [x for p in parts for x in p.completions],
            [x for p in parts for x in p.completion_texts],
            rollout,
            torch.cat([p.rewards_per_func for p in parts]),
            torch.cat([p.rewards for p in parts]),
            torch.cat(
                [torch.nn.functional.pad(p.loss_mask, (0, T - p.loss_mask.shape[1])) for p in parts]
            ),
            extra_columns={
                column: [x for p in parts for x in p.extra_columns.get(column, [None] * len(p))]
                for column in dict.fromkeys(c for p in parts for c in p.extra_columns)
            },
        )


def minibatches(lengths: list[int], group_size: int, size: int) -> list[torch.Tensor]:
    """Row indices of each minibatch of `size` completions, similar lengths together.

    Each minibatch is padded to its longest completion, so groups are ordered by
    their longest completion (and rows within a group by length); groups stay
    together so that their shared prompt is computed once. The grpo, dr_grpo and
    dapo losses do not depend on the split.

    Example: lengths [3, 1, 5, 2] in groups of 2, size 2 -> [[1, 0], [3, 2]].
    """
    G = group_size
    group_max = [max(lengths[g : g + G]) for g in range(0, len(lengths), G)]
    order = sorted(range(len(lengths)), key=lambda i: (group_max[i // G], i // G, lengths[i]))
    order = torch.tensor(order, dtype=torch.long, device="cpu")
    return [order[i : i + size] for i in range(0, len(order), size)]


def microbatches(rollout: Rollout, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Split a minibatch's rows (in `minibatches` order) into consecutive pieces of at
    most `budget` token positions (`training.microbatch_tokens`; 0: one piece).

    A piece costs its distinct prompts' lengths (each prompt runs once per piece)
    plus rows x its longest completion (the padded width). A row that alone
    exceeds the budget is its own piece.
    """
    if budget <= 0:
        return [rows]
    prompt_lengths = rollout.prompt_mask.sum(-1).tolist()
    lengths = rollout.completion_mask.sum(-1).tolist()
    pieces, current, prompts, width = [], [], set(), 0
    for r in rows.tolist():
        key = (
            tuple(rollout.prompt_ids[r, -prompt_lengths[r] :].tolist()) if prompt_lengths[r] else ()
        )
        new_prompts = prompts | {key}
        new_width = max(width, lengths[r])
        cost = sum(len(p) for p in new_prompts) + (len(current) + 1) * new_width
        if current and cost > budget:
            pieces.append(current)
            current, new_prompts, new_width = [], {key}, lengths[r]
        current.append(r)
        prompts, width = new_prompts, new_width
    pieces.append(current)
    return [torch.tensor(p, dtype=torch.long, device="cpu") for p in pieces]


def groups_with_spread(batch: GenerationBatch, group_size: int) -> torch.Tensor:
    """[groups] bool: the groups whose total rewards are not all equal (a learning signal)."""
    from grpo.algorithm import group_reward_std

    return group_reward_std(batch.rewards, group_size) > 0


def choose_groups(spread: list[list[bool]], num_groups: int) -> tuple[list[tuple[int, int]], int]:
    """DAPO's dynamic sampling as a choice: from rounds of groups (`spread[r][g]`: whether group
    g of round r has reward spread), `num_groups` groups as (round, group), those with spread
    first in the order they were drawn, topped up with groups without spread when the rounds
    ran out; and how many of those were needed.

    Example: spread [[False, True], [True, True]], 2 groups -> [(0, 1), (1, 0)], 0.
    """
    drawn = [(r, g) for r, flags in enumerate(spread) for g in range(len(flags))]
    kept = [(r, g) for r, g in drawn if spread[r][g]]
    spare = [(r, g) for r, g in drawn if not spread[r][g]]
    missing = max(0, num_groups - len(kept))
    return kept[:num_groups] + spare[:missing], missing


def keep_groups_with_spread(
    batches: list[GenerationBatch],
    num_groups: int,
    group_size: int,
    pad_token_id: int,
    spread: list[list[bool]] | None = None,
    first_group: int = 0,
) -> GenerationBatch:
    """The groups `choose_groups` keeps out of the rounds in `batches` (before their advantages,
    which the step computes once, over the final batch).

    Data parallel: `spread` holds every rank's flags of each round in rank order, and this
    process's round r is groups first_group .. first_group + len(batches[r]) / G of it, so every
    rank keeps exactly its share of the groups one process would keep (possibly none)."""
    G = group_size
    if spread is None:
        spread = [groups_with_spread(batch, G).tolist() for batch in batches]
    chosen, missing = choose_groups(spread, num_groups)
    mine = [
        batches[r].select(
            torch.arange((g - first_group) * G, (g - first_group + 1) * G, device="cpu")
        )
        for r, g in chosen
        if first_group <= g < first_group + len(batches[r]) // G
    ]
    merged = (
        GenerationBatch.concat(mine, pad_token_id)
        if mine
        # this rank keeps no group: an empty batch
        else batches[0].select(torch.zeros(0, dtype=torch.long, device="cpu"))
    )
    merged.sampling_rounds, merged.zero_std_groups_kept = len(batches), missing
    return merged
