"""The entropy bonus and its adaptive coefficient, as pure functions.

The bonus (TRL's `entropy_coef`) subtracts coef x the policy's mean entropy
over the tokens the policy loss acts on from the loss, so that minimising the
loss also keeps the policy from collapsing onto one token:

    loss = policy loss (+ beta KL) - coef * H_mean

The adaptive controller (TRL's `use_adaptive_entropy`, from Skywork-OR1) moves
the coefficient once per optimizer step against a target entropy, and applies
it only while the entropy is at or below that target.

How grpo's update maps onto TRL's optimizer steps: one optimizer pass over the
generation batch (grpo.training.update; num_iterations of them per step) is
one TRL optimizer step; its minibatches (per_device_train_batch_size
completions each, gradient_accumulation_steps of them per rank) are TRL's
micro-batches of one gradient-accumulation window; grpo may compute a
minibatch in several micro-batches (training.microbatch_tokens) to bound
memory, which TRL does not do. Checked against TRL in tests/test_trl_equivalence.py.
"""

from __future__ import annotations

import torch


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    minibatch_tokens: float,
    num_minibatches: int = 1,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """This piece's share of the window's mean entropy, the term the loss subtracts coef times.

    With E = M * keep the tokens the bonus acts on (keep: the entropy mask, or all):

        bonus = (sum H E / sum E) * (sum M / minibatch_tokens) / num_minibatches

    TRL 1.16 adds, per micro-batch, -coef * (sum H E / sum E) / gradient_accumulation_steps
    (a token mean per micro-batch, scaled for accumulation only, whatever the
    loss_type), and averages gradients over ranks. A grpo minibatch is one such
    micro-batch and `num_minibatches` counts them over every rank, so for a
    minibatch computed in one piece the second factor is exactly 1 and the value
    is TRL's. A minibatch split into several micro-batches gives each its share of
    the minibatch's tokens: without an entropy mask the pieces then sum exactly to
    sum H M / minibatch_tokens (the minibatch's token mean); with one, the kept
    tokens of the whole minibatch are not known before its first piece's
    backward, so each piece's kept-token mean is weighted by its share of the
    tokens instead.

    entropy [N, T] (with gradient when the bonus is to act), mask [N, T], keep bool [N, T] or None.
    Returns a scalar in entropy's dtype; 0 for a piece without tokens.

    Example: H = [[1, 2], [3, x]], M = [[1, 1], [1, 0]], one piece of one minibatch:
    bonus = 6 / 3 = 2; with keep [[F, T], [T, F]]: (2 + 3) / 2 = 2.5; as one of
    2 minibatches (2 per rank on 1 rank): 1.0 and 1.25.
    """
    m = mask.to(entropy.dtype)
    effective = m if keep is None else m * keep.to(entropy.dtype)
    piece_mean = (entropy * effective).sum() / effective.sum().clamp(min=1.0)
    total = torch.as_tensor(minibatch_tokens, dtype=entropy.dtype, device=entropy.device)
    share = m.sum() / total.clamp(min=1.0)
    return piece_mean * share / num_minibatches


def next_entropy_coef(
    coef: float,
    entropy: float,
    target: float,
    delta: float,
    coef_min: float,
    coef_max: float,
) -> float:
    """The adaptive controller's coefficient for the next optimizer step (Skywork-OR1, TRL 1.16).

        coef' = min(coef + delta, coef_max)   if entropy <= target
              = max(coef - delta, coef_min)   otherwise (a NaN entropy too)

    `entropy` is the step's token-weighted mean over every micro-batch and rank
    (sum H E / sum E, E the tokens the bonus acts on).

    Example: target 0.2, delta 0.005, bounds [0, 1]: coef 0.01, entropy 0.15 -> 0.015;
    entropy 0.3 -> 0.005; coef 0.003, entropy 0.3 -> 0.0; coef 0.998, entropy 0.1 -> 1.0.
    """
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The coefficient the adaptive controller applies during a step: coef when the previous
    step's entropy was at or below target, else 0. Before any measurement last_entropy is inf
    (TRL's start), so the first step applies none.

    Example: target 0.2: (0.05, 0.15) -> 0.05; (0.05, 0.3) -> 0.0; (0.05, inf) -> 0.0.
    """
    return coef if last_entropy <= target else 0.0
