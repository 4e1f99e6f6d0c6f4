"""Hand-computed tests for PPO's critic math, grpo.algorithm.values: outcome token rewards,
GAE (and the `gae` estimator, which only points there), whitening, the clipped value loss and
explained variance.

Every expected number is derived by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo.algorithm import (
    AdvantageInputs,
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    gae_returns,
    masked_whiten,
    outcome_token_rewards,
)
from grpo.registry import ADVANTAGE_ESTIMATORS

NAN = float("nan")
D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def test_the_gae_estimator_is_gae_of_the_outcome_rewards_whitened_over_the_loss_tokens():
    gae = ADVANTAGE_ESTIMATORS.get("gae")
    assert gae.needs_values  # registered so: the run trains a critic for it
    rewards, values = t([1.0, 2.0]), t([[0.5, 0.6, 0.8], [1.0, 0.5, 9.9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    counted = torch.tensor([[1, 1, 1], [0, 0, 0]])  # the second completion's tokens not counted
    inputs = AdvantageInputs(
        rewards, 2, values=values, completion_mask=mask, loss_mask=counted, gamma=1.0, lam=0.95
    )
    raw, returns = gae_advantages(outcome_token_rewards(rewards, mask), values, mask, 1.0, 0.95)
    assert_close(gae(inputs), masked_whiten(raw, counted))
    unwhitened = AdvantageInputs(
        rewards, 2, values=values, completion_mask=mask, loss_mask=counted, whiten=False
    )
    assert_close(gae(unwhitened), raw)  # the first row: the worked example of gae_advantages
    assert_close(raw[0], t([0.4705, 0.39, 0.2]))
    assert_close(gae_returns(rewards, values, mask, 1.0, 0.95), returns)
    with pytest.raises(ValueError, match="the critic's values"):
        gae(AdvantageInputs(rewards, 2))


# --------------------------------------------------------------------------
# outcome_token_rewards
# --------------------------------------------------------------------------


def test_outcome_token_rewards_on_the_last_masked_token():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = outcome_token_rewards(t([1.0, 2.0, NAN, 5.0]), mask)
    # rewards on tokens 2, 1; the missing reward and the empty row give nothing
    assert_close(out, t([[0, 0, 1], [0, 2, 0], [0, 0, 0], [0, 0, 0]]))


# --------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------


def test_gae_gamma_1_three_tokens():
    # delta = [0.6 - 0.5, 0.8 - 0.6, 1 - 0.8] = [0.1, 0.2, 0.2]
    # A_2 = 0.2; A_1 = 0.2 + 0.95 * 0.2 = 0.39; A_0 = 0.1 + 0.95 * 0.39 = 0.4705
    r = t([[0.0, 0.0, 1.0]])
    v = t([[0.5, 0.6, 0.8]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=0.95)
    assert_close(adv, t([[0.4705, 0.39, 0.2]]))
    assert_close(ret, t([[0.9705, 0.99, 1.0]]))


def test_gae_gamma_09_with_a_padded_row():
    # gamma 0.9, lam 0.95, gamma * lam = 0.855
    # row 0: delta_2 = 1 - 0.8 = 0.2; delta_1 = 0.9 * 0.8 - 0.6 = 0.12; delta_0 = 0.9 * 0.6 - 0.5 = 0.04
    #        A_2 = 0.2; A_1 = 0.12 + 0.855 * 0.2 = 0.291; A_0 = 0.04 + 0.855 * 0.291 = 0.288805
    # row 1 (mask 1 1 0, padding value 9.9 and reward 7 ignored):
    #        delta_1 = 2 + 0.9 * 0 - 0.5 = 1.5; delta_0 = 0.9 * 0.5 - 1.0 = -0.55
    #        A_1 = 1.5; A_0 = -0.55 + 0.855 * 1.5 = 0.7325
    r = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    v = t([[0.5, 0.6, 0.8], [1.0, 0.5, 9.9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.95)
    assert_close(adv, t([[0.288805, 0.291, 0.2], [0.7325, 1.5, 0.0]]))
    assert_close(ret, t([[0.788805, 0.891, 1.0], [1.7325, 2.0, 0.0]]))


def test_gae_lambda_1_is_the_discounted_return_minus_the_value():
    # lam = 1: A_t = sum_k gamma^k r_{t+k} - V_t (Monte Carlo); an outcome reward 1 at the end of 4 tokens
    v = torch.rand(1, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    r = t([[0.0, 0.0, 0.0, 1.0]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 4), gamma=0.5, lam=1.0)
    assert_close(ret, t([[0.125, 0.25, 0.5, 1.0]]))
    assert_close(adv, ret - v)


def test_gae_lambda_0_is_the_one_step_td_error():
    r = t([[0.0, 1.0]])
    v = t([[0.3, 0.4]])
    adv, _ = gae_advantages(r, v, torch.ones(1, 2), gamma=0.9, lam=0.0)
    assert_close(adv, t([[0.9 * 0.4 - 0.3, 1.0 - 0.4]]))  # [0.06, 0.6]


def test_gae_is_detached_and_keeps_the_values_dtype():
    v = torch.tensor([[0.5, 0.6]], requires_grad=True)
    adv, ret = gae_advantages(torch.tensor([[0.0, 1.0]]), v, torch.ones(1, 2), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == torch.float32


def test_gae_bad_arguments():
    with pytest.raises(ValueError, match="gamma and lam"):
        gae_advantages(t([[1.0]]), t([[0.0]]), torch.ones(1, 1), gamma=1.5, lam=0.9)
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        gae_advantages(t([1.0]), t([0.0]), torch.ones(1), gamma=1.0, lam=0.9)


# --------------------------------------------------------------------------
# whitening, value loss, explained variance
# --------------------------------------------------------------------------


def test_masked_whiten_bessel():
    # values 1, 2, 3, 4: mean 2.5, squares 2.25 + 0.25 + 0.25 + 2.25 = 5, var 5/3 (n - 1 = 3)
    x = t([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    std = math.sqrt(5 / 3) + 1e-8  # 1.29099
    out = masked_whiten(x, mask)
    assert_close(out, t([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]]))
    assert round(out[0, 0].item(), 4) == -1.1619  # 1.5 / 1.29099 = 1.161895
    kept = out[mask.bool()]
    assert abs(kept.mean().item()) < 1e-12 and kept.std().item() == pytest.approx(1.0, rel=1e-6)


def test_clipped_value_loss():
    v = t([[1.5, 1.5, 1.5]]).requires_grad_(True)
    old = t([[1.0, 1.0, 1.0]])
    ret = t([[2.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss = clipped_value_loss(v, old, ret, mask, clip=0.2)
    # R=2: max(0.25, (1.2 - 2)^2 = 0.64) / 2 = 0.32; R=1: max(0.25, 0.04) / 2 = 0.125; padding 0
    assert_close(loss, t([[0.32, 0.125, 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), v)
    # the clipped term is flat in V (no gradient); the unclipped one: V - R = 0.5
    assert_close(grad, t([[0.0, 0.5, 0.0]]))
    unclipped = clipped_value_loss(v, old, ret, mask, clip=None)
    assert_close(unclipped, t([[0.125, 0.125, 0.0]]))  # (1.5 - 2)^2 / 2, (1.5 - 1)^2 / 2
    with pytest.raises(ValueError, match="value clip"):
        clipped_value_loss(v, old, ret, mask, clip=0.0)


def test_explained_variance():
    # R = [1, 2, 3], V = [1, 2, 2]: Var(R - V) = Var([0, 0, 1]) = 1/3, Var(R) = 1 -> 2/3
    mask = torch.tensor([[1, 1, 1, 0]])
    ev = explained_variance(t([[1.0, 2.0, 2.0, 50.0]]), t([[1.0, 2.0, 3.0, -9.0]]), mask)
    assert ev.item() == pytest.approx(2 / 3)
    assert math.isnan(explained_variance(t([[1.0, 2.0]]), t([[3.0, 3.0]]), torch.ones(1, 2)).item())
