"""The exact GRPO math as pure tensor functions.

Nothing here touches a model, an optimizer or a config object: every function
takes tensors and plain numbers and returns tensors, so each formula can be
checked by hand (see tests/test_algorithm.py) and against TRL.

Shapes use these letters:
    N  completions in the batch (= prompts x G)
    G  completions per prompt (one group)
    K  reward functions
    T  completion tokens (padded)
"""

from __future__ import annotations

import math

import torch

ADVANTAGE_EPS = 1e-4  # added to the group std, as in the seed and TRL

from grpo.choices import IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_TYPES, SCALE_REWARDS  # noqa: F401 (re-exported)


# --------------------------------------------------------------------------
# Rewards -> advantages
# --------------------------------------------------------------------------


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of several reward functions, with missing values skipped.

    r_i = sum_k w_k r_{i,k} over the k where r_{i,k} is present (not NaN).
    A completion for which every function returned None stays NaN (missing):
    it is not counted as a zero reward.

    rewards_per_func: [N, K] float, NaN where a function returned None.
    weights:          [K]
    returns:          [N]

    Example: rewards [[1, 0.5], [nan, 1], [nan, nan]], weights [1, 2]
    -> [2.0, 2.0, nan].
    """
    present = ~torch.isnan(rewards_per_func)
    weighted = torch.where(present, rewards_per_func * weights, torch.zeros_like(rewards_per_func))
    total = weighted.sum(dim=1)
    return torch.where(present.any(dim=1), total, torch.full_like(total, float("nan")))


def nan_std(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sample standard deviation (divide by n-1) along `dim`, ignoring NaN; 0 when n < 2."""
    present = ~torch.isnan(x)
    n = present.sum(dim=dim, keepdim=True)
    mean = torch.nansum(x, dim=dim, keepdim=True) / n.clamp(min=1)
    squares = torch.where(present, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=dim, keepdim=True)
    std = torch.where(n > 1, torch.sqrt(squares / (n - 1).clamp(min=1)), torch.zeros_like(squares))
    return std if keepdim else std.squeeze(dim)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = ADVANTAGE_EPS
) -> torch.Tensor:
    """Group-relative advantage, one scalar per completion.

    rewards: [N] total reward per completion, consecutive runs of `group_size`
             completions share a prompt; NaN marks a missing reward.
    returns: [N]

    scale_rewards="group" (GRPO):  A_i = (r_i - mean_g r) / (std_g r + eps)
    scale_rewards="batch":         A_i = (r_i - mean_g r) / (std_batch r + eps)
    scale_rewards="none" (Dr. GRPO): A_i = r_i - mean_g r
    The std divides by (n - 1) (Bessel), as in the seed and TRL. Missing
    rewards are left out of the mean and std and get advantage 0.

    Example (the seed's table), group_size=4, "group":
      [1,1,0,0] -> [ 0.87,  0.87, -0.87, -0.87]
      [1,1,1,0] -> [ 0.50,  0.50,  0.50, -1.50]
      [1,0,0,0] -> [ 1.50, -0.50, -0.50, -0.50]
      [1,1,1,1] -> [ 0.00,  0.00,  0.00,  0.00]
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    present = ~torch.isnan(grouped)
    n = present.sum(dim=1, keepdim=True).clamp(min=1)
    mean = torch.nansum(grouped, dim=1, keepdim=True) / n
    centered = grouped - mean
    if scale_rewards == "group":
        centered = centered / (nan_std(grouped, dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centered = centered / (nan_std(rewards, dim=0) + eps)
    advantages = torch.where(present, centered, torch.zeros_like(centered))
    return advantages.reshape(-1)


def group_reward_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group sample std of the total rewards, [N // group_size]."""
    return nan_std(rewards.view(-1, group_size), dim=1)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong penalty (Eq. 13), one value per completion.

    R(y) = 0                                  if |y| <= L_max - L_cache
         = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
         = -1                                 if |y| > L_max

    Example: max_length=20, buffer=4 -> lengths [16, 18, 20, 21] give
    [0, -0.5, -1, -1].
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    lengths = lengths.to(torch.float32)
    safe = float(max_length - buffer)
    ramp = (safe - lengths) / buffer
    penalty = torch.where(lengths <= safe, torch.zeros_like(lengths), ramp)
    return torch.where(lengths > max_length, torch.full_like(lengths, -1.0), penalty)


# --------------------------------------------------------------------------
# Policy loss
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
    """Reduce per-token losses of one minibatch to the scalar to backpropagate.

    The minibatch is one of `num_minibatches` pieces of a generation batch that
    holds `num_sequences` completions and `num_tokens` completion tokens (all
    ranks). Summing the results over the pieces gives the batch's loss:

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
    mask = mask.to(per_token_loss.dtype)
    if per_token_loss.shape != mask.shape:
        per_token_loss = per_token_loss.expand_as(mask)
    masked = per_token_loss * mask
    if num_sequences is None:
        num_sequences = mask.shape[0]
    if loss_type == "grpo":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_sequence.sum() / num_sequences
    if loss_type == "bnpo":
        if minibatch_tokens is None:
            minibatch_tokens = mask.sum()
        total = torch.as_tensor(minibatch_tokens, dtype=masked.dtype, device=masked.device)
        return masked.sum() / total.clamp(min=1.0) / num_minibatches
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("dr_grpo needs max_completion_length")
        return masked.sum() / (num_sequences * max_completion_length)
    if loss_type == "dapo":
        if num_tokens is None:
            num_tokens = mask.sum()
        total = torch.as_tensor(num_tokens, dtype=masked.dtype, device=masked.device)
        return masked.sum() / total.clamp(min=1.0)
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
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
    """The GRPO objective for one minibatch: clipped surrogate + beta * KL, aggregated.

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
    log_w = log_importance_weights(logp, old_logp, mask, importance_sampling_level)
    ratio = torch.exp(log_w)
    per_token = clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high, delta)
    stats: dict[str, torch.Tensor] = {}
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
    with torch.no_grad():
        adv = advantages.unsqueeze(-1)
        low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).expand_as(mask)
        high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).expand_as(mask)
        stats["clip_low"] = masked_sum(low.to(logp.dtype), mask)
        stats["clip_high"] = masked_sum(high.to(logp.dtype), mask)
        stats["clip_region"] = masked_sum((low | high).to(logp.dtype), mask)
    return loss, stats


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) as a detached float64 scalar, for metrics."""
    return (x.detach().double() * mask.double()).sum()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v along the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def lr_multiplier(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """Learning-rate factor at optimizer step `step` (0-based): linear warm-up
    over `warmup_steps`, then "constant", "linear" decay to 0 (TRL's default)
    or "cosine" decay to 0 at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr schedule must be constant, linear or cosine, got {schedule!r}")
