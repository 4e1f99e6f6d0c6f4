"""Hand-computed tests for grpo.algorithm.losses: importance weights, the clipped surrogate and
the KL estimators, the loss aggregations (and their invariance to how a batch is split),
policy_loss, the policy losses cispo and sapo, per-token advantages and the entropy mask.

Every expected number is derived by hand in the comment next to it. Tensors are float64
where a check is to float precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from grpo.algorithm import (
    LossNormalisers,
    LossSettings,
    PolicyLossParams,
    aggregate_loss,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_surrogate,
    entropy_from_logits,
    entropy_mask,
    kl_estimate,
    log_importance_weights,
    masked_mean,
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
    assert (
        stats["clip_low"].item() == stats["clip_high"].item() == stats["clip_region"].item() == 0.0
    )
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
# Small helpers
# --------------------------------------------------------------------------


def test_masked_mean_and_entropy():
    # (1 + 3)/2 = 2; empty mask -> 0
    assert masked_mean(t([1.0, X, 3.0]), torch.tensor([1, 0, 1])).item() == 2.0
    assert masked_mean(t([1.0, 2.0]), torch.tensor([0, 0])).item() == 0.0
    # uniform over 4 -> ln 4; one-hot-ish (huge gap) -> ~0
    assert_close(entropy_from_logits(torch.zeros(1, 4)), torch.tensor([math.log(4.0)]))
    assert entropy_from_logits(torch.tensor([[0.0, -100.0]])).item() < 1e-6


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
        loss, stats = cispo_policy_loss(
            logp, old, t([1.0]), torch.ones(1, 1), PolicyLossParams(epsilon_high=cap)
        )
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
    cispo, _ = cispo_policy_loss(
        logp, old, t([1.0]), torch.ones(1, 1), PolicyLossParams(epsilon_high=5.0)
    )
    assert torch.autograd.grad(cispo.sum(), logp)[0].item() == pytest.approx(-2.0)


def test_cispo_stats_split_the_capped_tokens_by_sign():
    # ratios [3, 0.5, 3, 3(padding)], advantages +1, +1, -1 (row 1); cap 2
    logp = t([[LN(3.0), LN(0.5)], [LN(3.0), LN(3.0)]])
    old = torch.zeros(2, 2, dtype=D)
    mask = torch.tensor([[1, 1], [1, 0]])
    _, stats = cispo_policy_loss(
        logp, old, t([1.0, -1.0]), mask, PolicyLossParams(epsilon_high=2.0)
    )
    # token (0, 0): capped with A > 0 (TRL's cispo_clip_ratio)
    assert stats["clip_high"].item() == 1.0
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
    loss, stats = sapo_policy_loss(
        logp, torch.zeros(1, 3, dtype=D), t([1.0]), torch.ones(1, 3), PolicyLossParams()
    )
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
    parts = torch.cat(
        [
            entropy_mask(H[:1], M[:1], 0.5, "completion"),
            entropy_mask(H[1:], M[1:], 0.5, "completion"),
        ]
    )
    assert torch.equal(whole, parts)


def test_entropy_mask_ends_and_ties():
    assert torch.equal(entropy_mask(H, M, 1.0, "batch"), M.bool())  # every masked token
    assert torch.equal(entropy_mask(H, M, 1.0, "completion"), M.bool())
    # 0.0: only the highest (0.9 over the batch; each row's own maximum per completion)
    assert (
        entropy_mask(H, M, 0.0, "batch").sum().item() == 1
        and entropy_mask(H, M, 0.0, "batch")[1, 1]
    )
    assert entropy_mask(H, M, 0.0, "completion").tolist() == [
        [False, False, False, True],
        [False, True, False, False],
    ]
    # ties at the threshold are all kept: four equal entropies, quantile 0.25 keeps all four
    assert entropy_mask(torch.full((1, 4), 0.5, dtype=D), torch.ones(1, 4), 0.25, "batch").all()
    # an interpolated threshold keeps fewer than quantile * n: 4 values, quantile 0.4 -> rank 1.8 -> keeps 2 (50%)...
    # and quantile 0.2 -> rank 2.4 -> keeps 1 (25%)
    four = t([[1.0, 2.0, 3.0, 4.0]])
    assert entropy_mask(four, torch.ones(1, 4), 0.2, "batch").tolist() == [
        [False, False, False, True]
    ]
    # a row with no masked token keeps nothing
    assert not entropy_mask(H, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), 0.5, "completion")[
        1
    ].any()
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
        expected = (
            (h[i] >= torch.quantile(row, 1 - q)) & mask[i].bool()
            if row.numel()
            else torch.zeros(9, dtype=torch.bool)
        )
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
        policy_loss(
            logp, None, t([1.0]), torch.ones(1, 2), entropy_mask=torch.ones(1, 3, dtype=torch.bool)
        )
