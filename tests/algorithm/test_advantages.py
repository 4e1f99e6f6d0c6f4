"""Hand-computed tests for grpo.algorithm.advantages: group advantages (the seed's table),
combining rewards, missing rewards, the outcome estimators (grpo, dr_grpo, rloo, reinforce_pp)
and DAPO's overlong penalty.

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
    AdvantageInputs,
    combine_rewards,
    dr_grpo_advantages,
    gae_estimator,
    group_advantages,
    group_reward_std,
    grpo_advantages,
    normalize_then_sum,
    normalize_then_sum_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    sum_then_normalize,
)
from grpo.registry import ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS

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
# The registry
# --------------------------------------------------------------------------


def test_registry_names_and_targets():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}
    assert ADVANTAGE_ESTIMATORS.get("dr_grpo") is dr_grpo_advantages
    assert ADVANTAGE_ESTIMATORS.get("rloo") is rloo_advantages
    assert ADVANTAGE_ESTIMATORS.get("reinforce_pp") is reinforce_pp_advantages
    assert ADVANTAGE_ESTIMATORS.get("gae") is gae_estimator
    # whether an estimator needs the critic's values is said where it is registered
    assert gae_estimator.needs_values and not getattr(grpo_advantages, "needs_values", False)
    assert MULTI_OBJECTIVE_AGGREGATIONS.get("sum_then_normalize") is sum_then_normalize
    assert MULTI_OBJECTIVE_AGGREGATIONS.get("normalize_then_sum") is normalize_then_sum


def test_the_aggregations_give_the_estimator_the_sum_or_normalise_each_function_first():
    per_func = t([[1, 0], [0, 0], [1, 10], [0, 0]])
    weights = t([1.0, 1.0])
    inputs = AdvantageInputs(
        combine_rewards(per_func, weights),
        2,
        "none",
        rewards_per_func=per_func,
        reward_weights=weights,
    )
    # the estimator on the weighted sum [1, 0, 11, 0]: centred in each group
    assert_close(sum_then_normalize(inputs, grpo_advantages), t([0.5, -0.5, 5.5, -5.5]))
    # GDPO's, in place of the estimator (its worked example: tests/algorithm/test_trl_options.py)
    gdpo = normalize_then_sum(inputs, grpo_advantages)
    assert_close(gdpo, normalize_then_sum_advantages(per_func, weights, 2))
    assert_close(gdpo, t([0.54765, -0.54765, 1.09537, -1.09537]), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------
# dr_grpo
# --------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_dr_grpo_subtracts_the_mean_whatever_scale_rewards_says(scale):
    # [1,1,0,0]: mean 1/2 -> +-1/2; [1,nan,0,0]: mean 1/3 -> 2/3, 0 (missing), -1/3, -1/3
    adv = dr_grpo_advantages(AdvantageInputs(t([1, 1, 0, 0, 1, NAN, 0, 0]), 4, scale))
    assert_close(adv, t([0.5, 0.5, -0.5, -0.5, 2 / 3, 0.0, -1 / 3, -1 / 3]))
    assert_close(adv, group_advantages(t([1, 1, 0, 0, 1, NAN, 0, 0]), 4, "none"))


# --------------------------------------------------------------------------
# rloo
# --------------------------------------------------------------------------


def test_rloo_leave_one_out_baseline():
    rewards = t([1, 0, 0, 1, 1, NAN, 0, 0, NAN, 3, NAN, NAN, 2, 2, 2, 2])
    adv = rloo_advantages(AdvantageInputs(rewards, 4, "group"))
    expected = t(
        [
            # sum 2: r=1 -> 1 - (2-1)/3 = 2/3; r=0 -> 0 - 2/3
            2 / 3, -2 / 3, -2 / 3, 2 / 3,
            # present 1, 0, 0 (n=3, sum 1): 1 - 0/2 = 1; 0 - 1/2; the missing one 0
            1.0, 0.0, -0.5, -0.5,
            # one present reward: no baseline -> 0
            0.0, 0.0, 0.0, 0.0,
            # all equal: 2 - 2 = 0
            0.0, 0.0, 0.0, 0.0,
        ]
    )  # fmt: skip
    assert_close(adv, expected)


def test_rloo_is_n_over_n_minus_one_times_the_centred_reward():
    rewards = torch.randn(24, dtype=D, generator=torch.Generator().manual_seed(0))
    centred = group_advantages(rewards, 6, "none")
    assert_close(rloo_advantages(AdvantageInputs(rewards, 6, "none")), centred * 6 / 5)


def test_rloo_keeps_the_dtype_and_treats_inf_as_missing():
    adv = rloo_advantages(
        AdvantageInputs(torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float32), 3, "none")
    )
    assert adv.dtype == torch.float32
    assert_close(adv, torch.tensor([1.0, 0.0, -1.0]))  # 1 - 0/1, missing, 0 - 1/1


# --------------------------------------------------------------------------
# reinforce_pp
# --------------------------------------------------------------------------


def test_reinforce_pp_uses_the_batch_baseline_and_scale():
    # [1,0,0,0, 1,1,1,1]: mean 5/8, squares 5 (3/8)^2 + 3 (5/8)^2 = 15/8, Bessel var 15/56
    std = math.sqrt(15 / 56) + ADVANTAGE_EPS  # 0.51765
    adv = reinforce_pp_advantages(AdvantageInputs(t([1, 0, 0, 0, 1, 1, 1, 1]), 4, "group"))
    hi, lo = 0.375 / std, -0.625 / std
    assert_close(adv, t([hi, lo, lo, lo, hi, hi, hi, hi]))
    # an all-correct group still gets a positive advantage (no group baseline)
    assert adv[4:].gt(0.72).all()
    assert round(hi, 4) == 0.7244 and round(lo, 4) == -1.2074


def test_reinforce_pp_missing_rewards():
    # present 2, 0, 1 (the NaN and inf are missing): mean 1, var (1 + 1 + 0)/2 = 1
    adv = reinforce_pp_advantages(
        AdvantageInputs(t([2, NAN, 0, float("inf"), 1, 1]) * t([1, 1, 1, 1, 1, NAN]), 2, "none")
    )
    s = 1.0 + ADVANTAGE_EPS
    assert_close(adv, t([1 / s, 0.0, -1 / s, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("fn", [rloo_advantages, reinforce_pp_advantages, dr_grpo_advantages])
def test_bad_shapes_are_refused(fn):
    with pytest.raises(ValueError, match="group_size=4"):
        fn(AdvantageInputs(t([1, 0, 1]), 4, "none"))
