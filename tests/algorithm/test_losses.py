"""Hand-computed tests for the policy losses cispo and sapo, per-token advantages, the
entropy mask and the rollout correction (grpo.algorithm.losses, grpo.algorithm.correction).

Every expected number is derived by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo.algorithm import (
    LossSettings,
    PolicyLossParams,
    RolloutCorrection,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_surrogate,
    correction_weights,
    entropy_mask,
    mismatch_stats,
    policy_loss,
    sapo_policy_loss,
    token_advantages,
)
from grpo.registry import POLICY_LOSSES

D = torch.float64
LN = math.log


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def test_registry():
    assert POLICY_LOSSES.get("cispo") is cispo_policy_loss
    assert POLICY_LOSSES.get("sapo") is sapo_policy_loss
    assert POLICY_LOSSES.get("clipped") is clipped_policy_loss


def test_params_defaults_are_trls():
    p = PolicyLossParams()
    assert (p.sapo_temperature_pos, p.sapo_temperature_neg) == (1.0, 1.05)


# --------------------------------------------------------------------------
# Advantages [N] or [N, T]
# --------------------------------------------------------------------------


def test_token_advantages_shapes():
    assert token_advantages(t([0.5, -1.0])).shape == (2, 1)
    assert token_advantages(t([[0.5, -1.0]])).shape == (1, 2)
    with pytest.raises(ValueError, match=r"\[N\] or \[N, T\]"):
        token_advantages(t([[[1.0]]]))


def test_clipped_surrogate_with_per_token_advantages():
    # row of ratios [1.5, 0.5], advantages per token [+1, -1], eps 0.2:
    # +1, rho 1.5 -> -min(1.5, 1.2) = -1.2; -1, rho 0.5 -> -min(-0.5, -0.8) = 0.8
    out = clipped_surrogate(t([[1.5, 0.5]]), t([[1.0, -1.0]]), 0.2, 0.2)
    assert_close(out, t([[-1.2, 0.8]]))


@pytest.mark.parametrize("objective", ["clipped", "cispo", "sapo"])
def test_per_completion_advantages_equal_their_broadcast_per_token(objective):
    gen = torch.Generator().manual_seed(0)
    logp = (-2 * torch.rand(3, 4, generator=gen, dtype=D)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=gen, dtype=D)
    adv = t([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    params = PolicyLossParams(epsilon_high=0.28 if objective != "cispo" else 1.2)
    settings = LossSettings(objective=objective, params=params)
    a, sa = policy_loss(logp, old, adv, mask, settings)
    b, sb = policy_loss(logp, old, adv.unsqueeze(1).expand(3, 4), mask, settings)
    assert_close(a, b)
    assert sa == sb


# --------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------


def test_cispo_hand_example():
    # logp = log 0.5, old = log 0.25: rho = 2, A = +1
    logp = t([[LN(0.5)]]).requires_grad_(True)
    old = t([[LN(0.25)]])
    for cap, w in ((1.5, 1.5), (5.0, 2.0)):
        loss, stats = cispo_policy_loss(logp, old, t([1.0]), torch.ones(1, 1), PolicyLossParams(epsilon_high=cap))
        assert_close(loss, t([[-w * LN(0.5)]]))  # 1.0397 (cap 1.5), 1.3863 (cap 5)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert_close(grad, t([[-w]]))  # the weight is detached: d/dlogp (-w A logp) = -w A
        assert stats["clip_high"].item() == (1.0 if cap < 2 else 0.0)


def test_cispo_keeps_the_gradient_where_ppo_clips():
    # rho = 2 > 1 + eps with A > 0: clipped's gradient is 0, CISPO's is -min(rho, cap) * A
    logp = t([[LN(0.5)]]).requires_grad_(True)
    old = t([[LN(0.25)]])
    clipped, _ = clipped_policy_loss(logp, old, t([1.0]), torch.ones(1, 1), PolicyLossParams())
    assert torch.autograd.grad(clipped.sum(), logp)[0].item() == 0.0
    cispo, _ = cispo_policy_loss(logp, old, t([1.0]), torch.ones(1, 1), PolicyLossParams(epsilon_high=5.0))
    assert torch.autograd.grad(cispo.sum(), logp)[0].item() == pytest.approx(-2.0)


def test_cispo_stats_split_the_capped_tokens_by_sign():
    # ratios [3, 0.5, 3, 3(padding)], advantages +1, +1, -1 (row 1); cap 2
    logp = t([[LN(3.0), LN(0.5)], [LN(3.0), LN(3.0)]])
    old = torch.zeros(2, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    _, stats = cispo_policy_loss(logp, old, t([1.0, -1.0]), mask, PolicyLossParams(epsilon_high=2.0))
    assert stats["clip_high"].item() == 1.0  # token (0, 0): capped with A > 0 (TRL's cispo_clip_ratio)
    assert stats["clip_low"].item() == 1.0  # token (1, 0): capped with A < 0; (1, 1) is padding
    assert stats["clip_region"].item() == 2.0


def test_cispo_sequence_level_shares_one_weight():
    # log ratios [ln 4, 0] over 2 tokens: sequence rho = exp(ln 4 / 2) = 2, cap 5 -> w = 2 for both tokens
    logp = t([[LN(4.0) - 1.0, -1.0]]).requires_grad_(True)
    old = t([[-1.0, -1.0]])
    params = PolicyLossParams(epsilon_high=5.0, importance_sampling_level="sequence")
    loss, _ = cispo_policy_loss(logp, old, t([0.5]), torch.ones(1, 2), params)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(grad, t([[-1.0, -1.0]]))  # -w * A = -2 * 0.5


# --------------------------------------------------------------------------
# SAPO
# --------------------------------------------------------------------------


def test_sapo_hand_example():
    s1 = 1 / (1 + math.exp(-1))  # sigmoid(1) = 0.73106
    logp = t([[0.0, 0.0, LN(2.0)]]).requires_grad_(True)  # old = 0: rho = [1, 1, 2]
    old = torch.zeros(1, 3, dtype=D)
    adv = t([[1.0, -1.0, 1.0]])
    loss, _ = sapo_policy_loss(logp, old, adv, torch.ones(1, 3), PolicyLossParams())
    # rho 1, A +1, tau 1: -4 * 0.5 = -2; rho 1, A -1, tau 1.05: +(4 / 1.05) * 0.5 = 1.90476
    # rho 2, A +1, tau 1: -4 * sigmoid(1) = -2.92423
    assert_close(loss, t([[-2.0, 2 / 1.05, -4 * s1]]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # dl/dlogp = -4 s (1 - s) rho A: rho 1 -> -A (PPO's on-policy gradient); rho 2 -> -4 * 0.73106 * 0.26894 * 2
    assert_close(grad, t([[-1.0, 1.0, -4 * s1 * (1 - s1) * 2]]))
    assert round(grad[0, 2].item(), 5) == -1.57290


def test_sapo_temperatures_come_from_params():
    # rho = 1, A = -1: l = (4 / tau_neg) * 0.5; A = +1: -(4 / tau_pos) * 0.5
    loss, _ = sapo_policy_loss(
        torch.zeros(1, 2, dtype=D), torch.zeros(1, 2, dtype=D), t([[1.0, -1.0]]), torch.ones(1, 2),
        PolicyLossParams(sapo_temperature_pos=2.0, sapo_temperature_neg=4.0),
    )  # fmt: skip
    assert_close(loss, t([[-1.0, 0.5]]))


def test_sapo_gate_attenuates_far_off_policy_tokens():
    # gradient scale 4 s (1 - s) rho falls as rho leaves 1 (rho = 3: 4 * 0.8808 * 0.1192 * 3 = 1.26, rho = 6: 0.24)
    logp = t([[0.0, LN(3.0), LN(6.0)]]).requires_grad_(True)
    loss, stats = sapo_policy_loss(logp, torch.zeros(1, 3, dtype=D), t([1.0]), torch.ones(1, 3), PolicyLossParams())
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    s3, s6 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-5))
    assert_close(grad, t([[-1.0, -4 * s3 * (1 - s3) * 3, -4 * s6 * (1 - s6) * 6]]))
    assert stats["clip_high"].item() == 2.0  # rho 3 and 6 are past 1 + 0.2 with A > 0


def test_policy_loss_passes_the_sapo_temperatures():
    # one token, rho 1, A -1: (4 / tau_neg) / 2 ... aggregated by dapo over one token
    loss, _ = policy_loss(
        torch.zeros(1, 1, dtype=D),
        None,
        t([-1.0]),
        torch.ones(1, 1),
        LossSettings(objective="sapo", params=PolicyLossParams(sapo_temperature_neg=2.0)),
    )
    assert loss.item() == pytest.approx(1.0)


# --------------------------------------------------------------------------
# Entropy mask
# --------------------------------------------------------------------------

H = t([[0.1, 0.2, 0.3, 0.4], [0.8, 0.9, 5.0, 5.0]])
M = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])


def test_entropy_mask_batch_scope():
    # masked values sorted [.1 .2 .3 .4 .8 .9]; quantile 0.5: rank 0.5 * 5 = 2.5 -> (0.3 + 0.4) / 2 = 0.35
    out = entropy_mask(H, M, 0.5, "batch")
    assert out.dtype == torch.bool
    assert out.tolist() == [[False, False, False, True], [True, True, False, False]]
    # quantile 0.2: rank 0.8 * 5 = 4 -> 0.8 exactly: 0.8 and 0.9 kept (at or above)
    assert entropy_mask(H, M, 0.2, "batch").tolist() == [[False] * 4, [True, True, False, False]]


def test_entropy_mask_completion_scope():
    # row 0: rank 0.5 * 3 = 1.5 -> 0.25 -> 0.3, 0.4; row 1: rank 0.5 * 1 = 0.5 -> 0.85 -> 0.9
    out = entropy_mask(H, M, 0.5, "completion")
    assert out.tolist() == [[False, False, True, True], [False, True, False, False]]


def test_entropy_mask_does_not_depend_on_the_split_at_completion_scope():
    whole = entropy_mask(H, M, 0.5, "completion")
    parts = torch.cat([entropy_mask(H[:1], M[:1], 0.5, "completion"), entropy_mask(H[1:], M[1:], 0.5, "completion")])
    assert torch.equal(whole, parts)


def test_entropy_mask_ends_and_ties():
    assert torch.equal(entropy_mask(H, M, 1.0, "batch"), M.bool())  # every masked token
    assert torch.equal(entropy_mask(H, M, 1.0, "completion"), M.bool())
    # 0.0: only the highest (0.9 over the batch; each row's own maximum per completion)
    assert entropy_mask(H, M, 0.0, "batch").sum().item() == 1 and entropy_mask(H, M, 0.0, "batch")[1, 1]
    assert entropy_mask(H, M, 0.0, "completion").tolist() == [[False, False, False, True], [False, True, False, False]]
    # ties at the threshold are all kept: four equal entropies, quantile 0.25 keeps all four
    assert entropy_mask(torch.full((1, 4), 0.5, dtype=D), torch.ones(1, 4), 0.25, "batch").all()
    # an interpolated threshold keeps fewer than quantile * n: 4 values, quantile 0.4 -> rank 1.8 -> keeps 2 (50%)...
    # and quantile 0.2 -> rank 2.4 -> keeps 1 (25%)
    four = t([[1.0, 2.0, 3.0, 4.0]])
    assert entropy_mask(four, torch.ones(1, 4), 0.2, "batch").tolist() == [[False, False, False, True]]
    # a row with no masked token keeps nothing
    assert not entropy_mask(H, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), 0.5, "completion")[1].any()
    assert not entropy_mask(H, torch.zeros(2, 4), 0.5, "batch").any()


@pytest.mark.parametrize("q", [0.05, 0.2, 0.37, 0.5, 0.9])
def test_entropy_mask_threshold_is_torch_quantiles_linear_one(q):
    gen = torch.Generator().manual_seed(int(q * 100))
    h = 3 * torch.rand(6, 9, generator=gen, dtype=D)
    mask = (torch.rand(6, 9, generator=gen) < 0.7).long()
    threshold = torch.quantile(h[mask.bool()], 1 - q)
    assert torch.equal(entropy_mask(h, mask, q, "batch"), (h >= threshold) & mask.bool())
    for i in range(6):
        row = h[i][mask[i].bool()]
        expected = (h[i] >= torch.quantile(row, 1 - q)) & mask[i].bool() if row.numel() else torch.zeros(9, dtype=torch.bool)
        assert torch.equal(entropy_mask(h, mask, q, "completion")[i], expected)


def test_entropy_mask_bad_arguments():
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        entropy_mask(H, M, 1.5, "batch")
    with pytest.raises(ValueError, match="scope"):
        entropy_mask(H, M, 0.5, "micro_batch")


def test_policy_loss_entropy_mask_drops_the_policy_term_only():
    # two tokens, rho 1, A = +1, clipped: policy term -1 each; KL (k1) = logp - ref = 0.5 each; beta 0.1
    logp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    ref = t([[-0.5, -0.5]])
    keep = torch.tensor([[True, False]])
    settings = LossSettings(beta=0.1, kl_estimator="k1")
    loss, _ = policy_loss(
        logp, None, t([1.0]), torch.ones(1, 2), settings, ref_logp=ref, entropy_mask=keep
    )
    # dapo over both tokens (the normaliser stays 2): (-1 + 0.05 + 0 + 0.05) / 2 = -0.45
    assert loss.item() == pytest.approx(-0.45)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, t([[(-1 + 0.1) / 2, 0.1 / 2]]))  # the dropped token keeps its KL gradient
    with pytest.raises(ValueError, match="entropy_mask"):
        policy_loss(logp, None, t([1.0]), torch.ones(1, 2), entropy_mask=torch.ones(1, 3, dtype=torch.bool))


# --------------------------------------------------------------------------
# Rollout correction
# --------------------------------------------------------------------------

# row 0: old - sampling = [ln 0.5, ln 2, ln 4] (token ratios 0.5, 2, 4; sequence 0.5 * 2 * 4 = 4)
# row 1: [ln 1.5, ln 0.5, padding 5.0] (ratios 1.5, 0.5; sequence 0.75)
SAMPLING = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
OLD = SAMPLING + t([[LN(0.5), LN(2.0), LN(4.0)], [LN(1.5), LN(0.5), 5.0]])
CM = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_rollout_correction_defaults_and_checks():
    c = RolloutCorrection()
    assert (c.level, c.mode, c.cap, c.floor) == ("token", "truncate", 3.0, None)  # TRL 1.16's clip_max 3.0
    for bad in (dict(level="seq"), dict(mode="clip"), dict(cap=0.0), dict(floor=3.0)):
        with pytest.raises(ValueError, match="rollout correction"):
            RolloutCorrection(**bad)


@pytest.mark.parametrize(
    "level,mode,expected",
    [
        ("token", "truncate", [[0.5, 2.0, 3.0], [1.5, 0.5, 1.0]]),  # 4 -> 3; padding 1
        ("token", "mask", [[0.5, 2.0, 0.0], [1.5, 0.5, 1.0]]),  # 4 > 3 -> 0; 0.5 kept (no floor)
        ("sequence", "truncate", [[3.0], [0.75]]),  # products 4 -> 3 and 0.75 (sum of log-ratios)
        ("sequence", "mask", [[0.0], [0.75]]),
    ],
)
def test_correction_weights(level, mode, expected):
    w = correction_weights(OLD, SAMPLING, CM, RolloutCorrection(level=level, mode=mode, cap=3.0))
    assert_close(w, t(expected))


def test_correction_floor():
    # floor 0.6: the ratios 0.5 become 0.6 (truncate) or 0 (mask)
    truncate = correction_weights(OLD, SAMPLING, CM, RolloutCorrection(mode="truncate", cap=3.0, floor=0.6))
    mask = correction_weights(OLD, SAMPLING, CM, RolloutCorrection(mode="mask", cap=3.0, floor=0.6))
    assert_close(truncate, t([[0.6, 2.0, 3.0], [1.5, 0.6, 1.0]]))
    assert_close(mask, t([[0.0, 2.0, 0.0], [1.5, 0.0, 1.0]]))


def test_correction_treats_a_missing_sampling_logprob_as_no_mismatch():
    sampling = SAMPLING.clone()
    sampling[0, 2] = float("nan")
    w = correction_weights(OLD, sampling, CM, RolloutCorrection(level="sequence", cap=3.0))
    assert_close(w, t([[1.0], [0.75]]))  # row 0: 0.5 * 2 * 1


def test_mismatch_stats():
    stats = mismatch_stats(OLD, SAMPLING, CM)
    assert set(stats) == {"logprob_diff_sum", "logprob_diff_max", "is_ratio_sum"}
    # |ln 0.5| + ln 2 + ln 4 + ln 1.5 + |ln 0.5| = 5 ln 2 + ln 1.5 = 3.8712 (padding's 5.0 left out)
    assert stats["logprob_diff_sum"].item() == pytest.approx(5 * LN(2) + LN(1.5))
    assert stats["logprob_diff_max"].item() == pytest.approx(LN(4))
    assert stats["is_ratio_sum"].item() == pytest.approx(0.5 + 2 + 4 + 1.5 + 0.5)  # 8.5
    assert all(v.dtype == D and not v.requires_grad for v in stats.values())
    tok = mismatch_stats(OLD, SAMPLING, CM, RolloutCorrection(cap=3.0))
    assert tok["is_weight_sum"].item() == pytest.approx(7.5)  # 0.5 + 2 + 3 + 1.5 + 0.5
    assert tok["is_capped"].item() == 1.0
    seq = mismatch_stats(OLD, SAMPLING, CM, RolloutCorrection(level="sequence", mode="mask", cap=3.0))
    assert seq["is_weight_sum"].item() == pytest.approx(1.5)  # row 0 masked (3 tokens x 0), row 1 2 x 0.75
    assert seq["is_capped"].item() == 3.0  # the tokens of row 0


def test_policy_loss_applies_the_correction_to_the_policy_term():
    # on-policy (old = logp): clipped's per-token loss is -A = -1 each; token truncate weights
    # [[0.5, 2, 3], [1.5, 0.5, x]], dapo over 5 tokens: -(0.5 + 2 + 3 + 1.5 + 0.5) / 5 = -1.5
    logp = OLD.clone().requires_grad_(True)
    corr = RolloutCorrection(cap=3.0)
    loss, stats = policy_loss(
        logp, None, t([1.0, 1.0]), CM, LossSettings(correction=corr), sampling_logp=SAMPLING
    )
    assert loss.item() == pytest.approx(-1.5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, -t([[0.5, 2.0, 3.0], [1.5, 0.5, 0.0]]) / 5)  # weights are constants of the gradient
    assert {"logprob_diff_sum", "logprob_diff_max", "is_ratio_sum", "is_weight_sum", "is_capped"} <= set(stats)
    # sampling_logp without a correction: statistics only, the loss unchanged
    plain, plain_stats = policy_loss(logp, None, t([1.0, 1.0]), CM)
    observed, observed_stats = policy_loss(logp, None, t([1.0, 1.0]), CM, sampling_logp=SAMPLING)
    assert observed.item() == plain.item() == pytest.approx(-1.0)
    assert "is_ratio_sum" in observed_stats and "is_weight_sum" not in observed_stats
    assert set(plain_stats) == {"clip_low", "clip_high", "clip_region"}
    with pytest.raises(ValueError, match="sampling_logp"):
        policy_loss(logp, None, t([1.0, 1.0]), CM, LossSettings(correction=corr))
