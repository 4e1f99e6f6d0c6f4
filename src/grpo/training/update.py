"""The policy update: log-probabilities of a generation batch, and the optimizer passes.

    old / reference logprobs   no gradient, minibatch by minibatch (`batch_logprobs`)
    num_iterations passes      each: zero the gradients; for every minibatch and each
                               of its micro-batches, the loss's share and its backward;
                               clip; optimizer step; scheduler step (`policy_update`)

The loss of a micro-batch is the registered policy loss and aggregation
(grpo.algorithm) with normalisers counted over the whole generation batch, so
the gradient does not depend on how the batch is split (tests/training/test_trainer.py).

Against TRL's GRPOTrainer: one optimizer pass here is one TRL optimizer step;
the pass's minibatches (per_device_train_batch_size completions each,
training.gradient_accumulation_steps of them per rank) are the micro-batches of
TRL's gradient-accumulation window, and the ranks' gradients are summed where
TRL's DDP averages them (each share here is already divided by the global
count). A minibatch may be computed in several micro-batches here
(training.microbatch_tokens), which TRL does not do. The entropy bonus is a
token mean per minibatch divided by the number of minibatches, as TRL's per
micro-batch mean divided by its accumulation steps; its adaptive controller
(algorithm.use_adaptive_entropy) moves the coefficient once per pass, from the
pass's token-weighted entropy over every rank, as TRL's once per optimizer step.
The backend says how the output layer computes and how gradients are
clipped; nothing here knows the device.

A pass whose loss or gradient norm is NaN or inf is skipped: no optimizer or
scheduler step, so weights and optimizer state are those of the last good pass
(`Skips` counts them; training.max_consecutive_skips in a row raise
TrainingDiverged). `check_finite_weights` refuses to let non-finite weights be saved.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field

import torch

from grpo import algorithm
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.logprobs import completion_logprobs
from grpo.registry import LOSS_AGGREGATIONS, POLICY_LOSSES
from grpo.training.batching import GenerationBatch, microbatches, minibatches
from grpo.training.state import EntropyControl

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Training cannot go on: updates keep coming out non-finite, or the weights are. The weights
    in memory are those of the last good update (a skipped update never touches them)."""


@dataclass
class Skips:
    """Skipped optimizer passes: in a row (reset by a good pass) and over the run."""

    limit: int
    consecutive: int = 0
    total: int = 0

    def record(self, skipped: bool, why: str = "") -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        log.warning(
            "update skipped (%s): weights and optimizer state left as they were; %d in a row, %d in the run",
            why,
            self.consecutive,
            self.total,
        )
        if self.consecutive >= self.limit:
            raise TrainingDiverged(
                f"{self.consecutive} optimizer passes in a row had a non-finite loss or gradient (last: {why}), "
                f"so training stopped (training.max_consecutive_skips={self.limit}); the weights are those of the "
                "last good update. Lower training.learning_rate, keep training.max_grad_norm > 0, or check the "
                "rewards and the data"
            )


def check_finite_weights(model, what: str) -> None:
    """Raises TrainingDiverged naming the first parameter that holds NaN or inf (before `what`, a save).

    Each parameter's largest magnitude is NaN or inf exactly when it holds one (the max-norm
    propagates NaN, and no finite value's magnitude overflows): one read of the weights, no
    boolean copy of them, and one host synchronisation for the whole model."""
    named = [(name, p) for name, p in model.named_parameters() if p.numel()]
    norms = []
    for _, p in named:
        norm = torch.linalg.vector_norm(p.detach(), ord=math.inf)
        if hasattr(norm, "full_tensor"):  # a parameter sharded by FSDP: every rank's shard
            norm = norm.full_tensor()
        norms.append(norm.float())
    if not norms:
        return
    finite = torch.isfinite(torch.stack(norms)).tolist()
    for (name, _), ok in zip(named, finite):
        if not ok:
            raise TrainingDiverged(
                f"refusing to {what}: parameter {name} holds NaN or inf, so these weights would be useless; "
                "lower training.learning_rate (and keep training.max_grad_norm > 0) and train again"
            )


def trim_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop leading columns that are padding in every row."""
    first = int((mask.sum(0) > 0).nonzero()[0]) if mask.any() else mask.shape[1] - 1
    return ids[:, first:], mask[:, first:]


def split(batch: GenerationBatch, cfg: Config) -> list[list[torch.Tensor]]:
    """The batch's minibatches, each as its micro-batches (row indices)."""
    size, G = cfg.training.per_device_train_batch_size, cfg.rollout.num_generations
    return [
        microbatches(batch.rollout, rows, cfg.training.microbatch_tokens)
        for rows in minibatches(batch.rollout.lengths.tolist(), G, size)
    ]


NO_ROWS = torch.zeros(0, dtype=torch.long, device="cpu")


def evened(pieces: list[list[torch.Tensor]], backend) -> list[list[torch.Tensor]]:
    """`pieces` and, when the backend needs every rank to run as many forward/backward passes
    (FSDP: each is a collective), one more minibatch of empty micro-batches (NO_ROWS) to make
    up this rank's difference to the busiest rank; an empty one runs `backend.idle_pass`."""
    count = sum(len(m) for m in pieces)
    missing = backend.passes_needed(count) - count
    return pieces + [[NO_ROWS] * missing] if missing else pieces


def rows_logprobs(
    model, batch: GenerationBatch, rows: torch.Tensor, cfg: Config, backend, grad: bool
):
    """(logp, entropy) [len(rows), width] of the completions `rows`, width = their longest."""
    ro = batch.rollout
    prompt_ids, prompt_mask = trim_left(ro.prompt_ids[rows], ro.prompt_mask[rows])
    width = max(1, int(ro.completion_mask[rows].sum(-1).max()))
    context = contextlib.nullcontext() if grad else torch.no_grad()
    with context, backend.autocast():
        return completion_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            ro.completion_ids[rows, :width],
            ro.completion_mask[rows, :width],
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.training.logprob_chunk_size,
            kernels=backend.output_layer_kernels(),
        )


def batch_logprobs(model, batch: GenerationBatch, cfg: Config, backend) -> torch.Tensor:
    """log pi [N, T] of every completion token under `model`, without gradients (in eval mode:
    the sampling policy and the reference are scored, not trained)."""
    was_training = model.training
    model.eval()
    out = torch.zeros(len(batch), batch.rollout.completion_ids.shape[1], device=backend.device)
    try:
        for pieces in evened(split(batch, cfg), backend):
            for rows in pieces:
                if not len(rows):
                    backend.idle_pass(model, grad=False)
                    continue
                logp, _ = rows_logprobs(model, batch, rows, cfg, backend, grad=False)
                out[rows, : logp.shape[1]] = logp
    finally:
        model.train(was_training)
    return out


def loss_settings(cfg: Config) -> algorithm.LossSettings:
    """algorithm.* as the policy loss takes it; algorithm.rollout_correction `token_truncate` is
    level token, mode truncate (none: no correction). A registered loss's or aggregation's
    `caveat` about these settings is logged once."""
    a = cfg.algorithm
    correction = None
    if a.rollout_correction != "none":
        level, mode = a.rollout_correction.split("_")
        correction = algorithm.RolloutCorrection(
            level=level, mode=mode, cap=a.rollout_correction_cap
        )
    params = algorithm.PolicyLossParams(
        epsilon_low=a.epsilon,
        epsilon_high=cfg.epsilon_high,
        delta=a.delta,
        importance_sampling_level=a.importance_sampling_level,
        sapo_temperature_pos=a.sapo_temperature_pos,
        sapo_temperature_neg=a.sapo_temperature_neg,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
    )
    for part in (LOSS_AGGREGATIONS.get(a.loss_type), POLICY_LOSSES.get(a.policy_loss)):
        caveat = getattr(part, "caveat", None)
        message = caveat(params) if caveat is not None else None
        if message:
            _warn_once(message)
    return algorithm.LossSettings(
        objective=a.policy_loss,
        loss_type=a.loss_type,
        params=params,
        beta=a.beta,
        kl_estimator=a.kl_estimator,
        kl_bias_correction=a.kl_bias_correction,
        correction=correction,
        off_policy_mask_threshold=a.off_policy_mask_threshold,
    )


@functools.lru_cache(maxsize=None)
def _warn_once(message: str, *args) -> None:
    """A setting's caveat, logged once per process rather than every step."""
    log.warning(message, *args)


def entropy_bonus_enabled(cfg: Config) -> bool:
    """Whether the update computes the entropy bonus: a coefficient is set, or the adaptive
    controller may set one (as TRL: on even while the coefficient sits at 0)."""
    a = cfg.algorithm
    return a.entropy_coef != 0.0 or a.use_adaptive_entropy


def _pass_entropy_coef(cfg: Config, control: EntropyControl) -> float:
    """The coefficient every micro-batch of the next pass applies: the adaptive controller's only
    when the last pass's entropy was at or below the target; the fixed one otherwise."""
    a = cfg.algorithm
    if a.use_adaptive_entropy:
        return algorithm.applied_entropy_coef(control.coef, control.last_entropy, a.entropy_target)
    return control.coef


def _adapt_entropy_coef(cfg: Config, control: EntropyControl, entropy: float) -> None:
    """After a pass: the controller's next coefficient, from the pass's entropy."""
    a = cfg.algorithm
    control.coef = algorithm.next_entropy_coef(
        control.coef,
        entropy,
        a.entropy_target,
        a.entropy_coef_delta,
        a.entropy_coef_min,
        a.entropy_coef_max,
    )
    control.last_entropy = entropy


def _rows_advantages(advantages: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """The advantages of `rows`: one per completion [n], or per token [n, width] (gae)."""
    return advantages[rows] if advantages.dim() == 1 else advantages[rows, :width]


def _accumulate(sums: dict[str, float], stats: dict[str, torch.Tensor]) -> None:
    for key, value in stats.items():
        value = float(value)
        if key.endswith("_max"):
            sums[key] = max(sums.get(key, value), value)
        else:
            sums[key] = sums.get(key, 0.0) + value


@dataclass
class UpdatePlan:
    """What every optimizer pass of one update shares, counted once over every rank: the
    batch's minibatches (each as its micro-batches; with the idle ones that even out the
    ranks' passes), each minibatch's loss normalisers, and the loss's settings."""

    batch: GenerationBatch
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    pieces: list[list[torch.Tensor]]
    norms: list[algorithm.LossNormalisers]
    num_tokens: float
    num_sequences: int
    settings: algorithm.LossSettings

    @classmethod
    def of(cls, batch: GenerationBatch, old_logp, ref_logp, cfg: Config, backend) -> "UpdatePlan":
        a = cfg.algorithm
        pieces = split(batch, cfg)
        num_tokens = backend.sum(batch.loss_mask.sum().item())
        num_sequences = int(backend.sum(len(batch)))
        num_minibatches = int(
            backend.sum(len(pieces))
        )  # bnpo averages over every rank's minibatches
        settings = loss_settings(cfg)
        if settings.correction is not None and batch.rollout.sampling_logprobs is None:
            raise ConfigError(
                f"algorithm.rollout_correction={a.rollout_correction}: the rollout engine {cfg.rollout.engine!r} did not "
                "report the logprobs it sampled with; set algorithm.rollout_correction=none"
            )
        pieces = evened(pieces, backend)  # after counting the minibatches: padding is not one
        norms = [
            algorithm.LossNormalisers(
                num_sequences=num_sequences,
                num_tokens=num_tokens,
                num_minibatches=num_minibatches,
                minibatch_tokens=batch.loss_mask[torch.cat(minibatch)].sum().item(),
                max_completion_length=cfg.rollout.max_completion_length,
            )
            for minibatch in pieces
        ]
        return cls(batch, old_logp, ref_logp, pieces, norms, num_tokens, num_sequences, settings)


@dataclass
class UpdateSums:
    """What the update's passes add up: the statistics' sums (`_max` keys: maxima), each pass's
    gradient norm and entropy coefficient, the passes skipped, and the pass under way's
    entropy window (its sum H E and count E, for the adaptive controller)."""

    stats: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("kl", "clip_low", "clip_high", "clip_region", "entropy", "loss"), 0.0
        )
    )
    grad_norms: list[float] = field(default_factory=list)
    coefs: list[float] = field(default_factory=list)
    skipped: int = 0
    window: list[float] = field(default_factory=lambda: [0.0, 0.0])


def micro_batch_loss(
    model, plan: UpdatePlan, rows: torch.Tensor, norm, coef: float, cfg: Config, backend, sums
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss's share of the micro-batch `rows` (to backpropagate) and its statistics, the
    entropy's sums added to `sums`: the policy loss (x entropy mask x rollout correction) + KL, aggregated with the
    minibatch's normalisers `norm`, minus the entropy bonus at `coef`."""
    a, batch = cfg.algorithm, plan.batch
    logp, entropy = rows_logprobs(model, batch, rows, cfg, backend, grad=True)
    width = logp.shape[1]
    mask = batch.loss_mask[rows, :width]
    high_entropy = (
        algorithm.entropy_mask(entropy.detach(), mask, a.top_entropy_quantile, a.entropy_mask_scope)
        if a.top_entropy_quantile < 1.0
        else None
    )
    sampling_logp = batch.rollout.sampling_logprobs
    loss, stats = algorithm.policy_loss(
        logp,
        plan.old_logp[rows, :width] if plan.old_logp is not None else None,
        _rows_advantages(batch.advantages, rows, width).to(backend.device),
        mask,
        plan.settings,
        norm,
        ref_logp=plan.ref_logp[rows, :width] if plan.ref_logp is not None else None,
        entropy_mask=high_entropy,
        # the engine's logprobs, against the policy the update starts from (old_logp, or logp
        # itself on a single pass: the weights have not moved yet)
        sampling_logp=sampling_logp[rows, :width].to(backend.device)
        if sampling_logp is not None
        else None,
        # with gradient: the bonus's part of the backward (only when one is applied)
        entropy=entropy if coef != 0.0 else None,
        entropy_coef=coef,
    )
    if entropy_bonus_enabled(cfg):  # the loss without the bonus, also in a pass that applied none
        stats.setdefault("policy_loss", loss.detach().double())
    if a.use_adaptive_entropy:
        acted_on = mask if high_entropy is None else mask * high_entropy
        sums.window[0] += algorithm.masked_sum(entropy, acted_on).item()
        sums.window[1] += float(acted_on.sum())
    sums.stats["entropy"] += algorithm.masked_sum(entropy, mask).item()
    if high_entropy is not None:
        sums.stats["entropy_kept"] = (
            sums.stats.get("entropy_kept", 0.0)
            + algorithm.masked_sum(high_entropy.float(), mask).item()
        )
    return loss, stats


def optimizer_pass(
    model, optimizer, scheduler, plan: UpdatePlan, cfg: Config, backend, skips, control, sums
) -> None:
    """One pass over the batch: each micro-batch's loss and backward, the gradients summed over
    the ranks and clipped, then the optimizer and scheduler step; none when the loss or the
    gradient norm is not finite (the pass is skipped and recorded in `skips`)."""
    a = cfg.algorithm
    optimizer.zero_grad(set_to_none=False)  # in place: the gradient buffers stay allocated
    pass_loss = 0.0
    coef = _pass_entropy_coef(cfg, control) if entropy_bonus_enabled(cfg) else 0.0
    sums.window = [0.0, 0.0]
    for minibatch, norm in zip(plan.pieces, plan.norms):
        for rows in minibatch:
            if not len(rows):
                backend.idle_pass(model, grad=True)
                continue
            loss, stats = micro_batch_loss(model, plan, rows, norm, coef, cfg, backend, sums)
            loss.backward()
            pass_loss += loss.item()
            _accumulate(sums.stats, stats)
    # every rank's share: the loss, and the same verdict everywhere
    pass_loss = backend.sum(pass_loss)
    sums.stats["loss"] += pass_loss
    # summed over the ranks: each rank's shares were normalised globally
    backend.reduce_gradients(model)
    grad_norm = backend.clip_grad_norm(model, cfg.training.max_grad_norm)  # before clipping
    sums.grad_norms.append(grad_norm)
    if a.use_adaptive_entropy:  # every rank's tokens (a collective: before the verdict)
        pass_entropy = backend.sum(sums.window[0]) / max(1.0, backend.sum(sums.window[1]))
    if math.isfinite(pass_loss) and math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
        skips.record(False)
        if a.use_adaptive_entropy:
            _adapt_entropy_coef(cfg, control, pass_entropy)
    else:
        # no step at all: AdamW would write NaN into the weights and its moments for good
        optimizer.zero_grad(set_to_none=False)
        sums.skipped += 1
        skips.record(True, f"loss {pass_loss}, gradient norm {grad_norm}")
    sums.coefs.append(control.coef)


def update_metrics(
    sums: UpdateSums, plan: UpdatePlan, cfg: Config, backend, skips
) -> dict[str, float]:
    """The update's metrics (TRL's names), from its sums over every rank: per token of the
    passes (entropy, clip ratios, kl, the rollout's mismatch), per sequence (the off-policy
    mask, a policy loss's `sequence_metrics`), per pass (loss, grad_norm, the entropy bonus)."""
    a = cfg.algorithm
    loss_total = sums.stats.pop("loss")  # already summed over the ranks, pass by pass
    totals = backend.reduce_stats(sums.stats)
    passes = a.num_iterations * max(1.0, plan.num_tokens)
    out = {
        "loss": loss_total / a.num_iterations,
        "grad_norm": sum(sums.grad_norms) / len(sums.grad_norms),
        "entropy": totals["entropy"] / passes,
        "clip_ratio/low_mean": totals["clip_low"] / passes,
        "clip_ratio/high_mean": totals["clip_high"] / passes,
        "clip_ratio/region_mean": totals["clip_region"] / passes,
        "train/skipped_updates": sums.skipped,
        "train/skipped_updates_total": skips.total,
    }
    if a.beta > 0:
        out["kl"] = totals["kl"] / passes
    if plan.batch.rollout.sampling_logprobs is not None and "logprob_diff_sum" in totals:
        out["rollout/logprob_diff_mean"] = totals["logprob_diff_sum"] / passes
        out["rollout/logprob_diff_max"] = totals["logprob_diff_max"]
        out["rollout/is_ratio"] = totals["is_ratio_sum"] / passes
        if plan.settings.correction is not None:
            out["rollout/is_weight"] = totals["is_weight_sum"] / passes
            out["rollout/is_capped_ratio"] = totals["is_capped"] / passes
    if a.top_entropy_quantile < 1.0:
        out["entropy/kept_ratio"] = totals["entropy_kept"] / passes
    sequences = a.num_iterations * max(1, plan.num_sequences)
    if a.off_policy_mask_threshold is not None:
        out["off_policy/masked_ratio"] = totals.get("off_policy_masked", 0.0) / sequences
    for name, stat in getattr(POLICY_LOSSES.get(a.policy_loss), "sequence_metrics", {}).items():
        out[name] = totals.get(stat, 0.0) / sequences
    if entropy_bonus_enabled(cfg):
        # the coefficient after each pass (TRL logs it at each optimizer step), and the loss without
        # the bonus (TRL's policy_loss; a pass that applied none has no bonus to take out)
        out["entropy_coef"] = sum(sums.coefs) / len(sums.coefs)
        out["policy_loss"] = totals.get("policy_loss", 0.0) / a.num_iterations
    return out


def policy_update(
    model,
    optimizer,
    scheduler,
    batch: GenerationBatch,
    old_logp,
    ref_logp,
    cfg: Config,
    backend,
    skips: Skips | None = None,
    entropy_control: EntropyControl | None = None,
) -> dict[str, float]:
    """num_iterations optimizer passes over the generation batch (`optimizer_pass`); the update's
    metrics. A pass with a non-finite loss or gradient norm is skipped and recorded in `skips`
    (which may raise TrainingDiverged).

    `entropy_control`: the entropy bonus's coefficient, which the adaptive controller moves after
    every pass that stepped (a skipped pass leaves it as it was); the run's TrainState.entropy, so
    that a checkpoint carries it. None: a fresh one from algorithm.entropy_coef."""
    a = cfg.algorithm
    skips = skips if skips is not None else Skips(cfg.training.max_consecutive_skips)
    control = entropy_control if entropy_control is not None else EntropyControl(a.entropy_coef)
    plan = UpdatePlan.of(batch, old_logp, ref_logp, cfg, backend)
    sums = UpdateSums()
    model.train()
    for _ in range(a.num_iterations):
        optimizer_pass(model, optimizer, scheduler, plan, cfg, backend, skips, control, sums)
    backend.after_update()
    return update_metrics(sums, plan, cfg, backend, skips)
