"""Hand-computed tests for the rollout correction, grpo.algorithm.correction: its settings, the
truncated or masked importance weights between the sampler and the trainer (per token or per
sequence, with a floor), the mismatch statistics, and policy_loss applying the weights to the
policy term.

Every expected number is derived by hand in the comment next to it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from grpo.algorithm import (
    LossSettings,
    RolloutCorrection,
    correction_weights,
    mismatch_stats,
    policy_loss,
)

D = torch.float64
LN = math.log


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


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
    # TRL 1.16's clip_max 3.0
    assert (c.level, c.mode, c.cap, c.floor) == (
        "token",
        "truncate",
        3.0,
        None,
    )
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
    truncate = correction_weights(
        OLD, SAMPLING, CM, RolloutCorrection(mode="truncate", cap=3.0, floor=0.6)
    )
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
    seq = mismatch_stats(
        OLD, SAMPLING, CM, RolloutCorrection(level="sequence", mode="mask", cap=3.0)
    )
    # row 0 masked (3 tokens x 0), row 1 2 x 0.75
    assert seq["is_weight_sum"].item() == pytest.approx(1.5)
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
    # weights are constants of the gradient
    assert_close(grad, -t([[0.5, 2.0, 3.0], [1.5, 0.5, 0.0]]) / 5)
    assert {
        "logprob_diff_sum",
        "logprob_diff_max",
        "is_ratio_sum",
        "is_weight_sum",
        "is_capped",
    } <= set(stats)
    # sampling_logp without a correction: statistics only, the loss unchanged
    plain, plain_stats = policy_loss(logp, None, t([1.0, 1.0]), CM)
    observed, observed_stats = policy_loss(logp, None, t([1.0, 1.0]), CM, sampling_logp=SAMPLING)
    assert observed.item() == plain.item() == pytest.approx(-1.0)
    assert "is_ratio_sum" in observed_stats and "is_weight_sum" not in observed_stats
    assert set(plain_stats) == {"clip_low", "clip_high", "clip_region"}
    with pytest.raises(ValueError, match="sampling_logp"):
        policy_loss(logp, None, t([1.0, 1.0]), CM, LossSettings(correction=corr))
