"""grpo.algorithm.policy_loss against TRL's own GRPO loss code.

TRL's `GRPOTrainer._compute_loss` is called for real, on an object made with
`GRPOTrainer.__new__` (no model, no datasets): we set only the attributes the
method reads and replace `_get_per_token_logps_and_entropies` so that it
returns our log-probability tensor. The loss math and the metric logging after
it then run on exactly our tensors, and we compare the loss value, the
gradient with respect to logp and the clip / KL metrics.

Mapping of the batch arguments (one process):
  grpo:    TRL mean over the micro-batch / gradient_accumulation_steps
           == ours with num_sequences = micro-batch size * accumulation steps
  bnpo:    TRL / gradient_accumulation_steps == ours with num_minibatches = steps
  dr_grpo: TRL sum / (B * max_completion_length * accumulation steps)
           == ours with num_sequences = B * steps
  dapo:    TRL sum / (num_items_in_batch * accumulation steps / steps_per_generation)
           == ours with num_tokens = that product (the tokens of the window)

Differences by design (not tested as equal):
  * TRL's KL term is always k3 (ours also offers k1, k2); its multiplication by
    the ratio (use_bias_correction_kl) is algorithm.kl_bias_correction, tested
    at the end of this file with the other TRL 1.16 options.
  * At sequence level TRL's clip metrics are means over sequences, ours are
    token counts (the caller divides by the token count), so the clip metrics
    are compared at token level only.
  * TRL decides "clipped high" on the ratio after the delta cap; ours on the
    raw ratio. They agree whenever delta > 1 + epsilon_high (TRL's own
    recommendation), which is what we test.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from grpo.algorithm import (  # noqa: E402
    LossNormalisers,
    LossSettings,
    PolicyLossParams,
    policy_loss,
)

D = torch.float64
MAX_LEN = 7


class _OneProcessAccelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _trl_loss(
    *,
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    loss_type,
    level,
    beta,
    eps_low,
    eps_high,
    delta,
    grad_accum=1,
    steps_per_generation=1,
    num_items_in_batch=None,
    entropies=None,
    top_entropy_quantile=1.0,
    importance_sampling_ratio=None,
    sampling_logp=None,
    off_policy_mask_threshold=None,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    sync_gradients=True,
    trainer=None,
    out=None,
    **extra_args,
):
    """Run TRL 1.16's GRPOTrainer._compute_loss on our tensors; return (loss, metrics).

    entropies: the per-token entropies TRL's forward pass returns (random by default);
    top_entropy_quantile: TRL's; importance_sampling_ratio: the vLLM correction's
    weights as TRL's generation step stores them (turns TRL's correction on);
    extra_args: more TRL config fields (e.g. sapo_temperature_pos, use_bias_correction_kl);
    sampling_logp: TRL's sampling_per_token_logps input; off_policy_mask_threshold, entropy_coef,
    use_adaptive_entropy: TRL's; sync_gradients: whether this micro-batch ends TRL's accumulation
    window; trainer: a trainer made by an earlier call, to go on with (its entropy controller
    state); out: a list the trainer is appended to."""
    if trainer is None:
        trainer = GRPOTrainer.__new__(GRPOTrainer)
        trainer.importance_sampling_level = level
        trainer.loss_type = loss_type
        trainer.epsilon_low = eps_low
        trainer.epsilon_high = eps_high
        trainer.beta = beta
        trainer.max_completion_length = MAX_LEN
        trainer.top_entropy_quantile = top_entropy_quantile
        trainer.off_policy_mask_threshold = off_policy_mask_threshold
        trainer.use_vllm = importance_sampling_ratio is not None
        trainer.vllm_importance_sampling_correction = importance_sampling_ratio is not None
        trainer.entropy_coef = entropy_coef
        trainer.use_adaptive_entropy = use_adaptive_entropy
        trainer._entropy_bonus_enabled = entropy_coef != 0.0 or use_adaptive_entropy
        # the entropy of the previous optimizer step (inf before the first, as TRL starts)
        trainer._last_world_entropy = extra_args.pop("last_world_entropy", float("inf"))
        trainer._entropy_window_stats = None
        trainer.aux_loss_enabled = False
        trainer.accelerator = _OneProcessAccelerator()
        trainer.model = SimpleNamespace(training=True)
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        extra_args.setdefault("use_bias_correction_kl", False)
        trainer.args = SimpleNamespace(
            delta=delta, steps_per_generation=steps_per_generation, **extra_args
        )
    trainer.current_gradient_accumulation_steps = grad_accum
    trainer.accelerator.sync_gradients = sync_gradients
    if out is not None:
        out.append(trainer)
    if entropies is None:
        entropies = torch.rand(mask.shape, dtype=D, generator=torch.Generator().manual_seed(1))
    calls = []

    def fake_logps(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        calls.append(logits_to_keep)
        return logp, entropies, None

    trainer._get_per_token_logps_and_entropies = fake_logps
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch,
    }
    if old_logp is not None:
        inputs["old_per_token_logps"] = old_logp
    if beta != 0.0:
        inputs["ref_per_token_logps"] = ref_logp
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    if sampling_logp is not None:
        inputs["sampling_per_token_logps"] = sampling_logp
    loss = trainer._compute_loss(trainer.model, inputs)
    assert calls == [T]  # our tensors really were the ones used
    return loss, trainer._metrics["train"]


def _tensors(seed, B=8, T=MAX_LEN, all_masked_row=True):
    gen = torch.Generator().manual_seed(seed)
    logp = (-3.0 * torch.rand(B, T, generator=gen, dtype=D)).requires_grad_(True)
    # log ratios of std 0.4: ratios roughly 0.4 .. 2.5, on both sides of the clip range and past delta
    old = logp.detach() + 0.4 * torch.randn(B, T, generator=gen, dtype=D)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=gen, dtype=D)
    # advantages of alternating sign, so that both clipping sides are hit
    adv = torch.randn(B, generator=gen, dtype=D).abs() * torch.tensor(
        [1.0, -1.0] * (B // 2), dtype=D
    )
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[:4] = T  # full rows, two of each advantage sign
    lengths[4] = 2  # a short row
    if all_masked_row:
        lengths[-1] = 0
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return logp, old, ref, adv, mask


CONFIGS = {
    # name: (epsilon_low, epsilon_high, delta)
    "symmetric": (0.2, 0.2, None),
    "clip_higher_delta": (0.2, 0.28, 1.5),
}


CASES = list(
    itertools.product(
        ["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], [0.0, 0.04], CONFIGS
    )
)


@pytest.mark.parametrize("loss_type,level,beta,config", CASES)
def test_loss_and_gradient_match_trl(loss_type, level, beta, config):
    eps_low, eps_high, delta = CONFIGS[config]
    logp, old, ref, adv, mask = _tensors(seed=CASES.index((loss_type, level, beta, config)))
    trl_loss, metrics = _trl_loss(
        logp=logp,
        old_logp=old,
        ref_logp=ref,
        advantages=adv,
        mask=mask,
        loss_type=loss_type,
        level=level,
        beta=beta,
        eps_low=eps_low,
        eps_high=eps_high,
        delta=delta,
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    ours, stats = policy_loss(
        logp,
        old,
        adv,
        mask,
        LossSettings(
            loss_type=loss_type,
            params=PolicyLossParams(
                epsilon=eps_low,
                epsilon_high=eps_high,
                delta=delta,
                importance_sampling_level=level,
            ),
            beta=beta,
            kl_estimator="k3",
        ),
        LossNormalisers(max_completion_length=MAX_LEN, num_tokens=mask.sum()),
        ref_logp=ref if beta else None,
    )
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert our_grad.abs().sum() > 0  # a non-trivial comparison
    assert (our_grad[mask == 0] == 0).all()  # padding gets no gradient

    n_tok = mask.sum().item()
    if beta:
        assert metrics["kl"] == [pytest.approx(stats["kl"].item() / n_tok, rel=1e-9)]
    else:
        assert "kl" not in metrics
    if level == "token":
        for ours_key, trl_key in (
            ("clip_low", "clip_ratio/low_mean"),
            ("clip_high", "clip_ratio/high_mean"),
            ("clip_region", "clip_ratio/region_mean"),
        ):
            # TRL casts the clip flags to float32 before averaging
            assert metrics[trl_key] == [pytest.approx(stats[ours_key].item() / n_tok, rel=1e-6)]
        # the random ratios really exercise both clipping sides
        assert stats["clip_low"].item() > 0 and stats["clip_high"].item() > 0
        if delta is not None:  # ... and the delta cap (a negative advantage with ratio > delta)
            capped = (torch.exp(logp - old) > delta) & (adv.unsqueeze(1) < 0) & mask.bool()
            assert capped.any()


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_matches_trl(loss_type, level):
    # no old_per_token_logps: TRL uses per_token_logps.detach(), ours old_logp=None
    logp, _, ref, adv, mask = _tensors(seed=7)
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=None, ref_logp=ref, advantages=adv, mask=mask, loss_type=loss_type,
        level=level, beta=0.04, eps_low=0.2, eps_high=0.28, delta=None,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        loss_type=loss_type,
        params=PolicyLossParams(epsilon_high=0.28, importance_sampling_level=level),
        beta=0.04,
    )
    norms = LossNormalisers(max_completion_length=MAX_LEN, num_tokens=mask.sum())
    ours, stats = policy_loss(logp, None, adv, mask, settings, norms, ref_logp=ref)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert stats["clip_region"].item() == 0.0
    assert metrics["clip_ratio/region_mean"] == [0.0]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_gradient_accumulation_mapping_matches_trl(loss_type):
    # A generation batch of 2 micro-batches of 4 sequences, accumulated over 2 steps (steps_per_generation 2).
    # Each micro-batch: ours with num_sequences = 8, num_minibatches = 2, num_tokens = all 2-piece tokens,
    # TRL with current_gradient_accumulation_steps = 2 and num_items_in_batch = all tokens.
    # (Micro-batches have equal sizes, which TRL's grpo / dr_grpo scaling assumes.)
    logp, old, ref, adv, mask = _tensors(seed=11, all_masked_row=False)
    total_tokens = mask.sum()
    trl_total, ours_total = 0.0, 0.0
    settings = LossSettings(
        loss_type=loss_type, params=PolicyLossParams(epsilon_high=0.28, delta=1.5), beta=0.04
    )
    norms = LossNormalisers(
        max_completion_length=MAX_LEN, num_sequences=8, num_tokens=total_tokens, num_minibatches=2
    )
    for rows in (slice(0, 4), slice(4, 8)):
        kw = dict(old_logp=old[rows], ref_logp=ref[rows], advantages=adv[rows], mask=mask[rows])
        trl_loss, _ = _trl_loss(
            logp=logp[rows], loss_type=loss_type, level="token", beta=0.04, eps_low=0.2, eps_high=0.28,
            delta=1.5, grad_accum=2, steps_per_generation=2, num_items_in_batch=total_tokens, **kw,
        )  # fmt: skip
        ours, _ = policy_loss(
            logp[rows], old[rows], adv[rows], mask[rows], settings, norms, ref_logp=ref[rows]
        )
        assert_close(ours, trl_loss)
        trl_total = trl_total + trl_loss
        ours_total = ours_total + ours
    (trl_grad,) = torch.autograd.grad(trl_total, logp)
    (our_grad,) = torch.autograd.grad(ours_total, logp)
    assert_close(our_grad, trl_grad)
    if loss_type != "bnpo":
        # the accumulated loss is the whole batch's loss, as if it had not been split
        one_piece = LossNormalisers(max_completion_length=MAX_LEN)
        whole, _ = policy_loss(logp, old, adv, mask, settings, one_piece, ref_logp=ref)
        assert_close(ours_total, whole)


# --------------------------------------------------------------------------
# cispo, sapo, the entropy mask and the rollout correction against TRL
#
# TRL's loss_type "cispo" = our policy loss cispo + aggregation dapo (epsilon_high is
# the cap of the ratio); "sapo" = our sapo + aggregation grpo. TRL's top_entropy_quantile
# is our entropy_mask at scope "batch" over the tensors of one forward pass. TRL computes
# its vLLM importance-sampling weights while generating (not callable without a model), so
# the weights are checked by hand in tests/algorithm/test_correction.py; here TRL is given our
# weights and we check that both apply them to the loss the same way.
# --------------------------------------------------------------------------

from grpo.algorithm import RolloutCorrection, correction_weights, entropy_mask  # noqa: E402


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("cap", [1.5, 5.0])
def test_cispo_matches_trl(level, beta, cap):
    logp, old, ref, adv, mask = _tensors(seed=21)
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type="cispo", level=level,
        beta=beta, eps_low=0.2, eps_high=cap, delta=None,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        objective="cispo",
        loss_type="dapo",
        params=PolicyLossParams(epsilon_high=cap, importance_sampling_level=level),
        beta=beta,
    )
    norms = LossNormalisers(num_tokens=mask.sum())
    ours, stats = policy_loss(logp, old, adv, mask, settings, norms, ref_logp=ref if beta else None)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert our_grad.abs().sum() > 0
    if level == "token":
        # TRL's cispo_clip_ratio: capped tokens with a positive advantage, over the masked tokens
        assert metrics["cispo_clip_ratio"] == [
            pytest.approx(stats["clip_high"].item() / mask.sum().item(), rel=1e-6)
        ]
        if cap == 1.5:
            assert stats["clip_high"].item() > 0 and stats["clip_low"].item() > 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("temperatures", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_matches_trl(level, beta, temperatures):
    tau_pos, tau_neg = temperatures
    logp, old, ref, adv, mask = _tensors(seed=22)
    trl_loss, _ = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type="sapo", level=level,
        beta=beta, eps_low=0.2, eps_high=0.2, delta=None, sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        objective="sapo",
        loss_type="grpo",
        params=PolicyLossParams(
            importance_sampling_level=level,
            sapo_temperature_pos=tau_pos,
            sapo_temperature_neg=tau_neg,
        ),
        beta=beta,
    )
    ours, _ = policy_loss(logp, old, adv, mask, settings, ref_logp=ref if beta else None)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert our_grad.abs().sum() > 0


def _trl_entropy_mask(entropies, mask, quantile):
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.accelerator = _OneProcessAccelerator()
    return trainer.get_high_entropy_mask(entropies, mask, 1 - quantile)


@pytest.mark.parametrize("quantile", [0.0, 0.1, 0.2, 0.5, 0.8, 1.0])
def test_entropy_mask_matches_trls_threshold(quantile):
    gen = torch.Generator().manual_seed(int(quantile * 10))
    _, _, _, _, mask = _tensors(seed=23)
    entropies = 4 * torch.rand(mask.shape, generator=gen)  # float32, as the trainer's
    entropies[0, :4] = entropies[1, 0]  # ties
    ours = entropy_mask(entropies, mask, quantile, "batch")
    assert torch.equal(ours, _trl_entropy_mask(entropies, mask, quantile))
    assert ours.sum() >= 1


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_with_entropy_mask_matches_trl(loss_type):
    logp, old, ref, adv, mask = _tensors(seed=24)
    entropies = 4 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(5))
    trl_loss, _ = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type=loss_type, level="token",
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, entropies=entropies, top_entropy_quantile=0.2,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    keep = entropy_mask(entropies, mask, 0.2, "batch")
    settings = LossSettings(
        loss_type=loss_type, params=PolicyLossParams(epsilon_high=0.28), beta=0.04
    )
    norms = LossNormalisers(num_tokens=mask.sum())
    ours, _ = policy_loss(logp, old, adv, mask, settings, norms, ref_logp=ref, entropy_mask=keep)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    # the dropped tokens keep the KL's gradient only
    dropped = mask.bool() & ~keep
    assert dropped.any() and (our_grad[dropped] != 0).all()


@pytest.mark.parametrize(
    "objective,trl_loss_type,loss_type", [("clipped", "dapo", "dapo"), ("sapo", "sapo", "grpo")]
)
@pytest.mark.parametrize(
    "level,mode",
    [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"), ("sequence", "mask")],
)
def test_rollout_correction_is_applied_as_trl_applies_it(
    objective, trl_loss_type, loss_type, level, mode
):
    logp, old, ref, adv, mask = _tensors(seed=25)
    # a sampler a little off the trainer, so that some weights pass the cap of 1.2
    sampling = old + 0.15 * torch.randn(
        mask.shape, dtype=D, generator=torch.Generator().manual_seed(6)
    )
    correction = RolloutCorrection(level=level, mode=mode, cap=1.2)
    weights = correction_weights(old, sampling, mask, correction)
    trl_loss, _ = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type=trl_loss_type, level="token",
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, importance_sampling_ratio=weights,
        sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        objective=objective,
        loss_type=loss_type,
        params=PolicyLossParams(epsilon_high=0.28),
        beta=0.04,
        correction=correction,
    )
    norms = LossNormalisers(num_tokens=mask.sum())
    ours, stats = policy_loss(
        logp, old, adv, mask, settings, norms, ref_logp=ref, sampling_logp=sampling
    )
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert stats["is_capped"].item() > 0  # the cap really acted


# --------------------------------------------------------------------------
# TRL 1.16's further options: luspo, vespo, the off-policy mask, the bias-corrected KL,
# the entropy bonus (fixed and adaptive) and GDPO's normalize_then_sum
#
# TRL's loss_type "luspo" = our policy loss clipped + aggregation luspo; "vespo" = our
# policy loss vespo + aggregation dapo. TRL's static methods get_gamma_weights and
# get_off_policy_mask are called directly, and _compute_loss with each option on. The
# tensors are float64 and the results equal to assert_close's float64 tolerance (rtol
# 1e-7): the two sides sum the same terms in a different order or form (the bonus as a
# mean times the piece's share of 1, the ratio's exp before or after a broadcast).
# --------------------------------------------------------------------------

import inspect  # noqa: E402
import textwrap  # noqa: E402

from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

from grpo.algorithm import (  # noqa: E402
    gamma_weights,
    next_entropy_coef,
    normalize_then_sum_advantages,
    off_policy_mask,
)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_luspo_matches_trl(level, beta):
    logp, old, ref, adv, mask = _tensors(seed=31)
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type="luspo", level=level,
        beta=beta, eps_low=0.2, eps_high=0.28, delta=None,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        loss_type="luspo",
        params=PolicyLossParams(epsilon_high=0.28, importance_sampling_level=level),
        beta=beta,
    )
    ours, stats = policy_loss(logp, old, adv, mask, settings, ref_logp=ref if beta else None)
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert our_grad.abs().sum() > 0
    if level == "token":
        assert metrics["clip_ratio/region_mean"] == [
            pytest.approx(stats["clip_region"].item() / mask.sum().item(), rel=1e-6)
        ]


def test_luspo_gradient_accumulation_matches_trl():
    # 2 micro-batches of 4 accumulated (TRL: gradient_accumulation_steps 2, each micro-batch's
    # mean over its 4 sequences / 2) == ours with num_sequences = 8 counted over the batch
    logp, old, ref, adv, mask = _tensors(seed=32, all_masked_row=False)
    settings = LossSettings(
        loss_type="luspo", params=PolicyLossParams(epsilon_high=0.28), beta=0.04
    )
    norms = LossNormalisers(num_sequences=8, num_minibatches=2)
    trl_total, ours_total = 0.0, 0.0
    for rows in (slice(0, 4), slice(4, 8)):
        kw = dict(old_logp=old[rows], ref_logp=ref[rows], advantages=adv[rows], mask=mask[rows])
        trl_loss, _ = _trl_loss(
            logp=logp[rows], loss_type="luspo", level="token", beta=0.04, eps_low=0.2, eps_high=0.28,
            delta=None, grad_accum=2, steps_per_generation=2, **kw,
        )  # fmt: skip
        ours, _ = policy_loss(
            logp[rows], old[rows], adv[rows], mask[rows], settings, norms, ref_logp=ref[rows]
        )
        assert_close(ours, trl_loss)
        trl_total, ours_total = trl_total + trl_loss, ours_total + ours
    assert_close(torch.autograd.grad(ours_total, logp)[0], torch.autograd.grad(trl_total, logp)[0])
    # ... and the sum is the whole batch's luspo loss, unsplit
    whole, _ = policy_loss(logp, old, adv, mask, settings, ref_logp=ref)
    assert_close(ours_total, whole)


VESPO_PARAMS = {
    "trl_defaults": (2.0, 3.0, 3.0, 2.0),
    "other": (1.5, 0.5, 4.0, 1.25),
}


@pytest.mark.parametrize("params", VESPO_PARAMS)
@pytest.mark.parametrize("correction", [None, "truncate", "mask"])
def test_gamma_weights_match_trls(params, correction):
    k_pos, lambda_pos, k_neg, lambda_neg = VESPO_PARAMS[params]
    logp, old, _, adv, mask = _tensors(seed=33)
    # log-ratios of std 0.4 summed over up to 7 tokens: w from ~0.1 to ~10, both sides of 1
    log_ratio = (logp - old).detach()
    weights = None
    if correction is not None:
        sampling = old + 0.3 * torch.randn(
            mask.shape, dtype=D, generator=torch.Generator().manual_seed(3)
        )
        rc = RolloutCorrection(level="token", mode=correction, cap=1.2)
        weights = correction_weights(old, sampling, mask, rc)
    trl = GRPOTrainer.get_gamma_weights(
        adv.unsqueeze(1), log_ratio, mask, weights, k_pos, lambda_pos, k_neg, lambda_neg
    )
    ours = gamma_weights(adv, log_ratio, mask, weights, k_pos, lambda_pos, k_neg, lambda_neg)
    assert_close(ours, trl)
    assert (ours > 0).any() and (ours < 0.5).any()  # far from 1 on some rows: a real comparison
    if correction == "mask":
        assert (weights == 0).any()  # a masked weight, which both count as 1e-8


@pytest.mark.parametrize("correction", [None, "token_truncate", "token_mask"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_vespo_matches_trl(correction, beta):
    logp, old, ref, adv, mask = _tensors(seed=34)
    # smaller log-ratios than the clipped tests' so that phi stays away from 0 on most rows
    old = logp.detach() + 0.1 * (old - logp.detach())
    weights = sampling = rc = None
    if correction is not None:
        sampling = old + 0.05 * torch.randn(
            mask.shape, dtype=D, generator=torch.Generator().manual_seed(4)
        )
        level, mode = correction.split("_")
        rc = RolloutCorrection(level=level, mode=mode, cap=1.05)
        weights = correction_weights(old, sampling, mask, rc)
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type="vespo", level="token",
        beta=beta, eps_low=0.2, eps_high=0.2, delta=None, importance_sampling_ratio=weights,
        vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(objective="vespo", loss_type="dapo", beta=beta, correction=rc)
    ours, stats = policy_loss(
        logp, old, adv, mask, settings, ref_logp=ref if beta else None, sampling_logp=sampling
    )
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert our_grad.abs().sum() > 0
    # TRL's vespo/phi_seq_mean: the mean of phi over the rows
    assert metrics["vespo/phi_seq_mean"] == [
        pytest.approx(stats["phi_seq_sum"].item() / mask.shape[0], rel=1e-12)
    ]


@pytest.mark.parametrize("threshold", [0.05, 0.2, 1.0])
def test_off_policy_mask_matches_trls(threshold):
    logp, old, _, adv, mask = _tensors(seed=35)
    sampling = old.clone()
    sampling[1, 2] = float("nan")  # a token the engine could not score
    trl = GRPOTrainer.get_off_policy_mask(adv.unsqueeze(1), logp, sampling, mask, threshold)
    ours = off_policy_mask(adv, logp, sampling, mask, threshold)
    assert torch.equal(ours, trl)
    if threshold == 0.2:
        assert (ours == 0).any() and (ours == 1).any()


@pytest.mark.parametrize("with_sampling", [False, True])
@pytest.mark.parametrize(
    "loss_type,objective", [("dapo", "clipped"), ("grpo", "clipped"), ("luspo", "clipped")]
)
def test_loss_with_off_policy_mask_matches_trl(with_sampling, loss_type, objective):
    logp, old, ref, adv, mask = _tensors(seed=36)
    # the engine's logprobs (TRL: sampling_per_token_logps), else TRL and ours use pi_old
    sampling = (
        old + 0.3 * torch.randn(mask.shape, dtype=D, generator=torch.Generator().manual_seed(7))
        if with_sampling
        else None
    )
    trl_loss, _ = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type=loss_type, level="token",
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, sampling_logp=sampling, off_policy_mask_threshold=0.05,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        objective=objective,
        loss_type=loss_type,
        params=PolicyLossParams(epsilon_high=0.28),
        beta=0.04,
        off_policy_mask_threshold=0.05,
    )
    norms = LossNormalisers(num_tokens=mask.sum())
    ours, stats = policy_loss(
        logp, old, adv, mask, settings, norms, ref_logp=ref, sampling_logp=sampling
    )
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert stats["off_policy_masked"].item() >= 1  # the mask really dropped a sequence


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_bias_corrected_kl_matches_trl(level, on_policy):
    logp, old, ref, adv, mask = _tensors(seed=37)
    old = None if on_policy else old
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type="dapo", level=level,
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=1.5, use_bias_correction_kl=True,
    )  # fmt: skip
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)
    settings = LossSettings(
        loss_type="dapo",
        params=PolicyLossParams(epsilon_high=0.28, delta=1.5, importance_sampling_level=level),
        beta=0.04,
        kl_bias_correction=True,
    )
    ours, stats = policy_loss(
        logp, old, adv, mask, settings, LossNormalisers(num_tokens=mask.sum()), ref_logp=ref
    )
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert_close(ours, trl_loss)
    assert_close(our_grad, trl_grad)
    assert metrics["kl"] == [pytest.approx(stats["kl"].item() / mask.sum().item(), rel=1e-9)]
    # the correction changes the gradient (on policy too: the ratio is not detached)
    plain, _ = policy_loss(
        logp, old, adv, mask, dataclasses.replace(settings, kl_bias_correction=False),
        LossNormalisers(num_tokens=mask.sum()), ref_logp=ref,
    )  # fmt: skip
    assert (torch.autograd.grad(plain, logp)[0] - our_grad).abs().max() > 1e-6


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
@pytest.mark.parametrize("quantile", [1.0, 0.2])
def test_entropy_bonus_matches_trl(loss_type, quantile):
    logp, old, ref, adv, mask = _tensors(seed=38)
    # float32 values in float64: TRL takes its entropy threshold in float32, ours in float64
    entropies = (
        (4 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(8))).to(D)
    ).requires_grad_(True)
    trl_loss, metrics = _trl_loss(
        logp=logp, old_logp=old, ref_logp=ref, advantages=adv, mask=mask, loss_type=loss_type, level="token",
        beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, entropies=entropies,
        top_entropy_quantile=quantile, entropy_coef=0.03,
    )  # fmt: skip
    trl_grads = torch.autograd.grad(trl_loss, (logp, entropies))
    keep = entropy_mask(entropies, mask, quantile, "batch") if quantile < 1 else None
    settings = LossSettings(
        loss_type=loss_type, params=PolicyLossParams(epsilon_high=0.28), beta=0.04
    )
    ours, stats = policy_loss(
        logp, old, adv, mask, settings, LossNormalisers(num_tokens=mask.sum()), ref_logp=ref,
        entropy_mask=keep, entropy=entropies, entropy_coef=0.03,
    )  # fmt: skip
    our_grads = torch.autograd.grad(ours, (logp, entropies))
    assert_close(ours, trl_loss)
    for a, b in zip(our_grads, trl_grads):
        assert_close(a, b)
    assert (our_grads[1][mask.bool() if keep is None else keep] != 0).all()  # the bonus's gradient
    assert metrics["policy_loss"] == [pytest.approx(stats["policy_loss"].item(), rel=1e-12)]
    assert metrics["entropy_coef"] == [0.03]


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_adaptive_entropy_step_matches_trl(quantile):
    """One TRL optimizer step of 2 accumulated micro-batches with the adaptive controller, against
    one grpo pass of 2 minibatches: the applied coefficient (gated on the last entropy), the
    losses and gradients, and the coefficient the controller leaves for the next step."""
    logp, old, ref, adv, mask = _tensors(seed=39, all_masked_row=False)
    # float32 values in float64: TRL takes its entropy threshold in float32, ours in float64
    entropies = (
        (0.4 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(9))).to(D)
    ).requires_grad_(True)
    target, delta, lo, hi = 0.25, 0.005, 0.0, 1.0
    extra = dict(
        entropy_target=target, entropy_coef_delta=delta, entropy_coef_min=lo, entropy_coef_max=hi
    )
    settings = LossSettings(loss_type="dapo", params=PolicyLossParams(epsilon_high=0.28), beta=0.04)
    for last_entropy in (
        float("inf"),
        0.1,
    ):  # the first step (no bonus), then one with the gate open
        made = []
        coef = 0.02
        trl_total, ours_total = 0.0, 0.0
        window = [0.0, 0.0]
        applied = coef if last_entropy <= target else 0.0
        for i, rows in enumerate((slice(0, 4), slice(4, 8))):
            kw = dict(old_logp=old[rows], ref_logp=ref[rows], advantages=adv[rows], mask=mask[rows])
            trl_loss, _ = _trl_loss(
                logp=logp[rows], loss_type="dapo", level="token", beta=0.04, eps_low=0.2, eps_high=0.28,
                delta=None, grad_accum=2, steps_per_generation=2, num_items_in_batch=mask.sum(),
                entropies=entropies[rows], top_entropy_quantile=quantile, entropy_coef=coef,
                use_adaptive_entropy=True, sync_gradients=i == 1, trainer=made[0] if made else None,
                out=made, last_world_entropy=last_entropy, **extra, **kw,
            )  # fmt: skip
            keep = (
                entropy_mask(entropies[rows], mask[rows], quantile, "batch")
                if quantile < 1
                else None
            )
            norms = LossNormalisers(num_sequences=8, num_tokens=mask.sum(), num_minibatches=2)
            ours, _ = policy_loss(
                logp[rows], old[rows], adv[rows], mask[rows], settings, norms, ref_logp=ref[rows],
                entropy_mask=keep, entropy=entropies[rows], entropy_coef=applied,
            )  # fmt: skip
            acted_on = mask[rows] if keep is None else mask[rows] * keep
            window[0] += (entropies[rows] * acted_on).sum().item()
            window[1] += acted_on.sum().item()
            trl_total, ours_total = trl_total + trl_loss, ours_total + ours
        assert_close(ours_total, trl_total)
        # (a step that applies no bonus leaves the entropies out of our graph: a zero gradient)
        grad = dict(allow_unused=True, materialize_grads=True)
        for a, b in zip(
            torch.autograd.grad(ours_total, (logp, entropies), **grad),
            torch.autograd.grad(trl_total, (logp, entropies), **grad),
        ):
            assert_close(a, b)
        world = window[0] / max(1.0, window[1])
        assert made[0]._last_world_entropy == pytest.approx(world, rel=1e-12)
        assert made[0].entropy_coef == next_entropy_coef(coef, world, target, delta, lo, hi)
        assert made[0].entropy_coef != coef  # the controller moved


def _trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    """TRL 1.16's own lines for multi_objective_aggregation="normalize_then_sum" (the branch of
    GRPOTrainer._generate_and_score_completions, read from TRL's installed source and run as
    written), then its NaN-to-0 of the advantages."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    start = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    indent = source[source.rindex("\n", 0, start) + 1 : start]
    end = source.index(f"\n{indent}else:", start)
    block = textwrap.dedent(source[start:end].split("\n", 1)[1])
    scope = {
        "torch": torch,
        "nanstd": trl_nanstd,
        "rewards_per_func": rewards_per_func,
        "num_generations": num_generations,
        "device": rewards_per_func.device,
        "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1),
        "self": SimpleNamespace(
            reward_funcs=[None] * rewards_per_func.shape[1], reward_weights=weights
        ),
    }
    exec(compile(block, "trl_normalize_then_sum", "exec"), scope)
    return torch.nan_to_num(scope["advantages"], nan=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalize_then_sum_matches_trl(seed):
    gen = torch.Generator().manual_seed(seed)
    G, K = 4, 3
    rewards = torch.randn(6 * G, K, generator=gen, dtype=D) * torch.tensor(
        [1.0, 10.0, 0.1], dtype=D
    )
    rewards[:, 2] = (rewards[:, 2] > 0).to(D)  # a 0/1 function, with groups of zero spread
    rewards[0:G, 2] = 1.0
    missing = torch.rand(6 * G, K, generator=gen) < 0.15
    rewards[missing] = float("nan")
    rewards[5] = float("nan")  # a completion with no reward at all
    rewards[G + 1 : 2 * G, 1] = float("nan")  # a function with one value in a group
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=D)
    trl = _trl_normalize_then_sum(rewards, weights, G)
    ours = normalize_then_sum_advantages(rewards, weights, G)
    assert_close(ours, trl)
    assert ours[5].item() == 0.0 and ours.abs().sum() > 1
