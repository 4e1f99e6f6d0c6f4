"""Hand-computed tests for grpo.algorithm (the formulas in its modules' docstrings).

Every expected number below is derived by hand; the arithmetic is written in
the comment next to it. Tensors are float64 where a check is to float precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from grpo.algorithm import (
    ADVANTAGE_EPS,
    LossNormalisers,
    LossSettings,
    PolicyLossParams,
    aggregate_loss,
    clipped_surrogate,
    combine_rewards,
    entropy_from_logits,
    group_advantages,
    group_reward_std,
    kl_estimate,
    log_importance_weights,
    lr_multiplier,
    masked_mean,
    overlong_penalty,
    policy_loss,
)

NAN = float("nan")
D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


# --------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------

SEED_REWARDS = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
SEED_TABLE = [
    [0.87, 0.87, -0.87, -0.87],
    [0.50, 0.50, 0.50, -1.50],
    [1.50, -0.50, -0.50, -0.50],
    [0.00, 0.00, 0.00, 0.00],
]


def test_advantage_eps_is_the_seeds():
    assert ADVANTAGE_EPS == 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_seed_table_rounded_to_two_decimals(dtype):
    adv = group_advantages(t(SEED_REWARDS, dtype).reshape(-1), group_size=4, scale_rewards="group")
    assert adv.shape == (16,)
    assert adv.dtype == dtype
    assert_close(torch.round(adv.view(4, 4), decimals=2), t(SEED_TABLE, dtype), rtol=0, atol=1e-6)


def test_seed_table_formula_to_float_precision():
    # A = (r - mean) / (std_bessel + 1e-4), std with n - 1 = 3 in the denominator.
    # [1,1,0,0]: mean 1/2; squares 4 * 1/4 = 1; std = sqrt(1/3) = 0.57735
    s1 = math.sqrt(1 / 3) + 1e-4
    # [1,1,1,0]: mean 3/4; squares 3 * (1/4)^2 + (3/4)^2 = 3/16 + 9/16 = 3/4; std = sqrt(1/4) = 1/2
    s2 = 0.5 + 1e-4
    # [1,0,0,0]: mean 1/4; squares (3/4)^2 + 3 * (1/4)^2 = 3/4; std = 1/2
    s3 = 0.5 + 1e-4
    # [1,1,1,1]: mean 1, every r - mean = 0 -> 0 / (0 + 1e-4) = 0
    expected = t(
        [
            [0.5 / s1, 0.5 / s1, -0.5 / s1, -0.5 / s1],  # +-0.86588
            [0.25 / s2, 0.25 / s2, 0.25 / s2, -0.75 / s2],  # 0.49990, -1.49970
            [0.75 / s3, -0.25 / s3, -0.25 / s3, -0.25 / s3],  # 1.49970, -0.49990
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    adv = group_advantages(t(SEED_REWARDS).reshape(-1), group_size=4, scale_rewards="group")
    assert_close(adv.view(4, 4), expected, rtol=1e-12, atol=1e-12)
    # the eps really is added: without it [1,1,0,0] would give 0.5 / 0.57735 = 0.866025..., not 0.865876...
    assert abs(adv[0].item() - 0.5 / math.sqrt(1 / 3)) > 1e-5


def test_group_std_is_bessel_corrected():
    # [0, 2]: mean 1, squares 1 + 1 = 2; Bessel std = sqrt(2 / 1) = 1.41421
    # (the population std would be sqrt(2 / 2) = 1, giving +-0.9999 instead)
    adv = group_advantages(t([0.0, 2.0]), group_size=2)
    s = math.sqrt(2.0) + 1e-4
    assert_close(adv, t([-1 / s, 1 / s]), rtol=1e-12, atol=1e-12)  # +-0.70706
    assert_close(group_reward_std(t([0.0, 2.0, 5.0, 5.0]), 2), t([math.sqrt(2.0), 0.0]))


def test_scale_batch_uses_group_mean_and_batch_std():
    # groups [0, 2] and [4, 6]: group means 1 and 5 -> centred [-1, 1, -1, 1]
    # batch: mean 3, deviations -3 -1 1 3, squares 9 + 1 + 1 + 9 = 20, Bessel /3 -> std sqrt(20/3) = 2.58199
    adv = group_advantages(t([0.0, 2.0, 4.0, 6.0]), group_size=2, scale_rewards="batch")
    s = math.sqrt(20 / 3) + 1e-4
    assert_close(adv, t([-1 / s, 1 / s, -1 / s, 1 / s]), rtol=1e-12, atol=1e-12)  # +-0.38729
    # versus "group": each group std sqrt(2) -> +-0.70706, so the two really differ
    grp = group_advantages(t([0.0, 2.0, 4.0, 6.0]), group_size=2, scale_rewards="group")
    assert abs(grp[1].item() - adv[1].item()) > 0.3


def test_scale_none_is_centering_only():
    # [1,1,0,0]: mean 1/2 -> [.5, .5, -.5, -.5];  [3,0,0,1]: mean 1 -> [2, -1, -1, 0]
    adv = group_advantages(t([1.0, 1, 0, 0, 3, 0, 0, 1]), group_size=4, scale_rewards="none")
    assert_close(adv, t([0.5, 0.5, -0.5, -0.5, 2.0, -1.0, -1.0, 0.0]), rtol=0, atol=1e-12)


def test_group_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 0.0]), group_size=2, scale_rewards="std")
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 0.0, 1.0]), group_size=2)
    with pytest.raises(ValueError):
        group_advantages(t([[1.0, 0.0]]), group_size=2)


def test_combine_rewards_weights_and_missing():
    # docstring example: [[1, .5], [nan, 1], [nan, nan]] . [1, 2]
    # -> 1*1 + 2*.5 = 2;  2*1 = 2 (the None is skipped);  all missing -> nan (not 0)
    r = combine_rewards(t([[1.0, 0.5], [NAN, 1.0], [NAN, NAN]]), t([1.0, 2.0]))
    assert_close(r[:2], t([2.0, 2.0]))
    assert math.isnan(r[2].item())
    # negative and fractional weights: [2, -4] . [0.5, -0.25] = 1 + 1 = 2
    assert_close(combine_rewards(t([[2.0, -4.0]]), t([0.5, -0.25])), t([2.0]))


def test_missing_rewards_are_left_out_of_mean_and_std():
    # two functions, weights [1, 0.5]:
    #   [1, 2]     -> 1 + 1 = 2
    #   [nan, nan] -> missing
    #   [0, nan]   -> 0
    #   [nan, -2]  -> -1
    # group of the three present: mean (2 + 0 - 1)/3 = 1/3
    # deviations 5/3, -1/3, -4/3; squares 25/9 + 1/9 + 16/9 = 42/9; /(3-1) = 7/3; std = sqrt(7/3) = 1.52753
    rewards = combine_rewards(t([[1.0, 2.0], [NAN, NAN], [0.0, NAN], [NAN, -2.0]]), t([1.0, 0.5]))
    assert_close(rewards[[0, 2, 3]], t([2.0, 0.0, -1.0]))
    assert math.isnan(rewards[1].item())
    s = math.sqrt(7 / 3) + 1e-4
    adv = group_advantages(rewards, group_size=4, scale_rewards="group")
    assert_close(adv, t([(5 / 3) / s, 0.0, (-1 / 3) / s, (-4 / 3) / s]), rtol=1e-12, atol=1e-12)
    adv_none = group_advantages(rewards, group_size=4, scale_rewards="none")
    assert_close(adv_none, t([5 / 3, 0.0, -1 / 3, -4 / 3]), rtol=1e-12, atol=1e-12)
    # had the missing one counted as 0 the mean would be 1/4 and A_0 would be 1.75, not 5/3
    assert abs(adv_none[0].item() - 1.75) > 0.05
    # batch std also skips the missing value: it is the same three numbers here -> same as "group"
    adv_batch = group_advantages(rewards, group_size=4, scale_rewards="batch")
    assert_close(adv_batch, adv, rtol=1e-12, atol=1e-12)
    assert_close(group_reward_std(rewards, 4), t([math.sqrt(7 / 3)]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_missing_group_and_single_present(scale):
    # group 1 all missing -> advantages 0, no NaN anywhere;
    # group 2 one present value 3 -> mean 3, centred 0 (std 0 -> 0 / 1e-4 = 0)
    # group 3 [1, 0, nan, nan] -> mean 1/2, centred [1/2, -1/2, 0, 0]
    rewards = t([NAN, NAN, NAN, NAN, NAN, 3.0, NAN, NAN, 1.0, 0.0, NAN, NAN])
    adv = group_advantages(rewards, group_size=4, scale_rewards=scale)
    assert torch.isfinite(adv).all()
    assert_close(adv[:8], torch.zeros(8, dtype=D))
    # "group": std of [1, 0] = sqrt(1/2); "batch": std of [3, 1, 0] = sqrt(((5/3)^2+(1/3)^2+(4/3)^2)/2) = sqrt(7/3)
    s = {"group": math.sqrt(0.5) + 1e-4, "batch": math.sqrt(7 / 3) + 1e-4, "none": 1.0}[scale]
    assert_close(adv[8:], t([0.5 / s, -0.5 / s, 0.0, 0.0]), rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-100, 100, allow_nan=False), min_size=4, max_size=4),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["group", "none"]),
)
def test_property_group_advantages_sum_to_zero(rows, scale):
    rewards = t(rows).reshape(-1)
    adv = group_advantages(rewards, group_size=4, scale_rewards=scale).view(-1, 4)
    # sum_i (r_i - mean) = 0, and dividing by the same (std + eps) keeps it 0
    assert_close(adv.sum(dim=1), torch.zeros(len(rows), dtype=D), rtol=0, atol=1e-9)
    if scale == "group":
        # |r_i - mean| <= (G-1)/sqrt(G) * std for a Bessel std, so |A_i| <= 3/2 when G = 4
        assert adv.abs().max().item() <= 1.5 + 1e-9
    # and a group of equal rewards gets exactly 0
    same = group_advantages(t([rows[0][0]] * 4), group_size=4, scale_rewards=scale)
    assert_close(same, torch.zeros(4, dtype=D), rtol=0, atol=1e-9)


# --------------------------------------------------------------------------
# DAPO overlong penalty (Eq. 13)
# --------------------------------------------------------------------------


def test_overlong_penalty_boundaries():
    # L_max = 20, L_cache = 4 -> safe length 16
    # |y| <= 16 -> 0;  16 < |y| <= 20 -> (16 - |y|)/4;  |y| > 20 -> -1
    lengths = torch.tensor([0, 15, 16, 17, 18, 19, 20, 21, 100])
    expected = t([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], torch.float32)
    assert_close(overlong_penalty(lengths, max_length=20, buffer=4), expected)


def test_overlong_penalty_buffer_equals_max_length():
    # L_max = L_cache = 8 -> safe length 0: |y| = 0 -> 0; 1 -> -1/8; 4 -> -1/2; 8 -> -1; 9 -> -1
    got = overlong_penalty(torch.tensor([0, 1, 4, 8, 9]), max_length=8, buffer=8)
    assert_close(got, t([0, -0.125, -0.5, -1.0, -1.0], torch.float32))


@pytest.mark.parametrize("buffer", [0, -1, 21])
def test_overlong_penalty_rejects_bad_buffer(buffer):
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_length=20, buffer=buffer)


# --------------------------------------------------------------------------
# Importance weights, surrogate, KL
# --------------------------------------------------------------------------


def test_log_importance_weights_token_and_sequence():
    # logp - old = [[0.2, 0.4, 5.0 (padding)], [0.7, -0.3, 0.1 (all padding)]]
    old = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    diff = t([[0.2, 0.4, 5.0], [0.7, -0.3, 0.1]])
    logp = (old + diff).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    tok = log_importance_weights(logp, old, mask, "token")
    assert_close(tok, diff)  # token level: the difference itself, padding untouched
    seq = log_importance_weights(logp, old, mask, "sequence")
    # row 0: (0.2 + 0.4)/2 = 0.3 (the 5.0 is masked out); row 1: 0 / clamp(0, 1) = 0
    assert seq.shape == (2, 1)
    assert_close(seq, t([[0.3], [0.0]]))
    # d(sum seq)/d logp = m / sum(m): row 0 [1/2, 1/2, 0]; row 1 all 0
    (grad,) = torch.autograd.grad(seq.sum(), logp)
    assert_close(grad, t([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):
        log_importance_weights(logp, old, mask, "sentence")


def test_clipped_surrogate_both_sides():
    # eps = 0.2 -> clip range [0.8, 1.2]; rows are tokens with ratio rho and advantage A
    #   A=+1, rho=1.5: -min(1.5, 1.2) = -1.2   (clipped above, no gradient)
    #   A=+1, rho=0.5: -min(0.5, 0.8) = -0.5   (unclipped, gradient -A = -1)
    #   A=-1, rho=0.5: -min(-0.5, -0.8) = 0.8  (clipped below, no gradient)
    #   A=-1, rho=1.5: -min(-1.5, -1.2) = 1.5  (unclipped, gradient -A = +1)
    #   A=+2, rho=1.0: -2                      (inside, gradient -2)
    #   A=0,  rho=3.0: 0
    ratio = t([[1.5], [0.5], [0.5], [1.5], [1.0], [3.0]]).requires_grad_(True)
    adv = t([1.0, 1.0, -1.0, -1.0, 2.0, 0.0])
    loss = clipped_surrogate(ratio, adv, 0.2, 0.2)
    assert loss.shape == (6, 1)
    assert_close(loss, t([[-1.2], [-0.5], [0.8], [1.5], [-2.0], [0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), ratio)
    assert_close(grad, t([[0.0], [-1.0], [0.0], [1.0], [-2.0], [0.0]]))


def test_clipped_surrogate_asymmetric_epsilon():
    # eps_low = 0.2, eps_high = 0.28 -> clip range [0.8, 1.28]
    #   A=+1, rho=1.5:  -min(1.5, 1.28) = -1.28
    #   A=+1, rho=1.25: inside -> -1.25   (symmetric 0.2 would clip it to -1.2)
    #   A=-1, rho=0.75: -min(-0.75, -0.8) = 0.8
    #   A=-1, rho=0.85: inside -> 0.85
    ratio = t([[1.5, 1.25], [0.75, 0.85]])
    adv = t([1.0, -1.0])
    assert_close(clipped_surrogate(ratio, adv, 0.2, 0.28), t([[-1.28, -1.25], [0.8, 0.85]]))
    assert_close(clipped_surrogate(ratio, adv, 0.2, 0.2), t([[-1.2, -1.2], [0.8, 0.85]]))
    # eps_low = 0.3 moves only the lower edge: A=-1, rho=0.75 now inside -> 0.75
    assert_close(clipped_surrogate(ratio, adv, 0.3, 0.28), t([[-1.28, -1.25], [0.75, 0.85]]))


def test_clipped_surrogate_delta():
    # delta = 1.3 caps rho in the unclipped term only:
    #   A=-1, rho=1.5: -min(-1.3, -1.2) = 1.3          (would be 1.5 without delta); gradient 0
    #   A=-1, rho=5.0: -min(-1.3, -1.2) = 1.3
    #   A=+1, rho=1.5: -min(1.3, 1.2) = -1.2           (unchanged)
    #   A=-1, rho=0.5: -min(-0.5, -0.8) = 0.8          (unchanged)
    #   A=-1, rho=1.1: -min(-1.1, -1.1) = 1.1          (below delta: unchanged)
    ratio = t([[1.5], [5.0], [1.5], [0.5], [1.1]]).requires_grad_(True)
    adv = t([-1.0, -1.0, 1.0, -1.0, -1.0])
    loss = clipped_surrogate(ratio, adv, 0.2, 0.2, delta=1.3)
    assert_close(loss, t([[1.3], [1.3], [-1.2], [0.8], [1.1]]))
    no_delta = clipped_surrogate(ratio, adv, 0.2, 0.2)
    assert_close(no_delta, t([[1.5], [5.0], [-1.2], [0.8], [1.1]]))
    (grad,) = torch.autograd.grad(loss.sum(), ratio)
    # the capped tokens have no gradient; rho=1.1, A=-1 has gradient -A = 1
    assert_close(grad, t([[0.0], [0.0], [0.0], [0.0], [1.0]]))


def test_kl_estimators():
    ln2 = math.log(2.0)
    # logp = log .5, ref = log .25 -> x = ref - logp = -ln 2
    #   k1 = ln 2 = 0.693147;  k2 = (ln 2)^2 / 2 = 0.240227;  k3 = e^{-ln2} + ln2 - 1 = 0.5 + 0.693147 - 1 = 0.193147
    # logp = log .25, ref = log .5 -> x = +ln 2
    #   k1 = -ln 2 (k1 can be negative);  k2 = 0.240227;  k3 = 2 - ln2 - 1 = 0.306853
    # logp = ref -> all 0
    logp = t([math.log(0.5), math.log(0.25), -1.7]).requires_grad_(True)
    ref = t([math.log(0.25), math.log(0.5), -1.7])
    expected = {
        "k1": [ln2, -ln2, 0.0],
        "k2": [ln2**2 / 2, ln2**2 / 2, 0.0],
        "k3": [0.5 + ln2 - 1, 2 - ln2 - 1, 0.0],
    }
    # d/dlogp with x = ref - logp:  k1 -> 1;  k2 -> -x;  k3 -> 1 - e^x
    grads = {
        "k1": [1.0, 1.0, 1.0],
        "k2": [ln2, -ln2, 0.0],
        "k3": [1 - 0.5, 1 - 2.0, 0.0],
    }
    for est in ("k1", "k2", "k3"):
        k = kl_estimate(logp, ref, est)
        assert_close(k, t(expected[est]), rtol=1e-12, atol=1e-12)
        (g,) = torch.autograd.grad(k.sum(), logp)
        assert_close(g, t(grads[est]), rtol=1e-12, atol=1e-12)
    # default is k3
    assert_close(kl_estimate(logp, ref), t(expected["k3"]))
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


# --------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------

X = 100.0  # value under padding: any leak of it shows up in the result
L3 = [[1.0, 3.0, 5.0], [2.0, X, X], [X, X, X]]
M3 = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]  # lengths 3, 1, 0 (an all-masked row)


def test_aggregate_loss_each_type():
    L, M = t(L3), torch.tensor(M3)
    # grpo: per-sequence means 9/3 = 3, 2/1 = 2, 0 (empty row: 0 / clamp(0,1)); (3 + 2 + 0) / 3 = 5/3
    assert_close(aggregate_loss(L, M, "grpo"), t(5 / 3))
    # bnpo: (1 + 3 + 5 + 2) / 4 tokens = 11/4
    assert_close(aggregate_loss(L, M, "bnpo"), t(11 / 4))
    # dr_grpo: 11 / (3 sequences * T_max 5) = 11/15
    norms = LossNormalisers(max_completion_length=5)
    assert_close(aggregate_loss(L, M, "dr_grpo", norms), t(11 / 15))
    # dapo: 11 / 4 tokens
    assert_close(aggregate_loss(L, M, "dapo"), t(11 / 4))


def test_aggregate_loss_docstring_example():
    # L = [[1, 3], [2, x]], M = [[1, 1], [1, 0]], T_max = 4
    # grpo (2 + 2)/2 = 2;  bnpo 6/3 = 2;  dr_grpo 6/(2*4) = 0.75;  dapo 6/3 = 2
    L, M = t([[1.0, 3.0], [2.0, X]]), torch.tensor([[1, 1], [1, 0]])
    norms = LossNormalisers(max_completion_length=4)
    got = [aggregate_loss(L, M, lt, norms).item() for lt in ("grpo", "bnpo", "dr_grpo", "dapo")]
    assert got == pytest.approx([2.0, 2.0, 0.75, 2.0], abs=1e-12)


def test_aggregate_loss_batch_arguments():
    L, M = t(L3), torch.tensor(M3)
    # num_sequences = 6 (this is one piece of a 6-sequence batch): grpo (3 + 2 + 0)/6 = 5/6
    assert_close(aggregate_loss(L, M, "grpo", LossNormalisers(num_sequences=6)), t(5 / 6))
    # dr_grpo: 11 / (6 * 5) = 11/30
    norms = LossNormalisers(max_completion_length=5, num_sequences=6)
    assert_close(aggregate_loss(L, M, "dr_grpo", norms), t(11 / 30))
    # dapo with 22 tokens in the whole batch: 11/22 = 0.5 (a Python number or a tensor)
    assert_close(aggregate_loss(L, M, "dapo", LossNormalisers(num_tokens=22)), t(0.5))
    norms = LossNormalisers(num_tokens=torch.tensor(22.0))
    assert_close(aggregate_loss(L, M, "dapo", norms), t(0.5))
    # bnpo with 2 minibatches: 11/4 / 2 = 11/8
    assert_close(aggregate_loss(L, M, "bnpo", LossNormalisers(num_minibatches=2)), t(11 / 8))
    # num_minibatches only affects bnpo
    assert_close(aggregate_loss(L, M, "grpo", LossNormalisers(num_minibatches=2)), t(5 / 3))


def test_aggregate_loss_gradients_respect_mask():
    L = t(L3).requires_grad_(True)
    M = torch.tensor(M3)
    # grpo: dL/dL_it = m_it / len_i / N: row 0 1/(3*3) = 1/9; row 1 1/(1*3) = 1/3 on its first token; row 2 0
    (g,) = torch.autograd.grad(aggregate_loss(L, M, "grpo"), L)
    assert_close(g, t([[1 / 9, 1 / 9, 1 / 9], [1 / 3, 0, 0], [0, 0, 0]]))
    # dapo: m / 4
    (g,) = torch.autograd.grad(aggregate_loss(L, M, "dapo"), L)
    assert_close(g, t(M3) / 4)


def test_aggregate_loss_sequence_shaped_loss_broadcasts():
    # per-sequence loss [N, 1] = [[2], [4]], mask lengths 2 and 1 (T = 3)
    # grpo: (2 + 4)/2 = 3; bnpo/dapo: (2*2 + 4)/3 = 8/3; dr_grpo (T_max 3): 8/(2*3) = 4/3
    L, M = t([[2.0], [4.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(aggregate_loss(L, M, "grpo"), t(3.0))
    assert_close(aggregate_loss(L, M, "bnpo"), t(8 / 3))
    assert_close(aggregate_loss(L, M, "dapo"), t(8 / 3))
    norms = LossNormalisers(max_completion_length=3)
    assert_close(aggregate_loss(L, M, "dr_grpo", norms), t(4 / 3))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_fully_masked_batch_is_zero(loss_type):
    L, M = t([[X, X], [X, X]]), torch.zeros(2, 2)
    assert aggregate_loss(L, M, loss_type, LossNormalisers(max_completion_length=2)).item() == 0.0


def test_aggregate_loss_errors():
    L, M = t(L3), torch.tensor(M3)
    with pytest.raises(ValueError):
        aggregate_loss(L, M, "dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        aggregate_loss(L, M, "sum")


def _split_sum(L, M, loss_type, bounds, T_max):
    n_seq, n_tok = L.shape[0], M.sum().item()
    pieces = list(zip(bounds[:-1], bounds[1:]))
    return sum(
        aggregate_loss(
            L[a:b],
            M[a:b],
            loss_type,
            LossNormalisers(
                max_completion_length=T_max,
                num_sequences=n_seq,
                num_tokens=n_tok,
                num_minibatches=len(pieces),
            ),
        )
        for a, b in pieces
    )


def test_split_batch_hand_example():
    # L rows (masked sums / lengths): [1,3,5]->9/3, [2]->2/1, []->0, [4,4]->8/2
    L = t([[1.0, 3.0, 5.0], [2.0, X, X], [X, X, X], [4.0, 4.0, X]])
    M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    bounds = [0, 2, 4]  # pieces: rows 0, 1 (4 tokens) | rows 2, 3 (2 tokens)
    # grpo whole: (3 + 2 + 0 + 4)/4 = 9/4; pieces (3 + 2)/4 + (0 + 4)/4 = 9/4
    # dr_grpo (T_max 3): whole (9 + 2 + 8)/(4 * 3) = 19/12; pieces 11/12 + 8/12
    # dapo: whole 19/6 (6 tokens); pieces 11/6 + 8/6
    for lt, whole in (("grpo", 9 / 4), ("dr_grpo", 19 / 12), ("dapo", 19 / 6)):
        assert_close(aggregate_loss(L, M, lt, LossNormalisers(max_completion_length=3)), t(whole))
        assert_close(_split_sum(L, M, lt, bounds, 3), t(whole))
    # bnpo normalises per piece: (11/4)/2 + (8/2)/2 = 1.375 + 2 = 3.375, whereas the whole batch gives 19/6
    assert_close(_split_sum(L, M, "bnpo", bounds, 3), t(3.375))
    assert_close(aggregate_loss(L, M, "bnpo"), t(19 / 6))
    # ... but equals the whole when every piece has the same token count:
    # row 0 (3 tokens) | rows 1..3 (1 + 0 + 2 = 3 tokens): (9/3)/2 + (10/3)/2 = 19/6
    assert_close(_split_sum(L, M, "bnpo", [0, 1, 4], 3), t(19 / 6))


@settings(max_examples=30, deadline=None)
@given(
    st.integers(min_value=2, max_value=6),
    st.integers(min_value=1, max_value=5),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.sampled_from(["grpo", "dr_grpo", "dapo"]),
    st.data(),
)
def test_property_split_invariance(n, T, seed, loss_type, data):
    gen = torch.Generator().manual_seed(seed)
    L = torch.randn(n, T, generator=gen, dtype=D)
    M = (torch.rand(n, T, generator=gen) < 0.7).to(D)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=n - 1))))
    bounds = [0, *cuts, n]
    whole = aggregate_loss(L, M, loss_type, LossNormalisers(max_completion_length=T))
    assert_close(_split_sum(L, M, loss_type, bounds, T), whole, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # lengths 3 and 2; 5 tokens
ADV = t([1.5, -0.5])


def _logp():
    return t([[-0.5, -1.2, -2.0], [-0.1, -3.0, -0.7]]).requires_grad_(True)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_on_policy_is_plain_policy_gradient(loss_type, level):
    # old_logp=None: old = logp.detach(), so rho = 1 and every token's loss is -A_i.
    # value: grpo  mean_i(-A_i) = (-1.5 + 0.5)/2 = -0.5
    #        bnpo/dapo  (3 * -1.5 + 2 * 0.5)/5 = -3.5/5 = -0.7
    #        dr_grpo (T_max 4)  -3.5/(2 * 4) = -0.4375
    expected = {"grpo": -0.5, "bnpo": -0.7, "dapo": -0.7, "dr_grpo": -0.4375}[loss_type]
    logp = _logp()
    loss, stats = policy_loss(
        logp,
        None,
        ADV,
        MASK,
        LossSettings(loss_type=loss_type, params=PolicyLossParams(importance_sampling_level=level)),
        LossNormalisers(max_completion_length=4),
    )
    assert_close(loss, t(expected), rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(loss, logp)
    # the plain policy gradient: d/dlogp of aggregate(-A * logp)
    logp2 = _logp()
    pg = aggregate_loss(
        -ADV.unsqueeze(-1) * logp2, MASK, loss_type, LossNormalisers(max_completion_length=4)
    )
    (g_pg,) = torch.autograd.grad(pg, logp2)
    assert_close(g, g_pg, rtol=1e-12, atol=1e-12)
    # by hand for grpo: -A_i / len_i / N -> row 0: -1.5/3/2 = -0.25; row 1: 0.5/2/2 = 0.125, padding 0
    if loss_type == "grpo":
        assert_close(g, t([[-0.25, -0.25, -0.25], [0.125, 0.125, 0.0]]), rtol=1e-12, atol=1e-12)
    # nothing is clipped at rho = 1
    assert stats["clip_low"].item() == stats["clip_high"].item() == stats["clip_region"].item() == 0.0
    assert "kl" not in stats


def test_policy_loss_old_logp_equal_to_logp_matches_none():
    logp = _logp()
    a, _ = policy_loss(logp, None, ADV, MASK, LossSettings(loss_type="grpo"))
    b, _ = policy_loss(logp, logp.detach().clone(), ADV, MASK, LossSettings(loss_type="grpo"))
    assert_close(a, b)


def _clip_case_logps():
    # ratios rho = exp(logp - old):
    #   row 0 (A = +1): [1.5, 1.0, 0.5]
    #   row 1 (A = -1): [0.5, 1.5, 0.5 (padding)]
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    rho = t([[1.5, 1.0, 0.5], [0.5, 1.5, 0.5]])
    return (old + torch.log(rho)).requires_grad_(True), old


def test_policy_loss_clipping_values_and_stats():
    logp, old = _clip_case_logps()
    adv = t([1.0, -1.0])
    # per-token losses (eps 0.2): row 0: -1.2 (clipped high), -1.0, -0.5; row 1: 0.8 (clipped low), 1.5, (padding)
    # grpo: row means -2.7/3 = -0.9 and 2.3/2 = 1.15 -> (-0.9 + 1.15)/2 = 0.125
    loss, stats = policy_loss(logp, old, adv, MASK, LossSettings(loss_type="grpo"))
    assert_close(loss, t(0.125), rtol=1e-12, atol=1e-12)
    # dapo: (-2.7 + 2.3)/5 = -0.08
    loss_dapo, _ = policy_loss(logp, old, adv, MASK, LossSettings(loss_type="dapo"))
    assert_close(loss_dapo, t(-0.08), rtol=1e-12, atol=1e-12)
    # counts over masked tokens: high = (row 0, tok 0); low = (row 1, tok 0) - the padded 0.5 is not counted
    # (rho=0.5 with A=+1 in row 0 is below the range but not "clipped": min picks the unclipped term)
    assert stats["clip_high"].item() == 1.0
    assert stats["clip_low"].item() == 1.0
    assert stats["clip_region"].item() == 2.0
    # gradient, grpo: unclipped tokens get -A * rho / len_i / N:
    #   row 0 tok 1: -1 * 1.0 / 3 / 2 = -1/6; tok 2: -1 * 0.5 / 6 = -1/12;  row 1 tok 1: +1 * 1.5 / 2 / 2 = 0.375
    (g,) = torch.autograd.grad(loss, logp)
    assert_close(g, t([[0.0, -1 / 6, -1 / 12], [0.0, 0.375, 0.0]]), rtol=1e-12, atol=1e-12)


def test_policy_loss_asymmetric_and_delta():
    logp, old = _clip_case_logps()
    adv = t([1.0, -1.0])
    # eps_high 0.28: row 0 tok 0 -> -1.28; row sums -2.78 and 2.3 -> grpo (-2.78/3 + 1.15)/2
    settings = LossSettings(loss_type="grpo", params=PolicyLossParams(epsilon_high=0.28))
    loss, stats = policy_loss(logp, old, adv, MASK, settings)
    assert_close(loss, t((-2.78 / 3 + 1.15) / 2), rtol=1e-12, atol=1e-12)
    assert stats["clip_high"].item() == 1.0  # 1.5 > 1.28 still
    # eps_high 0.6: 1.5 is inside -> -1.5, not clipped; row 0 sum -3.0
    settings = LossSettings(loss_type="grpo", params=PolicyLossParams(epsilon_high=0.6))
    loss, stats = policy_loss(logp, old, adv, MASK, settings)
    assert_close(loss, t((-1.0 + 1.15) / 2), rtol=1e-12, atol=1e-12)
    assert stats["clip_high"].item() == 0.0 and stats["clip_region"].item() == 1.0
    # delta 1.3: row 1 tok 1 (A=-1, rho 1.5) -> 1.3; row 1 sum 0.8 + 1.3 = 2.1 -> grpo (-0.9 + 1.05)/2 = 0.075
    settings = LossSettings(loss_type="grpo", params=PolicyLossParams(delta=1.3))
    loss, _ = policy_loss(logp, old, adv, MASK, settings)
    assert_close(loss, t(0.075), rtol=1e-12, atol=1e-12)


def test_policy_loss_sequence_level_clip_counts_tokens():
    # row 0: A=+1, log ratios [ln 2, ln 2, padding 9] -> sequence rho = 2 > 1.2: both tokens clipped high
    # row 1: A=-1, log ratios [0, 0, 0] -> rho 1
    old = torch.zeros(2, 3, dtype=D)
    logp = t([[math.log(2), math.log(2), 9.0], [0.0, 0.0, 0.0]]).requires_grad_(True)
    adv = t([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    sequence = PolicyLossParams(importance_sampling_level="sequence")
    loss, stats = policy_loss(logp, old, adv, mask, LossSettings(loss_type="grpo", params=sequence))
    # per-token loss row 0: -min(2, 1.2) = -1.2; row 1: -(-1) = 1 -> grpo (-1.2 + 1)/2 = -0.1
    assert_close(loss, t(-0.1), rtol=1e-12, atol=1e-12)
    assert stats["clip_high"].item() == 2.0 and stats["clip_low"].item() == 0.0
    # token level instead: row 0 tokens rho 2 -> same two clipped; padded exp(9) not counted
    _, stats_tok = policy_loss(logp, old, adv, mask, LossSettings(loss_type="grpo"))
    assert stats_tok["clip_high"].item() == 2.0


def test_policy_loss_kl_term():
    # logp = log 0.5 everywhere, ref = log 0.25: k3 = 0.193147 per token (see test_kl_estimators), on-policy
    logp = torch.full((2, 3), math.log(0.5), dtype=D, requires_grad=True)
    ref = torch.full((2, 3), math.log(0.25), dtype=D)
    k3 = 0.5 + math.log(2) - 1
    loss, stats = policy_loss(
        logp, None, ADV, MASK, LossSettings(loss_type="dapo", beta=0.04), ref_logp=ref
    )
    # dapo: (-3.5 + 0.04 * 5 * k3)/5 = -0.7 + 0.04 * k3
    assert_close(loss, t(-0.7 + 0.04 * k3), rtol=1e-12, atol=1e-12)
    assert_close(stats["kl"], t(5 * k3), rtol=1e-12, atol=1e-12)  # summed over the 5 masked tokens
    # k1 instead: ln 2 per token -> -0.7 + 0.04 ln 2
    k1 = LossSettings(loss_type="dapo", beta=0.04, kl_estimator="k1")
    loss, stats = policy_loss(logp, None, ADV, MASK, k1, ref_logp=ref)
    assert_close(loss, t(-0.7 + 0.04 * math.log(2)), rtol=1e-12, atol=1e-12)
    # gradient, dapo k3: (-A_i + beta * (1 - e^x)) / 5 with e^x = 0.5 -> row 0 (-1.5 + 0.02)/5, row 1 (0.5 + 0.02)/5
    loss, _ = policy_loss(
        logp, None, ADV, MASK, LossSettings(loss_type="dapo", beta=0.04), ref_logp=ref
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert_close(g, t([[-1.48 / 5] * 3, [0.52 / 5, 0.52 / 5, 0.0]]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        policy_loss(logp, None, ADV, MASK, LossSettings(beta=0.04))  # no ref_logp


def test_policy_loss_passes_batch_arguments():
    logp = _logp()
    # on-policy dapo over a 10-token batch: -3.5/10
    loss, _ = policy_loss(
        logp, None, ADV, MASK, LossSettings(loss_type="dapo"), LossNormalisers(num_tokens=10)
    )
    assert_close(loss, t(-0.35), rtol=1e-12, atol=1e-12)
    # grpo over 4 sequences: (-1.5 + 0.5)/4
    loss, _ = policy_loss(
        logp, None, ADV, MASK, LossSettings(loss_type="grpo"), LossNormalisers(num_sequences=4)
    )
    assert_close(loss, t(-0.25), rtol=1e-12, atol=1e-12)
    # bnpo over 2 minibatches: -0.7/2
    loss, _ = policy_loss(
        logp, None, ADV, MASK, LossSettings(loss_type="bnpo"), LossNormalisers(num_minibatches=2)
    )
    assert_close(loss, t(-0.35), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# Small helpers and the LR schedule
# --------------------------------------------------------------------------


def test_masked_mean_and_entropy():
    # (1 + 3)/2 = 2; empty mask -> 0
    assert masked_mean(t([1.0, X, 3.0]), torch.tensor([1, 0, 1])).item() == 2.0
    assert masked_mean(t([1.0, 2.0]), torch.tensor([0, 0])).item() == 0.0
    # uniform over 4 -> ln 4; one-hot-ish (huge gap) -> ~0
    assert_close(entropy_from_logits(torch.zeros(1, 4)), torch.tensor([math.log(4.0)]))
    assert entropy_from_logits(torch.tensor([[0.0, -100.0]])).item() < 1e-6


def test_lr_multiplier_warmup_then_linear():
    # warmup 4 of 10 steps: (step+1)/4 for steps 0..3 -> .25 .5 .75 1
    assert [lr_multiplier("linear", s, 10, 4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # then 1 - (step - 4)/6: step 4 -> 1, 7 -> 0.5, 10 -> 0, 12 -> 0 (clamped)
    assert [lr_multiplier("linear", s, 10, 4) for s in (4, 7, 10, 12)] == pytest.approx([1.0, 0.5, 0.0, 0.0])


def test_lr_multiplier_cosine_and_constant():
    # cosine after warmup 4 of 10: 0.5 (1 + cos(pi (step-4)/6)): 4 -> 1; 5 -> 0.5 (1 + cos(pi/6)) = 0.9330127;
    # 7 -> 0.5 (1 + cos(pi/2)) = 0.5; 10 -> 0
    got = [lr_multiplier("cosine", s, 10, 4) for s in (4, 5, 7, 10)]
    assert got == pytest.approx([1.0, 0.5 * (1 + math.sqrt(3) / 2), 0.5, 0.0], abs=1e-12)
    assert lr_multiplier("cosine", 1, 10, 4) == pytest.approx(0.5)  # warmup (1+1)/4
    # constant: warmup then 1 forever
    assert [lr_multiplier("constant", s, 10, 2) for s in (0, 1, 2, 50)] == pytest.approx([0.5, 1.0, 1.0, 1.0])


def test_lr_multiplier_without_warmup():
    # linear over 10 steps: step 0 -> 1, step 5 -> 0.5, step 9 -> 0.1
    assert [lr_multiplier("linear", s, 10, 0) for s in (0, 5, 9)] == pytest.approx([1.0, 0.5, 0.1])
    with pytest.raises(ValueError):
        lr_multiplier("step", 5, 10, 0)
