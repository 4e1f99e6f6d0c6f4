"""The policy loss, as pure tensor functions.

Shapes: N completions, T completion tokens (padded). Each function's docstring
has its formula and a worked example (checked in tests/test_algorithm.py and
against TRL in tests/test_trl_equivalence.py).

Two registered kinds, one signature each:

- a policy loss (grpo.registry.POLICY_LOSSES), the per-token objective:
      loss(logp, old_logp, advantages, mask, params: PolicyLossParams) -> (per-token loss, stats)
- a loss aggregation (grpo.registry.LOSS_AGGREGATIONS, `algorithm.loss_type`):
      aggregate(per_token_loss, mask, norm: LossNormalisers) -> scalar
  The normalisers are passed in, counted over the whole generation batch (all
  ranks), never from the tensors at hand: splitting a batch into minibatches,
  micro-batches or ranks cannot change the loss.

`policy_loss` puts them together with the KL penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.registry import IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES


# --------------------------------------------------------------------------
# Ratios, clipping, KL
# --------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / sum(m), 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def log_importance_weights(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log rho, the log importance ratio between the current and sampling policy.

    level="token":    log rho_{i,t} = logp_{i,t} - old_{i,t}               -> [N, T]
    level="sequence": log rho_i = sum_t m (logp - old) / sum_t m  (GSPO)  -> [N, 1]

    Example: logp - old = [[0.2, 0.4, x]], mask [[1, 1, 0]] -> token level
    [[0.2, 0.4, x]], sequence level [[0.3]]. An all-masked row gives 0.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, got {level!r}")


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Per-token PPO surrogate loss (to minimise).

    l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    With `delta`, rho in the unclipped term is capped at delta (two-sided
    clipping), so a negative-advantage token cannot push an exploding ratio.

    ratio:      [N, T] or [N, 1]
    advantages: [N]
    returns:    broadcast of the two, [N, T] or [N, 1]

    Example: A=+1, eps=0.2: rho=1.5 -> -1.2 (clipped); rho=0.5 -> -0.5.
             A=-1, eps=0.2: rho=0.5 -> 0.8 (clipped); rho=1.5 -> 1.5;
             with delta=1.3, rho=1.5 -> 1.3.
    """
    adv = advantages.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    return -torch.min(unclipped * adv, clipped * adv)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    With x = ref - logp:  k1 = -x,  k2 = x^2 / 2,  k3 = exp(x) - x - 1.
    k3 (the default, the seeds' formula) is unbiased and never negative.

    Example: logp = log 0.5, ref = log 0.25 -> x = -log 2:
    k1 = 0.6931, k2 = 0.2402, k3 = 0.5 + 0.6931 - 1 = 0.1931.
    """
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(x) - x - 1.0
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


# --------------------------------------------------------------------------
# Aggregation: per-token losses -> the scalar to backpropagate
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LossNormalisers:
    """What a minibatch's loss is divided by, counted over the whole generation batch.

    The minibatch is one of `num_minibatches` pieces of a generation batch that
    holds `num_sequences` completions and `num_tokens` completion tokens (all
    ranks); `minibatch_tokens` counts the tokens of this minibatch (bnpo), and
    `max_completion_length` is dr_grpo's fixed length.
    """

    num_sequences: int
    num_tokens: float
    num_minibatches: int = 1
    minibatch_tokens: float | None = None
    max_completion_length: int | None = None


def _masked(per_token_loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L * M, M) with M in L's dtype and L broadcast to M's shape (sequence-level losses)."""
    mask = mask.to(per_token_loss.dtype)
    if per_token_loss.shape != mask.shape:
        per_token_loss = per_token_loss.expand_as(mask)
    return per_token_loss * mask, mask


def _count(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1.0)


def per_sequence_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers) -> torch.Tensor:
    """`grpo`: (1/num_sequences) sum_i (sum_t L M / sum_t M)."""
    masked, mask = _masked(per_token_loss, mask)
    per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / norm.num_sequences


def minibatch_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers) -> torch.Tensor:
    """`bnpo`: (sum L M / minibatch_tokens) / num_minibatches (TRL normalises per minibatch)."""
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / _count(norm.minibatch_tokens, masked) / norm.num_minibatches


def fixed_length_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers) -> torch.Tensor:
    """`dr_grpo`: sum L M / (num_sequences * max_completion_length)."""
    if norm.max_completion_length is None:
        raise ValueError("dr_grpo needs max_completion_length")
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / (norm.num_sequences * norm.max_completion_length)


def batch_token_mean(per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers) -> torch.Tensor:
    """`dapo`: sum L M / num_tokens (every completion token of the generation batch)."""
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / _count(norm.num_tokens, masked)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    num_minibatches: int = 1,
    minibatch_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce per-token losses of one minibatch to the scalar to backpropagate, with the
    aggregation registered as `loss_type`. Summing the results over the pieces of a
    generation batch gives the batch's loss:

    grpo:    (1/num_sequences) sum_i (sum_t L M / sum_t M)   per-sequence mean
    bnpo:    (sum L M / minibatch_tokens) / num_minibatches
    dr_grpo: sum L M / (num_sequences * max_completion_length)
    dapo:    sum L M / num_tokens

    For grpo, dr_grpo and dapo the sum over minibatches does not depend on how
    the batch is split; bnpo normalises per minibatch, as TRL does. A minibatch
    may itself be computed in micro-batches (to bound activation memory): each
    passes its minibatch's `minibatch_tokens`, and the micro-batches' results
    sum to the minibatch's. Defaults (None) take the totals from the tensors
    given, i.e. a single-piece batch.

    Example: L = [[1, 3], [2, x]], M = [[1, 1], [1, 0]], one piece, T_max=4:
    grpo (2 + 2)/2 = 2;  bnpo 6/3 = 2;  dr_grpo 6/(2*4) = 0.75;  dapo 6/3 = 2.
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_type)  # a ConfigError (a ValueError) for an unknown name
    whole = mask.to(per_token_loss.dtype).sum()
    norm = LossNormalisers(
        num_sequences=mask.shape[0] if num_sequences is None else num_sequences,
        num_tokens=whole if num_tokens is None else num_tokens,
        num_minibatches=num_minibatches,
        minibatch_tokens=whole if minibatch_tokens is None else minibatch_tokens,
        max_completion_length=max_completion_length,
    )
    return aggregate(per_token_loss, mask, norm)


# --------------------------------------------------------------------------
# The per-token objective and the whole loss
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossParams:
    """The clipping settings of a policy loss (algorithm.epsilon, epsilon_high, delta,
    importance_sampling_level)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`clipped`: the PPO-style surrogate of GRPO, DAPO and GSPO, per token.

    rho = exp(log_importance_weights(logp, old, level)),
    l = clipped_surrogate(rho, A, eps_low, eps_high, delta), [N, T] or [N, 1].
    Statistics (detached sums over masked tokens): clip_low (rho < 1 - eps_low
    with A < 0), clip_high (rho > 1 + eps_high with A > 0), clip_region (either).
    """
    log_w = log_importance_weights(logp, old_logp, mask, params.importance_sampling_level)
    ratio = torch.exp(log_w)
    per_token = clipped_surrogate(ratio, advantages, params.epsilon_low, params.epsilon_high, params.delta)
    with torch.no_grad():
        adv = advantages.unsqueeze(-1)
        low = ((ratio < 1.0 - params.epsilon_low) & (adv < 0)).expand_as(mask)
        high = ((ratio > 1.0 + params.epsilon_high) & (adv > 0)).expand_as(mask)
        stats = {
            "clip_low": masked_sum(low.to(logp.dtype), mask),
            "clip_high": masked_sum(high.to(logp.dtype), mask),
            "clip_region": masked_sum((low | high).to(logp.dtype), mask),
        }
    return per_token, stats


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str = "clipped",
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    num_minibatches: int = 1,
    minibatch_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective for one minibatch: policy loss `objective` + beta * KL, aggregated
    by `loss_type`.

    logp:      [N, T] log pi_theta of the sampled tokens (requires grad)
    old_logp:  [N, T] log pi_old (sampling policy); None means pi_old = pi_theta
               (num_iterations == 1), i.e. logp.detach(): ratio 1, no extra pass
    advantages:[N]
    mask:      [N, T] 1 for completion tokens that count
    ref_logp:  [N, T] log pi_ref, needed when beta > 0

    Returns the scalar loss and detached statistics summed over masked tokens
    (the caller divides by token counts): kl, clip_low, clip_high, clip_region.
    """
    if old_logp is None:
        old_logp = logp.detach()
    params = PolicyLossParams(epsilon_low, epsilon_high, delta, importance_sampling_level)
    per_token, stats = POLICY_LOSSES.get(objective)(logp, old_logp, advantages, mask, params)
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        per_token = per_token + beta * kl
        stats["kl"] = masked_sum(kl.detach(), mask)
    loss = aggregate_loss(
        per_token,
        mask,
        loss_type,
        max_completion_length=max_completion_length,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        num_minibatches=num_minibatches,
        minibatch_tokens=minibatch_tokens,
    )
    return loss, stats


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) as a detached float64 scalar, for metrics."""
    return (x.detach().double() * mask.double()).sum()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v along the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
