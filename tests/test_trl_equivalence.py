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
  * TRL's KL term is always k3 (ours also offers k1, k2) and TRL can multiply
    it by the ratio (use_bias_correction_kl); we compare k3 without that.
  * At sequence level TRL's clip metrics are means over sequences, ours are
    token counts (the caller divides by the token count), so the clip metrics
    are compared at token level only.
  * TRL decides "clipped high" on the ratio after the delta cap; ours on the
    raw ratio. They agree whenever delta > 1 + epsilon_high (TRL's own
    recommendation), which is what we test.
"""

from __future__ import annotations

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
    **extra_args,
):
    """Run TRL 1.16's GRPOTrainer._compute_loss on our tensors; return (loss, metrics).

    entropies: the per-token entropies TRL's forward pass returns (random by default);
    top_entropy_quantile: TRL's; importance_sampling_ratio: the vLLM correction's
    weights as TRL's generation step stores them (turns TRL's correction on);
    extra_args: more TRL config fields (e.g. sapo_temperature_pos)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.importance_sampling_level = level
    trainer.loss_type = loss_type
    trainer.epsilon_low = eps_low
    trainer.epsilon_high = eps_high
    trainer.beta = beta
    trainer.max_completion_length = MAX_LEN
    trainer.top_entropy_quantile = top_entropy_quantile
    trainer.off_policy_mask_threshold = None
    trainer.use_vllm = importance_sampling_ratio is not None
    trainer.vllm_importance_sampling_correction = importance_sampling_ratio is not None
    trainer._entropy_bonus_enabled = False
    trainer.use_adaptive_entropy = False
    trainer.aux_loss_enabled = False
    trainer.accelerator = _OneProcessAccelerator()
    trainer.model = SimpleNamespace(training=True)
    trainer.current_gradient_accumulation_steps = grad_accum
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.args = SimpleNamespace(
        delta=delta,
        use_bias_correction_kl=False,
        steps_per_generation=steps_per_generation,
        **extra_args,
    )
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
                epsilon_low=eps_low,
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
