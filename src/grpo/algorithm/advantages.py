"""Rewards -> advantages, as pure tensor functions.

Shapes: N completions in the batch (= prompts x G), G completions per prompt
(one group), K reward functions, T completion tokens. Each function's docstring
has its formula and a worked example (checked in tests/algorithm/test_advantages.py).

An advantage estimator, the registered kind (grpo.registry.ADVANTAGE_ESTIMATORS),
has one signature, and is registered where it is defined:

    @ADVANTAGE_ESTIMATORS.register("name")
    def estimator(inputs: AdvantageInputs) -> advantages [N] (or [N, T], one per token)

`AdvantageInputs` is the whole generation batch: every rank's completions, so
that batch-wide statistics are the batch's. NaN marks a missing reward (its
advantage is 0; the other rewards' statistics are computed without it).
Registered here: `grpo` (GRPO; Dr. GRPO with scale_rewards="none"), `dr_grpo`,
`rloo`, `reinforce_pp`; `scale_rewards` applies to `grpo` only. `gae` (PPO,
grpo.algorithm.values) is registered with `needs_values=True`: it reads the
critic's values, so a run that chooses it trains a critic.

Several reward functions reach the advantages as the registered multi-objective
aggregation says (grpo.registry.MULTI_OBJECTIVE_AGGREGATIONS, `fn(inputs, estimator)`):
`sum_then_normalize`, the estimator on their weighted sum (`combine_rewards`), or
`normalize_then_sum`, GDPO's, each normalised in its group first
(`normalize_then_sum_advantages`), in place of the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.registry import ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS

ADVANTAGE_EPS = 1e-4  # added to the group std, as in the seed and TRL


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator reads, of the whole generation batch (every rank's
    completions, whole groups, in order).

    rewards           [N] the reward functions' weighted sum (`combine_rewards`; NaN: missing)
    group_size        G: each consecutive run of G completions shares a prompt
    scale_rewards     "group", "batch" or "none": the `grpo` estimator's std
    rewards_per_func  [N, K] each function's rewards (NaN: it returned None)
    reward_weights    [K] their weights
    values            [N, T] the critic's values, given to an estimator that `needs_values`
    completion_mask   [N, T] the completions' tokens (with values)
    loss_mask         [N, T] the tokens the loss counts (with values: `gae` whitens over them)
    gamma, lam        GAE's discount and lambda; `whiten`: whether `gae` whitens its advantages
    """

    rewards: torch.Tensor
    group_size: int
    scale_rewards: str = "group"
    rewards_per_func: torch.Tensor | None = None
    reward_weights: torch.Tensor | None = None
    values: torch.Tensor | None = None
    completion_mask: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True


def needs_values(estimator) -> bool:
    """Whether a registered estimator reads the critic's values (registered with needs_values=True)."""
    return getattr(estimator, "needs_values", False)


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
    rewards (NaN, and inf) are left out of the mean and std and get advantage 0.

    Example (the seed's table), group_size=4, "group":
      [1,1,0,0] -> [ 0.87,  0.87, -0.87, -0.87]
      [1,1,1,0] -> [ 0.50,  0.50,  0.50, -1.50]
      [1,0,0,0] -> [ 1.50, -0.50, -0.50, -0.50]
      [1,1,1,1] -> [ 0.00,  0.00,  0.00,  0.00]
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    dtype = rewards.dtype
    # float64, so that squares of large float32 rewards cannot overflow into an inf std, and
    # inf (a sum of weighted rewards past float32) counts as missing: an advantage is always finite
    rewards = rewards.double()
    rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
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
    return advantages.reshape(-1).to(dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """The registered `grpo` estimator: group_advantages (GRPO, or Dr. GRPO with scale_rewards="none")."""
    return group_advantages(inputs.rewards, inputs.group_size, inputs.scale_rewards)


def _finite_or_nan(rewards: torch.Tensor) -> torch.Tensor:
    """float64 copy with inf (a weighted sum past float32) counted as missing, like NaN."""
    rewards = rewards.double()
    return torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))


def _check_grouped(rewards: torch.Tensor, group_size: int) -> None:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """The registered `dr_grpo` estimator (Dr. GRPO, Liu et al. 2025): A_i = r_i - mean_g r.

    The group mean is subtracted and nothing is divided, whatever `scale_rewards`
    says (it is ignored): Dr. GRPO's
    point is that dividing by the group std over-weights groups that are almost
    all right or all wrong. Same as `grpo` with scale_rewards="none".

    Example, group_size=4: [1, 1, 0, 0] -> [0.5, 0.5, -0.5, -0.5];
    [1, nan, 0, 0] -> mean 1/3 -> [0.6667, 0, -0.3333, -0.3333].
    """
    return group_advantages(inputs.rewards, inputs.group_size, "none")


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """The registered `rloo` estimator (REINFORCE leave-one-out, Ahmadian et al. 2024).

    A_i = r_i - (1 / (n - 1)) sum_{j != i} r_j, the sum over the other present
    rewards of i's group (n of them present, i included); equivalently
    A_i = n / (n - 1) * (r_i - mean_g r). A completion whose group has no other
    present reward gets 0 (there is no baseline to compare with), and a missing
    reward gets 0. `scale_rewards` is ignored (no std scaling).

    Example, group_size=4: [1, 0, 0, 1] -> sum 2 -> 1 - 1/3, 0 - 2/3:
    [0.6667, -0.6667, -0.6667, 0.6667]; [1, nan, 0, 0] -> n = 3, sum 1 ->
    [1 - 0/2, 0, 0 - 1/2, 0 - 1/2] = [1, 0, -0.5, -0.5]; [nan, 3, nan, nan] -> 0.
    """
    rewards, group_size = inputs.rewards, inputs.group_size
    _check_grouped(rewards, group_size)
    dtype = rewards.dtype
    grouped = _finite_or_nan(rewards).view(-1, group_size)
    present = ~torch.isnan(grouped)
    n = present.sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    others_mean = (total - grouped) / (n - 1).clamp(min=1)
    advantages = torch.where(present & (n > 1), grouped - others_mean, torch.zeros_like(grouped))
    return advantages.reshape(-1).to(dtype)


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(inputs: AdvantageInputs, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """The registered `reinforce_pp` estimator: REINFORCE++ (Hu et al. 2025) with outcome rewards.

    A_i = (r_i - mean_batch r) / (std_batch r + eps)

    The baseline and the scale are the whole batch's (every present reward of
    every group), with no group baseline: a group that is all right still gets
    positive advantages when the batch's mean is lower. The std is Bessel's
    (n - 1), eps = 1e-4 as for `grpo`. `group_size` only checks the shape and
    `scale_rewards` is ignored. REINFORCE++ also puts a per-token KL
    penalty into the reward; that is not done here: the KL stays in the loss,
    weighted by `algorithm.beta`, as for every other estimator.

    Example, group_size=4, [1, 0, 0, 0, 1, 1, 1, 1]: mean 5/8, squares
    5 (3/8)^2 + 3 (5/8)^2 = 15/8, std = sqrt(15/56) = 0.51755 ->
    1: 0.375 / 0.51765 = 0.7244, 0: -0.625 / 0.51765 = -1.2074.
    """
    rewards = inputs.rewards
    _check_grouped(rewards, inputs.group_size)
    dtype = rewards.dtype
    flat = _finite_or_nan(rewards)
    present = ~torch.isnan(flat)
    mean = torch.nansum(flat) / present.sum().clamp(min=1)
    advantages = (flat - mean) / (nan_std(flat, dim=0) + eps)
    return torch.where(present, advantages, torch.zeros_like(advantages)).to(dtype)


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """GDPO's multi-objective advantage (TRL's multi_objective_aggregation="normalize_then_sum").

    Each reward function is normalised within each group first, then the weighted
    sum is normalised over the whole batch:

        z_{i,k} = (r_{i,k} - mean_g r_k) / (std_g r_k + eps)         per function k, group g of i
        s_i     = sum_k w_k z_{i,k}        over the k where r_{i,k} is present
        A_i     = (s_i - mean_batch s) / (std_batch s + eps)

    so a function with a small spread weighs as much as one with a large spread
    (the weighted sum of raw rewards lets the largest dominate). The stds are
    Bessel's (n - 1); `scale_rewards` plays no part (as in TRL). Missing rewards
    (NaN, and inf) are left out of their function's group mean and std and of the
    sum; a function with fewer than two present values in a group contributes 0
    there (TRL: a NaN std, skipped by its nansum); a completion with no present
    reward at all is left out of the batch mean and std and gets advantage 0.
    Computed in float64, returned in the rewards' dtype.

    rewards_per_func [N, K], weights [K] -> advantages [N].

    Example, group_size 2, K = 2, weights [1, 1], rewards [[1, 0], [0, 0], [1, 10], [0, 0]]:
    function 0: groups [1, 0], [1, 0] -> z = +-0.5 / (0.70711 + 1e-4) = +-0.70701;
    function 1: group [0, 0] -> 0, group [10, 0] -> +-5 / (7.07107 + 1e-4) = +-0.70710;
    s = [0.70701, -0.70701, 1.41411, -1.41411] -> mean 0, std 1.29094 ->
    A = [0.54765, -0.54765, 1.09537, -1.09537].
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards_per_func must be [N, K] with N a multiple of group_size={group_size}, "
            f"got {tuple(rewards_per_func.shape)}"
        )
    if weights.shape != (rewards_per_func.shape[1],):
        raise ValueError(
            f"weights must have one entry per reward function ({rewards_per_func.shape[1]}), got {tuple(weights.shape)}"
        )
    dtype = rewards_per_func.dtype
    rewards = _finite_or_nan(rewards_per_func)
    K = rewards.shape[1]
    grouped = rewards.view(-1, group_size, K)
    present = ~torch.isnan(grouped)
    n = present.sum(dim=1, keepdim=True)
    mean = torch.nansum(grouped, dim=1, keepdim=True) / n.clamp(min=1)
    std = nan_std(grouped, dim=1, keepdim=True)
    z = (grouped - mean) / (std + eps)
    counted = present & (n > 1)
    z = torch.where(counted, z, torch.zeros_like(z)).view(-1, K)
    summed = (z * weights.to(z.device, torch.float64)).sum(dim=1)
    scorable = present.view(-1, K).any(dim=1)
    summed = torch.where(scorable, summed, torch.full_like(summed, float("nan")))
    batch_mean = torch.nansum(summed) / scorable.sum().clamp(min=1)
    advantages = (summed - batch_mean) / (nan_std(summed, dim=0) + eps)
    return torch.where(scorable, advantages, torch.zeros_like(advantages)).to(dtype)


@MULTI_OBJECTIVE_AGGREGATIONS.register("sum_then_normalize")
def sum_then_normalize(inputs: AdvantageInputs, estimator) -> torch.Tensor:
    """TRL's default: the estimator on the reward functions' weighted sum (`inputs.rewards`)."""
    return estimator(inputs)


@MULTI_OBJECTIVE_AGGREGATIONS.register("normalize_then_sum")
def normalize_then_sum(inputs: AdvantageInputs, estimator) -> torch.Tensor:
    """GDPO's: `normalize_then_sum_advantages` of each function's rewards, in place of the
    estimator (the group-relative `grpo`, which the config check requires with it)."""
    return normalize_then_sum_advantages(
        inputs.rewards_per_func, inputs.reward_weights, inputs.group_size
    )


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
