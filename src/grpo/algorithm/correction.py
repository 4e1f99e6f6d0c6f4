"""Rollout correction: truncated importance sampling between the engine that sampled and the trainer.

The completions are sampled by the rollout engine (bf16 fused decoding on the
CPU today, vLLM later), whose token probabilities are not exactly those of the
trained policy at the start of the update (pi_old, recomputed by the trainer in
its own dtype and kernels). The policy loss's own ratio is pi_theta / pi_old;
this module weights each token's policy loss by how much more (or less) likely
pi_old found it than the sampler did:

    ratio_{i,t} = exp(old_{i,t} - sampling_{i,t})                 level "token"    -> [N, T]
    ratio_i     = exp(sum_t m_{i,t} (old_{i,t} - sampling_{i,t}))  level "sequence" -> [N, 1]

(the sequence ratio is the product of the token ratios: a sum of log-ratios,
not a mean, as TRL's `sequence_*` modes), and then

    mode "truncate": weight = min(ratio, cap)     (and max(., floor) when a floor is set)
    mode "mask":     weight = ratio if ratio <= cap (and >= floor) else 0

These are TRL's `vllm_importance_sampling_mode` options: token_truncate,
token_mask, sequence_truncate, sequence_mask, with `cap` its
`vllm_importance_sampling_clip_max` (TRL 1.16's default 3.0) and `floor` its
`vllm_importance_sampling_clip_min` (default None: no lower bound, so "mask"
does not drop small ratios unless a floor is given). TRL 1.16's default mode is
sequence_mask. A sampling log-prob that is not finite (the engine could not
score the token) counts as equal to old: ratio 1, no correction, as TRL does.
The weights are detached: they re-weight the gradient, they are not optimised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CORRECTION_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class RolloutCorrection:
    """How the sampler / trainer mismatch is corrected (see the module's docstring).

    level: token | sequence.  mode: truncate | mask.  cap: the upper bound C
    (> 0).  floor: an optional lower bound (< cap), None for none.
    """

    level: str = "token"
    mode: str = "truncate"
    cap: float = 3.0
    floor: float | None = None

    def __post_init__(self) -> None:
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(
                f"rollout correction level must be one of {CORRECTION_LEVELS}, got {self.level!r}"
            )
        if self.mode not in CORRECTION_MODES:
            raise ValueError(
                f"rollout correction mode must be one of {CORRECTION_MODES}, got {self.mode!r}"
            )
        if not self.cap > 0:
            raise ValueError(f"rollout correction cap must be > 0, got {self.cap!r}")
        if self.floor is not None and not 0 <= self.floor < self.cap:
            raise ValueError(
                f"rollout correction floor must be in [0, cap={self.cap}) or None, got {self.floor!r}"
            )


def _log_ratio(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """old - sampling per token in float64, 0 at padding and where the sampler gave no finite log-prob."""
    diff = old_logp.detach().double() - sampling_logp.detach().double()
    keep = mask.bool() & torch.isfinite(diff)
    return torch.where(keep, diff, torch.zeros_like(diff))


def _ratios(old_logp, sampling_logp, mask, level: str) -> torch.Tensor:
    diff = _log_ratio(old_logp, sampling_logp, mask)
    if level == "sequence":
        diff = diff.sum(-1, keepdim=True)
    return torch.exp(diff)


def _apply(ratio: torch.Tensor, correction: RolloutCorrection) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, whether each weight was changed by the cap / floor)."""
    floor = correction.floor
    outside = ratio > correction.cap
    if floor is not None:
        outside = outside | (ratio < floor)
    if correction.mode == "truncate":
        weights = torch.clamp(ratio, min=floor, max=correction.cap)
    else:
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    return weights, outside


def correction_weights(
    old_logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection,
) -> torch.Tensor:
    """The detached per-token (or per-sequence) weights of the policy loss, in old_logp's dtype.

    old_logp, sampling_logp, mask: [N, T]. Returns [N, T] at level "token" (1 at
    padding), [N, 1] at level "sequence" (broadcast over the row's tokens).

    Example, cap 3: a row with old - sampling = [ln 0.5, ln 2, ln 4] has token
    ratios [0.5, 2, 4] -> truncate [0.5, 2, 3], mask [0.5, 2, 0]; its sequence
    ratio is exp(ln 0.5 + ln 2 + ln 4) = 4 -> truncate 3, mask 0. A row
    [ln 1.5, ln 0.5, padding] has sequence ratio 0.75, kept by both modes.
    With floor 0.6 the token ratio 0.5 becomes 0.6 (truncate) or 0 (mask).
    """
    weights, _ = _apply(_ratios(old_logp, sampling_logp, mask, correction.level), correction)
    return weights.to(old_logp.dtype)


def mismatch_stats(
    old_logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection | None = None,
) -> dict[str, torch.Tensor]:
    """Sums over masked tokens of the sampler / trainer mismatch, detached float64 scalars.

    logprob_diff_sum  sum |old - sampling|            (the caller divides by the token count)
    logprob_diff_max  max |old - sampling|            (0 for no tokens)
    is_ratio_sum      sum exp(old - sampling), the raw token ratio
    with a correction, for the weights it applies (a sequence weight counted once per token):
    is_weight_sum     sum of the weights
    is_capped         tokens whose weight the cap (or floor) changed: truncated, or masked to 0

    Example (the rows of correction_weights, masks [1, 1, 1] and [1, 1, 0]):
    logprob_diff_sum = 3 ln 2 + 2 ln 2 + ln 1.5 = 3.8712, logprob_diff_max = ln 4,
    is_ratio_sum = 0.5 + 2 + 4 + 1.5 + 0.5 = 8.5; token truncate, cap 3:
    is_weight_sum 7.5, is_capped 1; sequence mask: is_weight_sum 2 * 0.75 = 1.5, is_capped 3.
    """
    m = mask.detach().double()
    diff = _log_ratio(old_logp, sampling_logp, mask)
    absolute = diff.abs()
    stats = {
        "logprob_diff_sum": (absolute * m).sum(),
        "logprob_diff_max": absolute.max() if absolute.numel() else absolute.new_zeros(()),
        "is_ratio_sum": (torch.exp(diff) * m).sum(),
    }
    if correction is not None:
        weights, outside = _apply(
            _ratios(old_logp, sampling_logp, mask, correction.level), correction
        )
        stats["is_weight_sum"] = (weights * m).sum()
        stats["is_capped"] = (outside.double() * m).sum()
    return stats
