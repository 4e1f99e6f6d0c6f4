"""The update phase: the policy's optimizer passes over a generation batch (`PolicyUpdate`).

    num_iterations passes      each: zero the gradients; for every minibatch and each
                               of its micro-batches, the loss's share and its backward;
                               clip; optimizer step; scheduler step

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

import functools
import logging
import math
from dataclasses import dataclass, field

import torch

from grpo import algorithm
from grpo.config.algorithm import AlgorithmConfig
from grpo.config.errors import ConfigError
from grpo.registry import LOSS_AGGREGATIONS, POLICY_LOSSES
from grpo.rollout.types import SamplingParams
from grpo.training.batching import GenerationBatch
from grpo.training.forward import Forward, evened
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


def loss_settings(a: AlgorithmConfig, max_staleness: int = 0) -> algorithm.LossSettings:
    """algorithm.* as the policy loss takes it (grpo.algorithm.LossSettings.of; rollout_correction
    `auto` by rollout.max_staleness), built once per run; a registered loss's or aggregation's
    `caveat` about these settings is logged once."""
    settings = algorithm.LossSettings.of(a, max_staleness)
    for part in (LOSS_AGGREGATIONS.get(a.loss_type), POLICY_LOSSES.get(a.policy_loss)):
        caveat = getattr(part, "caveat", None)
        message = caveat(settings.params) if caveat is not None else None
        if message:
            _warn_once(message)
    return settings


@functools.lru_cache(maxsize=None)
def _warn_once(message: str, *args) -> None:
    """A setting's caveat, logged once per process rather than every step."""
    log.warning(message, *args)


def entropy_bonus_enabled(a: AlgorithmConfig) -> bool:
    """Whether the update computes the entropy bonus: a coefficient is set, or the adaptive
    controller may set one (as TRL: on even while the coefficient sits at 0)."""
    return a.entropy_coef != 0.0 or a.use_adaptive_entropy


def _pass_entropy_coef(a: AlgorithmConfig, control: EntropyControl) -> float:
    """The coefficient every micro-batch of the next pass applies: the adaptive controller's only
    when the last pass's entropy was at or below the target; the fixed one otherwise."""
    if a.use_adaptive_entropy:
        return algorithm.applied_entropy_coef(control.coef, control.last_entropy, a.entropy_target)
    return control.coef


def _adapt_entropy_coef(a: AlgorithmConfig, control: EntropyControl, entropy: float) -> None:
    """After a pass: the controller's next coefficient, from the pass's entropy."""
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
    batch, its advantages and old/reference logprobs, its minibatches (each as its
    micro-batches; with the idle ones that even out the ranks' passes), each minibatch's loss
    normalisers."""

    batch: GenerationBatch
    advantages: torch.Tensor
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    pieces: list[list[torch.Tensor]]
    norms: list[algorithm.LossNormalisers]
    num_tokens: float
    num_sequences: int
    sampling_logp: torch.Tensor | None = None
    """The engine's logprobs over the whole vocabulary (see PolicyUpdate.kept), or None."""


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


@dataclass
class PolicyUpdate:
    """The update phase: num_iterations optimizer passes of the policy over a generation batch.

    It holds what it reads, resolved once at build: the policy, its optimizer and scheduler,
    the skipped passes (`Skips`), the entropy bonus's controller (the train state's, so that a
    checkpoint carries it), the forward passes (`Forward`), the algorithm's settings
    (`algorithm`: the section the losses' parameters are derived from, by name), the loss's
    settings derived from them once (`settings`), the gradient clip, the completion length the
    dr_grpo normaliser divides by, and the engine's name (for the one error it can meet).
    `kept`: the sampling filters, when the engine reports its logprobs over the tokens they kept
    only (vLLM's processed_logprobs with top-k/top-p/min-p): the update puts them back on the
    whole vocabulary with the kept mass under the policy it starts from (grpo.models.kept_mass)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    skips: Skips
    entropy: EntropyControl
    forward: Forward
    algorithm: AlgorithmConfig
    settings: algorithm.LossSettings
    max_grad_norm: float
    max_completion_length: int
    engine_name: str
    kept: SamplingParams | None = None

    @property
    def backend(self):
        return self.forward.backend

    def __call__(
        self, batch: GenerationBatch, advantages: torch.Tensor, old_logp, ref_logp
    ) -> dict[str, float]:
        """num_iterations optimizer passes over the batch (`optimizer_pass`); the update's
        metrics. A pass with a non-finite loss or gradient norm is skipped and recorded in
        `skips` (which may raise TrainingDiverged)."""
        plan = self.plan(batch, advantages, old_logp, ref_logp)
        sums = UpdateSums()
        self.model.train()
        for _ in range(self.algorithm.num_iterations):
            self.optimizer_pass(plan, sums)
        self.backend.after_update()
        return self.metrics(sums, plan)

    def plan(self, batch: GenerationBatch, advantages, old_logp, ref_logp) -> UpdatePlan:
        """The passes' shared plan, its counts over every rank."""
        backend = self.backend
        pieces = self.forward.split(batch)
        num_tokens = backend.sum(batch.loss_mask.sum().item())
        num_sequences = int(backend.sum(len(batch)))
        # bnpo averages over every rank's minibatches
        num_minibatches = int(backend.sum(len(pieces)))
        if self.settings.correction is not None and batch.rollout.sampling_logprobs is None:
            raise ConfigError(
                f"algorithm.rollout_correction={self.algorithm.rollout_correction}: the rollout engine "
                f"{self.engine_name!r} did not report the logprobs it sampled with; set "
                "algorithm.rollout_correction=none"
            )
        pieces = evened(pieces, backend)  # after counting the minibatches: padding is not one
        norms = [
            algorithm.LossNormalisers(
                num_sequences=num_sequences,
                num_tokens=num_tokens,
                num_minibatches=num_minibatches,
                minibatch_tokens=batch.loss_mask[torch.cat(minibatch)].sum().item(),
                max_completion_length=self.max_completion_length,
            )
            for minibatch in pieces
        ]
        sampling_logp = batch.rollout.sampling_logprobs
        if sampling_logp is not None and self.kept is not None:
            sampling_logp = sampling_logp + self.forward.kept_logmass(self.model, batch, self.kept)
        return UpdatePlan(
            batch,
            advantages,
            old_logp,
            ref_logp,
            pieces,
            norms,
            num_tokens,
            num_sequences,
            sampling_logp,
        )

    def micro_batch_loss(
        self, plan: UpdatePlan, rows: torch.Tensor, norm, coef: float, sums: UpdateSums
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss's share of the micro-batch `rows` (to backpropagate) and its statistics, the
        entropy's sums added to `sums`: the policy loss (x entropy mask x rollout correction) +
        KL, aggregated with the minibatch's normalisers `norm`, minus the entropy bonus at `coef`."""
        a, batch, device = self.algorithm, plan.batch, self.backend.device
        logp, entropy = self.forward.rows(self.model, batch, rows, grad=True)
        width = logp.shape[1]
        mask = batch.loss_mask[rows, :width]
        high_entropy = (
            algorithm.entropy_mask(
                entropy.detach(), mask, a.top_entropy_quantile, a.entropy_mask_scope
            )
            if a.top_entropy_quantile < 1.0
            else None
        )
        sampling_logp = plan.sampling_logp
        loss, stats = algorithm.policy_loss(
            logp,
            plan.old_logp[rows, :width] if plan.old_logp is not None else None,
            _rows_advantages(plan.advantages, rows, width).to(device),
            mask,
            self.settings,
            norm,
            ref_logp=plan.ref_logp[rows, :width] if plan.ref_logp is not None else None,
            entropy_mask=high_entropy,
            # the engine's logprobs, against the policy the update starts from (old_logp, or logp
            # itself on a single pass: the weights have not moved yet)
            sampling_logp=sampling_logp[rows, :width].to(device)
            if sampling_logp is not None
            else None,
            # with gradient: the bonus's part of the backward (only when one is applied)
            entropy=entropy if coef != 0.0 else None,
            entropy_coef=coef,
        )
        if entropy_bonus_enabled(a):  # the loss without the bonus, also in a pass that applied none
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

    def optimizer_pass(self, plan: UpdatePlan, sums: UpdateSums) -> None:
        """One pass over the batch: each micro-batch's loss and backward, the gradients summed
        over the ranks and clipped, then the optimizer and scheduler step; none when the loss or
        the gradient norm is not finite (the pass is skipped and recorded in `skips`)."""
        a, backend, model, control = self.algorithm, self.backend, self.model, self.entropy
        self.optimizer.zero_grad(set_to_none=False)  # in place: the gradient buffers stay allocated
        pass_loss = 0.0
        coef = _pass_entropy_coef(a, control) if entropy_bonus_enabled(a) else 0.0
        sums.window = [0.0, 0.0]
        for minibatch, norm in zip(plan.pieces, plan.norms):
            for rows in minibatch:
                if not len(rows):
                    backend.idle_pass(model, grad=True)
                    continue
                loss, stats = self.micro_batch_loss(plan, rows, norm, coef, sums)
                loss.backward()
                pass_loss += loss.item()
                _accumulate(sums.stats, stats)
        # every rank's share: the loss, and the same verdict everywhere
        pass_loss = backend.sum(pass_loss)
        sums.stats["loss"] += pass_loss
        # summed over the ranks: each rank's shares were normalised globally
        backend.reduce_gradients(model)
        grad_norm = backend.clip_grad_norm(model, self.max_grad_norm)  # before clipping
        sums.grad_norms.append(grad_norm)
        if a.use_adaptive_entropy:  # every rank's tokens (a collective: before the verdict)
            pass_entropy = backend.sum(sums.window[0]) / max(1.0, backend.sum(sums.window[1]))
        if math.isfinite(pass_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.skips.record(False)
            if a.use_adaptive_entropy:
                _adapt_entropy_coef(a, control, pass_entropy)
        else:
            # no step at all: AdamW would write NaN into the weights and its moments for good
            self.optimizer.zero_grad(set_to_none=False)
            sums.skipped += 1
            self.skips.record(True, f"loss {pass_loss}, gradient norm {grad_norm}")
        sums.coefs.append(control.coef)

    def metrics(self, sums: UpdateSums, plan: UpdatePlan) -> dict[str, float]:
        """The update's metrics (TRL's names), from its sums over every rank: per token of the
        passes (entropy, clip ratios, kl, the rollout's mismatch), per sequence (the off-policy
        mask, a policy loss's `sequence_metrics`), per pass (loss, grad_norm, the entropy bonus)."""
        a = self.algorithm
        loss_total = sums.stats.pop("loss")  # already summed over the ranks, pass by pass
        totals = self.backend.reduce_stats(sums.stats)
        passes = a.num_iterations * max(1.0, plan.num_tokens)
        out = {
            "loss": loss_total / a.num_iterations,
            "grad_norm": sum(sums.grad_norms) / len(sums.grad_norms),
            "entropy": totals["entropy"] / passes,
            "clip_ratio/low_mean": totals["clip_low"] / passes,
            "clip_ratio/high_mean": totals["clip_high"] / passes,
            "clip_ratio/region_mean": totals["clip_region"] / passes,
            "train/skipped_updates": sums.skipped,
            "train/skipped_updates_total": self.skips.total,
        }
        if a.beta > 0:
            out["kl"] = totals["kl"] / passes
        if plan.batch.rollout.sampling_logprobs is not None and "logprob_diff_sum" in totals:
            out["rollout/logprob_diff_mean"] = totals["logprob_diff_sum"] / passes
            out["rollout/logprob_diff_max"] = totals["logprob_diff_max"]
            out["rollout/is_ratio"] = totals["is_ratio_sum"] / passes
            if self.settings.correction is not None:
                out["rollout/is_weight"] = totals["is_weight_sum"] / passes
                out["rollout/is_capped_ratio"] = totals["is_capped"] / passes
        if a.top_entropy_quantile < 1.0:
            out["entropy/kept_ratio"] = totals["entropy_kept"] / passes
        sequences = a.num_iterations * max(1, plan.num_sequences)
        if a.off_policy_mask_threshold is not None:
            out["off_policy/masked_ratio"] = totals.get("off_policy_masked", 0.0) / sequences
        for name, stat in getattr(POLICY_LOSSES.get(a.policy_loss), "sequence_metrics", {}).items():
            out[name] = totals.get(stat, 0.0) / sequences
        if entropy_bonus_enabled(a):
            # the coefficient after each pass (TRL logs it at each optimizer step), and the loss
            # without the bonus (TRL's policy_loss; a pass that applied none has no bonus to take out)
            out["entropy_coef"] = sum(sums.coefs) / len(sums.coefs)
            out["policy_loss"] = totals.get("policy_loss", 0.0) / a.num_iterations
        return out
