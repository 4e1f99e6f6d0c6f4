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

from grpo.algorithm import policy_loss  # noqa: E402

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
):
    """Run TRL 1.16's GRPOTrainer._compute_loss on our tensors; return (loss, metrics)."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.importance_sampling_level = level
    trainer.loss_type = loss_type
    trainer.epsilon_low = eps_low
    trainer.epsilon_high = eps_high
    trainer.beta = beta
    trainer.max_completion_length = MAX_LEN
    trainer.top_entropy_quantile = 1.0
    trainer.off_policy_mask_threshold = None
    trainer.use_vllm = False
    trainer.vllm_importance_sampling_correction = False
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
    )
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
    adv = torch.randn(B, generator=gen, dtype=D).abs() * torch.tensor([1.0, -1.0] * (B // 2), dtype=D)
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


CASES = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], [0.0, 0.04], CONFIGS))


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
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        delta=delta,
        importance_sampling_level=level,
        beta=beta,
        ref_logp=ref if beta else None,
        kl_estimator="k3",
        max_completion_length=MAX_LEN,
        num_tokens=mask.sum(),
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
    ours, stats = policy_loss(
        logp, None, adv, mask, loss_type=loss_type, epsilon_high=0.28, importance_sampling_level=level,
        beta=0.04, ref_logp=ref, max_completion_length=MAX_LEN, num_tokens=mask.sum(),
    )  # fmt: skip
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
    for rows in (slice(0, 4), slice(4, 8)):
        kw = dict(old_logp=old[rows], ref_logp=ref[rows], advantages=adv[rows], mask=mask[rows])
        trl_loss, _ = _trl_loss(
            logp=logp[rows], loss_type=loss_type, level="token", beta=0.04, eps_low=0.2, eps_high=0.28,
            delta=1.5, grad_accum=2, steps_per_generation=2, num_items_in_batch=total_tokens, **kw,
        )  # fmt: skip
        ours, _ = policy_loss(
            logp[rows], old[rows], adv[rows], mask[rows], loss_type=loss_type, epsilon_high=0.28, delta=1.5,
            beta=0.04, ref_logp=ref[rows], max_completion_length=MAX_LEN, num_sequences=8,
            num_tokens=total_tokens, num_minibatches=2,
        )  # fmt: skip
        assert_close(ours, trl_loss)
        trl_total = trl_total + trl_loss
        ours_total = ours_total + ours
    (trl_grad,) = torch.autograd.grad(trl_total, logp)
    (our_grad,) = torch.autograd.grad(ours_total, logp)
    assert_close(our_grad, trl_grad)
    if loss_type != "bnpo":
        # the accumulated loss is the whole batch's loss, as if it had not been split
        whole, _ = policy_loss(
            logp, old, adv, mask, loss_type=loss_type, epsilon_high=0.28, delta=1.5, beta=0.04, ref_logp=ref,
            max_completion_length=MAX_LEN,
        )  # fmt: skip
        assert_close(ours_total, whole)
