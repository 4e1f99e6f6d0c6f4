"""Hand-computed tests for the loss options taken over from TRL 1.16: the luspo aggregation, the
vespo policy loss (its gamma weights), the off-policy sequence mask, the bias-corrected KL, the
entropy bonus and its adaptive coefficient, and GDPO's normalize-then-sum advantages.

Every expected number is derived by hand in the comment next to it (tests/test_trl_equivalence.py
compares the same functions with TRL's own code). Tensors are float64 where a check is to float
precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo.algorithm import (
    LossNormalisers,
    LossSettings,
    PolicyLossParams,
    RolloutCorrection,
    aggregate_loss,
    applied_entropy_coef,
    entropy_bonus,
    gamma_weights,
    next_entropy_coef,
    normalize_then_sum_advantages,
    off_policy_mask,
    policy_loss,
    vespo_policy_loss,
)
from grpo.registry import LOSS_AGGREGATIONS, POLICY_LOSSES

D = torch.float64
LN = math.log


# --------------------------------------------------------------------------
# luspo
# --------------------------------------------------------------------------


def test_luspo_is_a_per_sequence_sum_over_the_sequences():
    L = torch.tensor([[1.0, 3.0], [2.0, 99.0]], dtype=D)
    M = torch.tensor([[1, 1], [1, 0]])
    # (1 + 3) + 2 = 6 over 2 sequences
    assert aggregate_loss(L, M, "luspo").item() == 3.0
    # a sequence-level loss [N, 1] counts once per token: 2 * 1.5 + 1 * (-1) = 2, over 2
    assert aggregate_loss(torch.tensor([[1.5], [-1.0]], dtype=D), M, "luspo").item() == 1.0
    assert "luspo" in LOSS_AGGREGATIONS


def test_luspo_does_not_depend_on_the_split():
    gen = torch.Generator().manual_seed(0)
    L = torch.randn(6, 5, generator=gen, dtype=D)
    M = (torch.rand(6, 5, generator=gen) > 0.3).long()
    whole = aggregate_loss(L, M, "luspo")
    norms = LossNormalisers(num_sequences=6, num_minibatches=3)
    pieces = sum(
        aggregate_loss(L[rows], M[rows], "luspo", norms)
        for rows in (slice(0, 1), slice(1, 4), slice(4, 6))
    )
    assert_close(pieces, whole)


# --------------------------------------------------------------------------
# vespo: gamma weights and the policy loss
# --------------------------------------------------------------------------


def test_gamma_weights_worked_example():
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=D)
    log_ratio = torch.tensor([[0.1, -0.1], [0.1, 0.1], [-0.1, -0.1]], dtype=D)
    phi = gamma_weights(adv, log_ratio, torch.ones(3, 2))
    # w = 1: phi = e^3 * 1 * e^-3 = 1
    # w = e^0.2, k 2, lambda 3: exp(3 + 2 * 0.2 - 3 e^0.2) = exp(3.4 - 3.66421) = 0.76781
    # w = e^-0.2, k 3, lambda 2: exp(2 - 3 * 0.2 - 2 e^-0.2) = exp(1.4 - 1.63746) = 0.78863
    expected = [1.0, math.exp(3.4 - 3 * math.exp(0.2)), math.exp(1.4 - 2 * math.exp(-0.2))]
    assert phi.shape == (3, 1)
    assert_close(phi.squeeze(1), torch.tensor(expected, dtype=D))
    assert phi[1].item() == pytest.approx(0.76781, abs=1e-5)
    assert phi[2].item() == pytest.approx(0.78863, abs=1e-5)


def test_gamma_weights_sum_the_counted_tokens_and_fold_in_the_correction():
    adv = torch.tensor([1.0], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    # the padding's log-ratio (5.0) is not counted: log w = 0.1 + 0.1 = 0.2
    phi = gamma_weights(adv, torch.tensor([[0.1, 0.1, 5.0]], dtype=D), mask)
    assert phi.item() == pytest.approx(math.exp(3.4 - 3 * math.exp(0.2)), rel=1e-12)
    # correction weights [e^-0.2, 1, 1]: log w = 0.2 - 0.2 = 0 -> phi = 1
    weights = torch.tensor([[math.exp(-0.2), 1.0, 1.0]], dtype=D)
    folded = gamma_weights(adv, torch.tensor([[0.1, 0.1, 5.0]], dtype=D), mask, weights)
    assert folded.item() == pytest.approx(1.0, rel=1e-12)
    # a weight masked to 0 counts as 1e-8: log w = 0.2 + ln 1e-8 -> w ~ 1.2e-8, phi = e^3 w^2 e^-3w
    masked = gamma_weights(
        adv, torch.tensor([[0.1, 0.1, 0.0]], dtype=D), mask, torch.tensor([[0.0, 1.0, 1.0]])
    )
    w = math.exp(0.2 + LN(1e-8))
    assert masked.item() == pytest.approx(math.exp(3 + 2 * LN(w) - 3 * w), rel=1e-9)


def test_gamma_weights_clamp_and_never_return_nan():
    adv = torch.tensor([1.0, -1.0], dtype=D)
    # log w clamped at 20: phi = exp(3 + 40 - 3 e^20) underflows to 0; at log 1e-8 it is tiny
    phi = gamma_weights(adv, torch.tensor([[30.0], [-30.0]], dtype=D), torch.ones(2, 1))
    assert phi[0].item() == 0.0
    assert phi[1].item() == pytest.approx(math.exp(2 + 3 * LN(1e-8) - 2e-8), rel=1e-9)
    nan = gamma_weights(adv[:1], torch.tensor([[float("nan")]], dtype=D), torch.ones(1, 1))
    assert nan.item() == 0.0


def test_vespo_loss_and_gradient():
    logp = torch.full((2, 2), LN(0.5), dtype=D, requires_grad=True)
    old = logp.detach().clone()
    old[1] += 0.1  # row 1: logp - old = -0.1 per token, w = e^-0.2
    adv = torch.tensor([1.0, -1.0], dtype=D)
    per_token, stats = vespo_policy_loss(logp, old, adv, torch.ones(2, 2), PolicyLossParams())
    phi1 = math.exp(1.4 - 2 * math.exp(-0.2))  # 0.78863
    # row 0: phi 1, l = -log 0.5; row 1: l = -phi * (-1) * log 0.5
    assert_close(per_token[0], torch.full((2,), -LN(0.5), dtype=D))
    assert_close(per_token[1], torch.full((2,), phi1 * LN(0.5), dtype=D))
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    # phi is detached: dl/dlogp = -phi A
    assert_close(grad, torch.tensor([[-1.0, -1.0], [phi1, phi1]], dtype=D))
    assert stats["phi_seq_sum"].item() == pytest.approx(1.0 + phi1)
    assert POLICY_LOSSES.get("vespo") is vespo_policy_loss


def test_policy_loss_folds_the_correction_into_vespo_instead_of_multiplying():
    logp = torch.full((1, 2), LN(0.5), dtype=D, requires_grad=True)
    old = logp.detach()
    sampling = old - LN(2.0)  # token ratios pi_old / pi_sampler = 2, truncated at cap 3: 2
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0], dtype=D)
    settings = LossSettings(
        objective="vespo",
        loss_type="dapo",
        correction=RolloutCorrection(level="token", mode="truncate", cap=3.0),
    )
    loss, stats = policy_loss(logp, None, adv, mask, settings, sampling_logp=sampling)
    # w = 1 * 2 * 2 = 4: phi = exp(3 + 2 ln 4 - 12) = 16 e^-9; the loss is not also multiplied by 2
    phi = math.exp(3 + 2 * LN(4.0) - 12.0)
    assert loss.item() == pytest.approx(-phi * LN(0.5), rel=1e-12)
    assert stats["phi_seq_sum"].item() == pytest.approx(phi, rel=1e-12)


# --------------------------------------------------------------------------
# the off-policy sequence mask
# --------------------------------------------------------------------------


def test_off_policy_mask_worked_example():
    drift = torch.tensor([[0.2, 0.4], [1.0, 0.6], [1.0, 0.6]], dtype=D)
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=D)
    keep = off_policy_mask(adv, torch.zeros(3, 2, dtype=D), drift, torch.ones(3, 2), 0.5)
    # mean drift [0.3, 0.8, 0.8]: row 1 has A < 0 and 0.8 > 0.5 -> dropped; row 2 has A >= 0
    assert keep.tolist() == [[1.0], [0.0], [1.0]]


def test_off_policy_mask_ignores_padding_and_nan():
    adv = torch.tensor([-1.0, -1.0], dtype=D)
    sampling = torch.tensor([[0.2, 9.0], [float("nan"), 0.4]], dtype=D)
    mask = torch.tensor([[1, 0], [1, 1]])
    keep = off_policy_mask(adv, torch.zeros(2, 2, dtype=D), sampling, mask, 0.3)
    # row 0: only 0.2 counts -> kept; row 1: NaN counts 0 -> (0 + 0.4) / 2 = 0.2 -> kept
    assert keep.tolist() == [[1.0], [1.0]]
    # without the NaN rule the row would be NaN and dropped; at threshold 0.1 it is dropped on 0.2
    assert off_policy_mask(adv, torch.zeros(2, 2, dtype=D), sampling, mask, 0.1).tolist() == [
        [0.0],
        [0.0],
    ]


def test_policy_loss_applies_the_off_policy_mask_to_the_policy_term_only():
    logp = torch.full((2, 2), LN(0.5), dtype=D, requires_grad=True)
    ref = logp.detach() - 0.5
    sampling = logp.detach() + torch.tensor([[1.0], [0.1]], dtype=D)  # drift 1.0 and 0.1
    adv = torch.tensor([-1.0, -1.0], dtype=D)
    mask = torch.ones(2, 2)
    settings = LossSettings(loss_type="dapo", beta=0.1, off_policy_mask_threshold=0.5)
    loss, stats = policy_loss(logp, None, adv, mask, settings, ref_logp=ref, sampling_logp=sampling)
    (grad,) = torch.autograd.grad(loss, logp)
    # on policy (ratio 1): the policy term of a kept token is A = -1 -> l = +1, dl/dlogp = -A / 4;
    # k3 with x = -0.5: e^-0.5 + 0.5 - 1 = 0.10653, d/dlogp = 1 - e^-0.5 = 0.39347
    k3, dk3 = math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)
    # row 0 dropped (A < 0, drift 1.0 > 0.5): its policy term is 0, its KL stays
    assert loss.item() == pytest.approx((2 * 1.0 + 4 * 0.1 * k3) / 4)
    assert_close(grad[0], torch.full((2,), 0.1 * dk3 / 4, dtype=D))
    assert_close(grad[1], torch.full((2,), (1.0 + 0.1 * dk3) / 4, dtype=D))
    assert stats["off_policy_masked"].item() == 1.0


# --------------------------------------------------------------------------
# the bias-corrected KL
# --------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_is_weighted_by_the_undetached_ratio(level):
    logp = torch.tensor([[LN(0.5), LN(0.5)]], dtype=D, requires_grad=True)
    old = torch.tensor([[LN(0.25), LN(0.5)]], dtype=D)  # token ratios [2, 1]; sequence e^(ln2 / 2)
    ref = torch.tensor([[LN(0.25), LN(0.25)]], dtype=D)
    mask = torch.ones(1, 2)
    adv = torch.tensor([0.0], dtype=D)  # no policy term: the loss is the KL alone
    settings = LossSettings(
        loss_type="dapo",
        beta=1.0,
        kl_bias_correction=True,
        params=PolicyLossParams(importance_sampling_level=level),
    )
    loss, stats = policy_loss(logp, old, adv, mask, settings, ref_logp=ref)
    (grad,) = torch.autograd.grad(loss, logp)
    k3 = 0.5 + LN(2) - 1  # x = -ln 2: e^x - x - 1 = 0.19315 per token; dk3/dlogp = 1 - e^x = 0.5
    if level == "token":
        rho = [2.0, 1.0]
        # d(rho k3)/dlogp = rho k3 + rho * 0.5 (the ratio carries gradient), over 2 tokens
        expected_grad = [(r * k3 + r * 0.5) / 2 for r in rho]
    else:
        r = math.exp(LN(2) / 2)
        rho = [r, r]
        # rho = exp(mean log-ratio): d rho / d logp_t = rho / 2, shared by both tokens' KL
        expected_grad = [(r * k3 * 2 / 2 + r * 0.5) / 2] * 2
    assert loss.item() == pytest.approx(sum(r * k3 for r in rho) / 2)
    assert stats["kl"].item() == pytest.approx(sum(r * k3 for r in rho))
    assert_close(grad[0], torch.tensor(expected_grad, dtype=D))


def test_bias_corrected_kl_changes_the_gradient_on_policy():
    logp = torch.tensor([[LN(0.5)]], dtype=D, requires_grad=True)
    ref = torch.tensor([[LN(0.25)]], dtype=D)
    adv = torch.tensor([0.0], dtype=D)
    grads = []
    for corrected in (False, True):
        settings = LossSettings(beta=1.0, kl_bias_correction=corrected)
        loss, _ = policy_loss(logp, None, adv, torch.ones(1, 1), settings, ref_logp=ref)
        grads.append(torch.autograd.grad(loss, logp)[0].item())
        assert loss.item() == pytest.approx(0.5 + LN(2) - 1)  # ratio 1: the same value
    # plain: 1 - e^x = 0.5; corrected: + k3 = 0.19315 (d rho / d logp = 1 at ratio 1)
    assert grads == [pytest.approx(0.5), pytest.approx(0.5 + 0.5 + LN(2) - 1)]


# --------------------------------------------------------------------------
# the entropy bonus and its adaptive coefficient
# --------------------------------------------------------------------------


def test_entropy_bonus_worked_example():
    H = torch.tensor([[1.0, 2.0], [3.0, 99.0]], dtype=D)
    M = torch.tensor([[1, 1], [1, 0]])
    keep = torch.tensor([[False, True], [True, False]])
    assert entropy_bonus(H, M, 3).item() == 2.0  # (1 + 2 + 3) / 3
    assert entropy_bonus(H, M, 3, keep=keep).item() == 2.5  # (2 + 3) / 2
    assert entropy_bonus(H, M, 3, num_minibatches=2).item() == 1.0
    assert entropy_bonus(H, M, 3, 2, keep).item() == 1.25
    # a piece without tokens adds nothing
    assert entropy_bonus(H, torch.zeros(2, 2), 3).item() == 0.0


def test_entropy_bonus_pieces_sum_to_the_minibatch_mean():
    gen = torch.Generator().manual_seed(3)
    H = torch.rand(6, 4, generator=gen, dtype=D)
    M = (torch.rand(6, 4, generator=gen) > 0.3).long()
    tokens = M.sum().item()
    pieces = sum(entropy_bonus(H[r], M[r], tokens) for r in (slice(0, 2), slice(2, 6)))
    assert_close(pieces, (H * M).sum() / tokens)


def test_policy_loss_subtracts_the_entropy_bonus_with_its_gradient():
    logp = torch.full((1, 2), LN(0.5), dtype=D, requires_grad=True)
    H = torch.tensor([[0.5, 1.5]], dtype=D, requires_grad=True)
    adv = torch.tensor([1.0], dtype=D)
    loss, stats = policy_loss(
        logp, None, adv, torch.ones(1, 2), LossSettings(), entropy=H, entropy_coef=0.1
    )
    # policy: -A per token, dapo mean -1; bonus: mean H = 1 -> loss = -1 - 0.1 * 1
    assert loss.item() == pytest.approx(-1.1)
    assert stats["policy_loss"].item() == pytest.approx(-1.0)
    (grad,) = torch.autograd.grad(loss, H)
    assert_close(grad, torch.full((1, 2), -0.1 / 2, dtype=D))
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(logp, None, adv, torch.ones(1, 2), LossSettings(), entropy_coef=0.1)


def test_next_entropy_coef_worked_example():
    step = dict(target=0.2, delta=0.005, coef_min=0.0, coef_max=1.0)
    assert next_entropy_coef(0.01, 0.15, **step) == pytest.approx(0.015)  # below target: up
    assert next_entropy_coef(0.01, 0.2, **step) == pytest.approx(0.015)  # at the target: up
    assert next_entropy_coef(0.01, 0.3, **step) == pytest.approx(0.005)  # above: down
    assert next_entropy_coef(0.003, 0.3, **step) == 0.0  # floored at coef_min
    assert next_entropy_coef(0.998, 0.1, **step) == 1.0  # capped at coef_max
    assert next_entropy_coef(0.01, float("nan"), **step) == pytest.approx(0.005)


def test_applied_entropy_coef_gates_on_the_last_entropy():
    assert applied_entropy_coef(0.05, 0.15, 0.2) == 0.05
    assert applied_entropy_coef(0.05, 0.2, 0.2) == 0.05
    assert applied_entropy_coef(0.05, 0.3, 0.2) == 0.0
    assert applied_entropy_coef(0.05, float("inf"), 0.2) == 0.0  # before any measurement


# --------------------------------------------------------------------------
# GDPO: normalize then sum
# --------------------------------------------------------------------------


def test_normalize_then_sum_worked_example():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 10.0], [0.0, 0.0]], dtype=D)
    adv = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 1.0]), 2)
    # function 0: +-0.5 / (sqrt(0.5) + 1e-4); function 1: 0, then +-5 / (sqrt(50) + 1e-4)
    z0, z1 = 0.5 / (math.sqrt(0.5) + 1e-4), 5 / (math.sqrt(50) + 1e-4)
    s = torch.tensor([z0, -z0, z0 + z1, -z0 - z1], dtype=D)
    # batch: mean 0, Bessel std over the 4 sums
    assert_close(adv, s / (s.std() + 1e-4))
    assert adv.tolist() == pytest.approx([0.54765, -0.54765, 1.09537, -1.09537], abs=1e-5)


def test_normalize_then_sum_weighs_each_function_by_its_weight_not_its_spread():
    # function 1 has 100x the spread of function 0. Group 0: one row is best on function 0, the
    # other on function 1; group 1: one row is best on both
    rewards = torch.tensor([[1.0, 0.0], [0.0, 100.0], [1.0, 100.0], [0.0, 0.0]], dtype=D)
    adv = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 1.0]), 2)
    # group 0's rows tie (z = +-0.5 / (0.70711 + 1e-4) against -+50 / (70.711 + 1e-4): sums of
    # +-7e-5, from eps alone), while the weighted sum of raw rewards would put row 1 far above row 0
    assert abs(adv[0].item()) < 1e-3 and abs(adv[1].item()) < 1e-3
    # group 1: +-(0.70701 + 0.70711), over the batch std 1.1546
    assert adv[2].item() == pytest.approx(1.2247, abs=1e-3) and adv[3] == -adv[2]
    # a weight tips the tie
    adv = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 2.0]), 2)
    assert adv[1] > 0 > adv[0]


def test_normalize_then_sum_missing_rewards():
    nan = float("nan")
    rewards = torch.tensor(
        [[1.0, nan], [0.0, 2.0], [nan, nan], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=D
    )
    adv = normalize_then_sum_advantages(rewards, torch.tensor([1.0, 1.0]), 3)
    # group 0: function 0 over [1, 0] (mean 0.5, std sqrt(0.5)); function 1 has one value: 0;
    # row 2 has no reward at all: advantage 0, left out of the batch statistics
    z = 0.5 / (math.sqrt(0.5) + 1e-4)
    # group 1: function 0 [1, 0, 1] mean 2/3, std sqrt(1/3); function 1 [0, 0, 1] mean 1/3
    sd = math.sqrt(1 / 3) + 1e-4
    g1 = [(1 / 3) / sd + (-1 / 3) / sd, (-2 / 3) / sd + (-1 / 3) / sd, (1 / 3) / sd + (2 / 3) / sd]
    s = torch.tensor([z, -z, *g1], dtype=D)
    expected = (s - s.mean()) / (s.std() + 1e-4)
    assert adv[2].item() == 0.0
    assert_close(adv[[0, 1, 3, 4, 5]], expected)
    assert torch.isfinite(adv).all()


def test_normalize_then_sum_checks_shapes():
    with pytest.raises(ValueError, match="group_size"):
        normalize_then_sum_advantages(torch.zeros(3, 2), torch.ones(2), 2)
    with pytest.raises(ValueError, match="one entry per reward function"):
        normalize_then_sum_advantages(torch.zeros(4, 2), torch.ones(3), 2)
