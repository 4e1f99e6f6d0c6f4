"""PPO's critic math, as pure tensor functions: GAE, advantage whitening, the value loss.

Shapes: N completions, T completion tokens, right-padded (a row's mask is
1...1 0...0). Each function's docstring has its formula and a worked example
(checked in tests/algorithm/test_values.py).

With `algorithm.advantage_estimator: gae` the advantages are per token, [N, T]:
each completion's outcome reward on its last token (`outcome_token_rewards`),
the critic's V_t, `gae_advantages`, then whitening; the policy losses accept
[N, T] advantages as well as [N]. `gae_estimator` is the registered entry
(`needs_values=True`: the run trains a critic, and its values reach the
estimator as `AdvantageInputs.values`); the critic learns `gae_returns`.
"""

from __future__ import annotations

import torch

from grpo.algorithm.advantages import AdvantageInputs
from grpo.registry import ADVANTAGE_ESTIMATORS


@ADVANTAGE_ESTIMATORS.register("gae", needs_values=True)
def gae_estimator(inputs: AdvantageInputs) -> torch.Tensor:
    """The registered `gae` estimator: PPO's per-token advantages [N, T] from the critic's values.

    The outcome reward on each completion's last token, GAE with `inputs.gamma` and
    `inputs.lam` over the completion's tokens, then (with `inputs.whiten`) whitened over the
    tokens the loss counts (a completion without a reward is not among them). In the values'
    dtype, on their device.
    """
    if inputs.values is None:
        raise ValueError("the gae estimator needs the critic's values (AdvantageInputs.values)")
    values = inputs.values
    mask = inputs.completion_mask.to(values.device)
    advantages, _ = gae_advantages(
        outcome_token_rewards(inputs.rewards.to(values.device), mask),
        values,
        mask,
        inputs.gamma,
        inputs.lam,
    )
    if inputs.whiten:
        advantages = masked_whiten(advantages, inputs.loss_mask.to(values.device))
    return advantages


def gae_returns(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """The critic's regression targets [N, T]: GAE's returns (A_t + V_t, before whitening) of the
    outcome rewards [N] on the completions' tokens `mask` [N, T], from the `values` [N, T]."""
    return gae_advantages(outcome_token_rewards(rewards, mask), values, mask, gamma, lam)[1]


def _last_token(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each row's last masked token [N], whether the row has one [N])."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
    return last.clamp(min=0), last >= 0


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards as per-token rewards: r_i on completion i's last masked token, 0 elsewhere.

    rewards: [N] (NaN or inf = missing), mask: [N, T] -> [N, T] in the rewards' dtype.
    A missing reward gives 0 everywhere in its row; the trainer also masks such
    rows out of the loss (their advantage would otherwise be the critic's own
    error). A row with no masked token gets no reward.

    Example: rewards [1, 2, nan], mask [[1, 1, 1], [1, 1, 0], [1, 0, 0]] ->
    [[0, 0, 1], [0, 2, 0], [0, 0, 0]].
    """
    if rewards.dim() != 1 or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"rewards must be [N] and mask [N, T], got {tuple(rewards.shape)} and {tuple(mask.shape)}"
        )
    last, has_token = _last_token(mask)
    reward = torch.where(torch.isfinite(rewards) & has_token, rewards, torch.zeros_like(rewards))
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return out.scatter(1, last.unsqueeze(1), reward.unsqueeze(1))


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), per token.

    delta_t = r_t + gamma * V_{t+1} - V_t,   V after the last masked token = 0 (the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}, A after the last masked token = 0
    returns_t = A_t + V_t  (the critic's regression target)

    token_rewards, values, mask: [N, T], right-padded; values and rewards at
    padded positions are ignored (whatever they hold). Returns (advantages,
    returns), both [N, T], 0 where mask is 0, detached, computed in float64 and
    given back in the values' dtype.

    Example (gamma=1, lam=0.95), r = [0, 0, 1], V = [0.5, 0.6, 0.8]:
      delta = [0.6 - 0.5, 0.8 - 0.6, 1 - 0.8] = [0.1, 0.2, 0.2]
      A_2 = 0.2;  A_1 = 0.2 + 0.95 * 0.2 = 0.39;  A_0 = 0.1 + 0.95 * 0.39 = 0.4705
      returns = [0.9705, 0.99, 1.0]
    Example (gamma=0.9, lam=0.95, gamma*lam = 0.855), a padded row, mask [1, 1, 0],
    r = [0, 2, 0], V = [1.0, 0.5, 9.9 (padding)]:
      delta_1 = 2 + 0.9 * 0 - 0.5 = 1.5;  delta_0 = 0 + 0.9 * 0.5 - 1.0 = -0.55
      A = [-0.55 + 0.855 * 1.5, 1.5, 0] = [0.7325, 1.5, 0];  returns = [1.7325, 2.0, 0]
    """
    if not (token_rewards.shape == values.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            f"token_rewards, values and mask must all be [N, T], got {tuple(token_rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    m = mask.detach().double()
    # padding zeroed first, so that V_{t+1} past a row's end is 0 and padding's garbage cannot leak in
    r = token_rewards.detach().double() * m
    v = values.detach().double() * m
    advantages = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    next_advantage = torch.zeros_like(v[:, 0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * m[:, t]
        next_value, next_advantage = v[:, t], advantages[:, t]
    returns = (advantages + v) * m
    return advantages.to(values.dtype), returns.to(values.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, population: torch.Tensor | None = None
) -> torch.Tensor:
    """PPO's advantage normalisation: (x - mean) / (std + eps) over the entries where mask is 1
    (or, when given, with the mean and std of `population`, a 1-D tensor: e.g. the masked entries
    of every rank of a data-parallel run).

    The std is Bessel-corrected (divide by n - 1), as TRL's and verl's
    masked_whiten; with a single masked entry it is 0 (and x - mean is 0).
    Returns [N, T], 0 where mask is 0, in x's dtype (computed in float64).

    Example: x = [[1, 2, 3], [4, x, x]], mask [[1, 1, 1], [1, 0, 0]]:
    mean 2.5, var = (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3, std 1.29099 ->
    [[-1.1619, -0.3873, 0.3873], [1.1619, 0, 0]].
    """
    m = mask.double()
    xd = x.double()
    if population is None:
        population = xd[mask.bool()]
    p = population.double()
    n = torch.tensor(float(p.numel()), dtype=torch.float64, device=p.device)
    mean = p.sum() / n.clamp(min=1.0)
    var = ((p - mean) ** 2).sum() / (n - 1).clamp(min=1.0)
    return ((xd - mean) / (var.sqrt() + eps) * m).to(x.dtype)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> torch.Tensor:
    """PPO's clipped value loss, per token (to minimise; aggregate it like the policy loss).

    l_t = 0.5 * max((V - R)^2, (V_old + clamp(V - V_old, -c, c) - R)^2)
    clip None: l_t = 0.5 * (V - R)^2. Zero where mask is 0.

    values: [N, T] the critic now (requires grad); old_values: [N, T] the critic
    when the batch was scored; returns: [N, T] GAE's targets.

    Example: V = 1.5, V_old = 1.0, c = 0.2: R = 2.0 -> unclipped 0.25, clipped
    (1.2 - 2)^2 = 0.64 -> 0.32 (and no gradient: the clipped term is flat in V);
    R = 1.0 -> 0.25 vs (1.2 - 1)^2 = 0.04 -> 0.125; clip None, R = 2.0 -> 0.125.
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip must be > 0 or None, got {clip}")
    m = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped * m
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.max(unclipped, (clipped_values - returns) ** 2) * m


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over masked tokens, a detached float64 scalar (the critic's fit).

    1 is a perfect critic, 0 one no better than a constant, negative a harmful
    one; NaN when the returns do not vary (nothing to explain).

    Example: R = [1, 2, 3], V = [1, 2, 2] -> Var(R - V) = Var([0, 0, 1]) = 1/3,
    Var(R) = 1 (both Bessel) -> 2/3.
    """
    m = mask.detach().double()
    r = returns.detach().double()
    residual = r - values.detach().double()
    n = m.sum()

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n.clamp(min=1.0)
        return (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1.0)

    var_r = var(r)
    # torch.where rather than a Python test: no device synchronisation for a metric
    return torch.where(
        var_r > 0,
        1.0 - var(residual) / var_r.clamp(min=1e-300),
        torch.full_like(var_r, float("nan")),
    )
