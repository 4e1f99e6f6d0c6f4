"""The policy loss, as pure tensor functions.

Shapes: N completions, T completion tokens (padded). Each function's docstring
has its formula and a worked example (checked in tests/algorithm/test_losses.py,
and against TRL in tests/test_trl_equivalence.py).

Two registered kinds, one signature each, registered where they are defined
(`@POLICY_LOSSES.register("clipped")`):

- a policy loss (grpo.registry.POLICY_LOSSES), the per-token objective:
      loss(logp, old_logp, advantages, mask, params: PolicyLossParams) -> (per-token loss, stats)
- a loss aggregation (grpo.registry.LOSS_AGGREGATIONS, `algorithm.loss_type`):
      aggregate(per_token_loss, mask, norm: LossNormalisers) -> scalar
  The normalisers are passed in, counted over the whole generation batch (all
  ranks), never from the tensors at hand: splitting a batch into minibatches,
  micro-batches or ranks cannot change the loss.

An entry may carry what the update asks of it (attributes given to `register`):
`caveat(params) -> str | None`, a warning about a setting that works against it,
logged once; a policy loss's `folds_correction` and `sequence_metrics`.

Advantages are [N] (one per completion, the group estimators) or [N, T] (one
per token, GAE); every policy loss broadcasts [N] as [N, 1].

`policy_loss` puts them together with the KL penalty, and optionally the
entropy mask (`entropy_mask`, "Beyond the 80/20 rule") and the rollout
correction (grpo.algorithm.correction).

Registered policy losses and the TRL `loss_type` each reproduces (in grpo,
TRL's loss_type is split into the policy loss and the aggregation):
    clipped + grpo / bnpo / dr_grpo / dapo   TRL grpo / bnpo / dr_grpo / dapo
    clipped + luspo                          TRL luspo (a per-sequence sum, averaged over sequences)
    cispo   + dapo                           TRL cispo (its tokens-of-the-batch normaliser)
    sapo    + grpo                           TRL sapo (its per-sequence mean)
    vespo   + dapo                           TRL vespo (gamma-weighted log-likelihood)

`policy_loss` also applies, when set: the off-policy sequence mask
(`off_policy_mask`, DeepSeek-V3.2), the importance-weighted ("bias-corrected")
KL, and the entropy bonus (grpo.algorithm.entropy).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from grpo.algorithm.correction import RolloutCorrection, correction_weights, mismatch_stats
from grpo.algorithm.entropy import entropy_bonus
from grpo.config.algorithm import AlgorithmConfig, resolved_rollout_correction
from grpo.registry import IMPORTANCE_LEVELS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

ENTROPY_MASK_SCOPES = ("completion", "batch")


# --------------------------------------------------------------------------
# Ratios, clipping, KL
# --------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / sum(m), 0 when the mask is empty."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def log_importance_weights(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log rho, the log importance ratio between the current and sampling policy.

    level="token":    log rho_{i,t} = logp_{i,t} - old_{i,t}               -> [N, T]
    level="sequence": log rho_i = sum_t m (logp - old) / sum_t m  (GSPO)  -> [N, 1]

    Example: logp - old = [[0.2, 0.4, x]], mask [[1, 1, 0]] -> token level
    [[0.2, 0.4, x]], sequence level [[0.3]]. An all-masked row gives 0.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_LEVELS}, got {level!r}")


def token_advantages(advantages: torch.Tensor) -> torch.Tensor:
    """Advantages shaped to broadcast against [N, T]: [N] -> [N, 1]; [N, T] unchanged.

    Example: [0.5, -1] -> [[0.5], [-1]].
    """
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1)
    if advantages.dim() == 2:
        return advantages
    raise ValueError(f"advantages must be [N] or [N, T], got {tuple(advantages.shape)}")


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Per-token PPO surrogate loss (to minimise).

    l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
    With `delta`, rho in the unclipped term is capped at delta (two-sided
    clipping), so a negative-advantage token cannot push an exploding ratio.

    ratio:      [N, T] or [N, 1]
    advantages: [N] (broadcast as [N, 1]) or [N, T]
    returns:    broadcast of the two, [N, T] or [N, 1]

    Example: A=+1, eps=0.2: rho=1.5 -> -1.2 (clipped); rho=0.5 -> -0.5.
             A=-1, eps=0.2: rho=0.5 -> 0.8 (clipped); rho=1.5 -> 1.5;
             with delta=1.3, rho=1.5 -> 1.3.
    """
    adv = token_advantages(advantages)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    return -torch.min(unclipped * adv, clipped * adv)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    With x = ref - logp:  k1 = -x,  k2 = x^2 / 2,  k3 = exp(x) - x - 1.
    k3 (the default, the seeds' formula) is unbiased and never negative.

    Example: logp = log 0.5, ref = log 0.25 -> x = -log 2:
    k1 = 0.6931, k2 = 0.2402, k3 = 0.5 + 0.6931 - 1 = 0.1931.
    """
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(x) - x - 1.0
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


# --------------------------------------------------------------------------
# Aggregation: per-token losses -> the scalar to backpropagate
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LossNormalisers:
    """What a minibatch's loss is divided by, counted over the whole generation batch.

    The minibatch is one of `num_minibatches` pieces of a generation batch that
    holds `num_sequences` completions and `num_tokens` completion tokens (all
    ranks); `minibatch_tokens` counts the tokens of this minibatch (bnpo), and
    `max_completion_length` is dr_grpo's fixed length. A count left None is taken
    from the tensors given (`filled`), i.e. a batch of one piece.
    """

    num_sequences: int | None = None
    num_tokens: float | None = None
    num_minibatches: int = 1
    minibatch_tokens: float | None = None
    max_completion_length: int | None = None

    def filled(self, mask: torch.Tensor, dtype: torch.dtype) -> "LossNormalisers":
        """These counts, with those left None counted from `mask` (one piece: the whole batch)."""
        whole = mask.to(dtype).sum()
        return dataclasses.replace(
            self,
            num_sequences=mask.shape[0] if self.num_sequences is None else self.num_sequences,
            num_tokens=whole if self.num_tokens is None else self.num_tokens,
            minibatch_tokens=whole if self.minibatch_tokens is None else self.minibatch_tokens,
        )


def _masked(per_token_loss: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L * M, M) with M in L's dtype and L broadcast to M's shape (sequence-level losses)."""
    mask = mask.to(per_token_loss.dtype)
    if per_token_loss.shape != mask.shape:
        per_token_loss = per_token_loss.expand_as(mask)
    return per_token_loss * mask, mask


def _count(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1.0)


@LOSS_AGGREGATIONS.register("grpo")
def per_sequence_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers
) -> torch.Tensor:
    """`grpo`: (1/num_sequences) sum_i (sum_t L M / sum_t M)."""
    masked, mask = _masked(per_token_loss, mask)
    per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / norm.num_sequences


@LOSS_AGGREGATIONS.register("bnpo")
def minibatch_token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers
) -> torch.Tensor:
    """`bnpo`: (sum L M / minibatch_tokens) / num_minibatches (TRL normalises per minibatch)."""
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / _count(norm.minibatch_tokens, masked) / norm.num_minibatches


@LOSS_AGGREGATIONS.register("dr_grpo")
def fixed_length_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers
) -> torch.Tensor:
    """`dr_grpo`: sum L M / (num_sequences * max_completion_length)."""
    if norm.max_completion_length is None:
        raise ValueError("dr_grpo needs max_completion_length")
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / (norm.num_sequences * norm.max_completion_length)


@LOSS_AGGREGATIONS.register("dapo")
def batch_token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers
) -> torch.Tensor:
    """`dapo`: sum L M / num_tokens (every completion token of the generation batch)."""
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / _count(norm.num_tokens, masked)


def _luspo_caveat(params: "PolicyLossParams") -> str | None:
    if params.importance_sampling_level == "sequence":
        return None
    return (
        f"algorithm.loss_type=luspo with importance_sampling_level={params.importance_sampling_level}: LUSPO is "
        "defined with the sequence-level ratio (set algorithm.importance_sampling_level=sequence to follow the paper)"
    )


@LOSS_AGGREGATIONS.register("luspo", caveat=_luspo_caveat)
def sequence_sum_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, norm: LossNormalisers
) -> torch.Tensor:
    """`luspo`: (1/num_sequences) sum_i sum_t L M, the per-sequence SUM averaged over sequences.

    LUSPO (length-unbiased sequence policy optimisation) scales each sequence's
    loss by its length: with the sequence-level ratio (importance_sampling_level
    "sequence", the setup of the paper) every token of row i carries the same
    loss l_i, so the sum is |o_i| * l_i. TRL 1.16 computes
    `(L * M).sum(-1).mean()` per micro-batch of B sequences and divides it by
    the gradient accumulation steps; over the GA micro-batches of a window (and
    averaged over ranks) that is sum_i sum_t L M / (B * GA * ranks), i.e. this
    with num_sequences counted over the generation batch, whatever the split.

    Example: L = [[1, 3], [2, x]], M = [[1, 1], [1, 0]], one piece:
    (4 + 2) / 2 = 3.
    """
    masked, _ = _masked(per_token_loss, mask)
    return masked.sum() / norm.num_sequences


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    norms: LossNormalisers = LossNormalisers(),
) -> torch.Tensor:
    """Reduce per-token losses of one minibatch to the scalar to backpropagate, with the
    aggregation registered as `loss_type`. Summing the results over the pieces of a
    generation batch gives the batch's loss:

    grpo:    (1/num_sequences) sum_i (sum_t L M / sum_t M)   per-sequence mean
    bnpo:    (sum L M / minibatch_tokens) / num_minibatches
    dr_grpo: sum L M / (num_sequences * max_completion_length)
    dapo:    sum L M / num_tokens
    luspo:   (1/num_sequences) sum_i sum_t L M            per-sequence sum

    For grpo, dr_grpo, dapo and luspo the sum over minibatches does not depend on how
    the batch is split; bnpo normalises per minibatch, as TRL does. A minibatch
    may itself be computed in micro-batches (to bound activation memory): each
    passes its minibatch's `minibatch_tokens`, and the micro-batches' results
    sum to the minibatch's. Counts left None in `norms` are taken from the
    tensors given, i.e. a single-piece batch.

    Example: L = [[1, 3], [2, x]], M = [[1, 1], [1, 0]], one piece, T_max=4:
    grpo (2 + 2)/2 = 2;  bnpo 6/3 = 2;  dr_grpo 6/(2*4) = 0.75;  dapo 6/3 = 2;  luspo 6/2 = 3.
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_type)  # a ConfigError (a ValueError) for an unknown name
    return aggregate(per_token_loss, mask, norms.filled(mask, per_token_loss.dtype))


# --------------------------------------------------------------------------
# The per-token objective and the whole loss
# --------------------------------------------------------------------------


@dataclass(eq=False)
class PolicyLossParams(AlgorithmConfig):
    """The settings a policy loss reads: the `algorithm:` section's own fields, by their names
    (grpo.config.algorithm.AlgorithmConfig declares each once, with its default and meaning), with
    `epsilon_high` resolved (None: epsilon) and `epsilon_low`, TRL's name for `epsilon`. A new
    loss setting is one field of that section; `of` carries it here.

    What each registered loss reads:
      clipped: epsilon_low, epsilon_high (the clip range [1 - eps_low, 1 + eps_high]), delta,
               importance_sampling_level
      cispo:   epsilon_high as the cap of the ratio itself (weight = min(rho, epsilon_high), not
               1 + epsilon_high; TRL's meaning, recommended 5.0), importance_sampling_level
      sapo:    sapo_temperature_pos (A > 0), sapo_temperature_neg (A <= 0), importance_sampling_level;
               epsilon_low / epsilon_high only for its clip statistics
      vespo:   vespo_k_pos, vespo_lambda_pos (A >= 0), vespo_k_neg, vespo_lambda_neg (A < 0); its
               ratio is always the sequence's product of token ratios (importance_sampling_level
               is not read); epsilon_low / epsilon_high only for its clip statistics
    """

    __hash__ = object.__hash__  # a default argument below: hashable by identity

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @classmethod
    def of(cls, section: AlgorithmConfig) -> "PolicyLossParams":
        """The section's settings, every field by its name."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(section)})


@POLICY_LOSSES.register("clipped")
def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`clipped`: the PPO-style surrogate of GRPO, DAPO and GSPO, per token.

    rho = exp(log_importance_weights(logp, old, level)),
    l = clipped_surrogate(rho, A, eps_low, eps_high, delta), [N, T] or [N, 1]
    (A [N] or [N, T]).
    Statistics (detached sums over masked tokens): clip_low (rho < 1 - eps_low
    with A < 0), clip_high (rho > 1 + eps_high with A > 0), clip_region (either).
    """
    log_w = log_importance_weights(logp, old_logp, mask, params.importance_sampling_level)
    ratio = torch.exp(log_w)
    per_token = clipped_surrogate(
        ratio, advantages, params.epsilon_low, params.epsilon_high, params.delta
    )
    return per_token, _trust_region_stats(ratio, advantages, mask, params)


def _clip_stats(
    low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    low, high = low.expand(mask.shape), high.expand(mask.shape)
    return {
        "clip_low": masked_sum(low.double(), mask),
        "clip_high": masked_sum(high.double(), mask),
        "clip_region": masked_sum((low | high).double(), mask),
    }


def _trust_region_stats(
    ratio, advantages, mask, params: PolicyLossParams
) -> dict[str, torch.Tensor]:
    """clip_low: rho < 1 - eps_low with A < 0; clip_high: rho > 1 + eps_high with A > 0; clip_region: either."""
    with torch.no_grad():
        adv = token_advantages(advantages)
        low = (ratio < 1.0 - params.epsilon_low) & (adv < 0)
        high = (ratio > 1.0 + params.epsilon_high) & (adv > 0)
        return _clip_stats(low, high, mask)


def _cispo_caveat(params: PolicyLossParams) -> str | None:
    if params.epsilon_high > 1:
        return None
    return (
        f"algorithm.epsilon_high={params.epsilon_high} is CISPO's cap on the importance weight itself (as in TRL), "
        "so every token's weight is at most that: the update is scaled down by it. Set algorithm.epsilon_high=5.0 "
        "(MiniMax-M1's and TRL's recommendation) or another cap > 1"
    )


@POLICY_LOSSES.register("cispo", caveat=_cispo_caveat)
def cispo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`cispo`: MiniMax-M1's clipped importance-sampling policy optimisation, per token.

    w = sg(min(rho, epsilon_high)),  l = -w * A * logp

    The importance weight is capped and detached (sg: stop gradient) instead of
    the update being clipped: every token keeps a gradient (-w A per unit of
    logp), where PPO's clip would zero it. Reads `epsilon_high` as the cap of
    the ratio itself, as TRL 1.16 does (its docs recommend 5.0; with TRL's
    default, epsilon_high = epsilon = 0.2, every weight is 0.2), no lower cap.
    rho follows `importance_sampling_level` (sequence: one weight per row).
    TRL's loss_type "cispo" = this with the `dapo` aggregation (sum over the
    batch's tokens / their count).

    Statistics (masked sums): the tokens whose weight was capped (rho >
    epsilon_high), split by the advantage's sign: clip_high with A > 0 (TRL's
    `cispo_clip_ratio`), clip_low with A < 0, clip_region either.

    Example: logp = log 0.5, old = log 0.25 (rho = 2), A = +1:
    cap 1.5 -> w = 1.5, l = -1.5 * log 0.5 = 1.0397, dl/dlogp = -1.5 (capped);
    cap 5 -> w = 2, l = 1.3863, dl/dlogp = -2.
    """
    ratio = torch.exp(
        log_importance_weights(logp, old_logp, mask, params.importance_sampling_level)
    )
    weight = torch.clamp(ratio, max=params.epsilon_high).detach()
    adv = token_advantages(advantages)
    per_token = -weight * adv * logp
    with torch.no_grad():
        capped = ratio > params.epsilon_high
        stats = _clip_stats(capped & (adv < 0), capped & (adv > 0), mask)
    return per_token, stats


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PolicyLossParams,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`sapo`: soft adaptive policy optimisation (Qwen, SAPO), per token.

    tau = sapo_temperature_pos if A > 0 else sapo_temperature_neg,
    l = -(4 / tau) * sigmoid(tau * (rho - 1)) * A

    A smooth gate instead of the hard clip: dl/drho = -4 s (1 - s) A with
    s = sigmoid(tau (rho - 1)), which is -A at rho = 1 (PPO's on-policy
    gradient) and decays as rho leaves 1, at a speed set by tau (the
    negative-advantage side a little faster by default, tau_neg = 1.05 > 1.0,
    TRL 1.16's defaults). rho follows `importance_sampling_level`. TRL's
    loss_type "sapo" = this with the `grpo` aggregation (per-sequence mean).

    Statistics (masked sums), for comparison with `clipped`: the tokens PPO's
    clip would have cut, which SAPO's gate attenuates instead: clip_low
    (rho < 1 - eps_low, A < 0), clip_high (rho > 1 + eps_high, A > 0), clip_region.

    Example: rho = 1, A = +1, tau 1: l = -4 * 0.5 = -2, dl/dlogp = -4 * 0.25 * rho = -1;
    rho = 1, A = -1, tau 1.05: l = 2 / 1.05 = 1.90476;
    rho = 2, A = +1: s = sigmoid(1) = 0.73106, l = -2.92423,
    dl/dlogp = -4 * 0.73106 * 0.26894 * 2 = -1.57290.
    """
    ratio = torch.exp(
        log_importance_weights(logp, old_logp, mask, params.importance_sampling_level)
    )
    adv = token_advantages(advantages)
    tau = torch.where(
        adv > 0,
        torch.as_tensor(params.sapo_temperature_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(params.sapo_temperature_neg, dtype=ratio.dtype, device=ratio.device),
    )
    per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    return per_token, _trust_region_stats(ratio, advantages, mask, params)


GAMMA_LOG_FLOOR = math.log(1e-8)
"""The lowest log importance weight VESPO's gamma weights use (w >= 1e-8), as TRL 1.16."""


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's gamma weight phi(w) of each sequence's importance weight w, detached.

        log w = clamp(sum_t m clamp(logp - old, -20, 20)  (+ sum_t log is_weight), log 1e-8, 20)
        phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w)

    so phi(1) = 1, phi rises as w^k below 1 and decays as e^(-lambda w) above.
    w is the product of the token ratios (a sum of log-ratios, not GSPO's mean).
    (k, lambda) = (k_pos, lambda_pos) where A >= 0, (k_neg, lambda_neg) where A < 0;
    lambda is floored at 1e-4; a NaN or inf phi becomes 0. `is_weights`: the
    rollout correction's weights between the sampling engine and pi_old
    (token level, [N, T], 1 at padding), folded into w in log space (each log
    clamped to [log 1e-8, 20]: a weight masked to 0 counts as 1e-8): w is then
    pi_theta / pi_sampler, as TRL 1.16 does with its vLLM importance-sampling
    ratio. Defaults are TRL 1.16's.

    advantages [N] or [N, T]; log_ratio, mask [N, T] -> phi [N, 1] ([N, T] for per-token A).

    Example (k_pos 2, lambda_pos 3; k_neg 3, lambda_neg 2):
    A = +1, log-ratios [0.1, -0.1] -> w = 1 -> phi = 1;
    A = +1, w = e^0.2 = 1.2214 -> phi = exp(3 + 0.4 - 3.66421) = 0.76781;
    A = -1, w = e^-0.2 = 0.81873 -> phi = exp(2 - 0.6 - 1.63746) = 0.78863.
    """
    adv = token_advantages(advantages)
    clamped = torch.clamp(log_ratio, -20.0, 20.0)
    keep = mask.bool()
    log_w = torch.where(keep, clamped, torch.zeros_like(clamped)).sum(-1, keepdim=True)
    if is_weights is not None:
        log_is = torch.clamp(torch.log(is_weights.to(log_w.dtype)), GAMMA_LOG_FLOOR, 20.0)
        if log_is.shape[-1] != 1:  # token weights: the row's counted tokens (1, log 0, elsewhere)
            log_is = torch.where(keep, log_is, torch.zeros_like(log_is))
        log_w = log_w + log_is.sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, GAMMA_LOG_FLOOR, 20.0)
    w = torch.exp(log_w)
    nonneg = adv >= 0
    k = torch.where(nonneg, _scalar(k_pos, log_w), _scalar(k_neg, log_w))
    lam = torch.where(nonneg, _scalar(lambda_pos, log_w), _scalar(lambda_neg, log_w)).clamp(
        min=1e-4
    )
    phi = torch.exp(lam + k * log_w - lam * w)
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


def _vespo_caveat(params: PolicyLossParams) -> str | None:
    if params.importance_sampling_level == "token":
        return None
    return (
        "algorithm.policy_loss=vespo computes its own sequence-level weight; "
        f"importance_sampling_level={params.importance_sampling_level} only changes the clip statistics and the "
        "bias-corrected KL (leave it at token, as TRL advises)"
    )


@POLICY_LOSSES.register(
    "vespo",
    # policy_loss passes the rollout correction's weights in (`correction_weights=`) rather
    # than multiplying the per-token loss by them
    folds_correction=True,
    caveat=_vespo_caveat,
    sequence_metrics={"vespo/phi_seq_mean": "phi_seq_sum"},
)
def vespo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    params: PolicyLossParams,
    *,
    correction_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`vespo`: variational sequence-level soft policy optimisation (VESPO), per token.

        l = -phi(w) * A * logp,   phi = gamma_weights(A, logp - old, mask, correction_weights, ...)

    phi is detached: the gradient is -phi A per unit of logp, a REINFORCE step
    weighted by a smooth, asymmetric function of the sequence's importance weight
    instead of PPO's hard clip. `importance_sampling_level` is not read (w is
    always the sequence's product of ratios; TRL warns unless it is "token").
    The rollout correction's weights, when a correction is configured, go into w
    (`correction_weights`) instead of multiplying the loss (`folds_correction`);
    TRL accepts only its token-level modes for this. TRL's loss_type "vespo" =
    this with the `dapo` aggregation.

    Statistics: phi_seq_sum, the sum over rows of phi (of each row's masked mean
    of phi for per-token advantages; TRL's vespo/phi_seq_mean once divided by the
    rows), and, for comparison with `clipped`, clip_low / clip_high / clip_region
    of the token ratio against epsilon_low / epsilon_high (nothing is clipped).

    Example: logp = log 0.5 on both tokens of a row, old = logp (w = 1), A = +1:
    phi = 1, l = -log 0.5 = 0.6931 per token, dl/dlogp = -1; A = -1 with
    logp - old = [-0.1, -0.1]: phi = 0.78863, dl/dlogp = +0.78863.
    """
    log_ratio = logp - old_logp
    phi = gamma_weights(
        advantages,
        log_ratio,
        mask,
        correction_weights,
        params.vespo_k_pos,
        params.vespo_lambda_pos,
        params.vespo_k_neg,
        params.vespo_lambda_neg,
    )
    adv = token_advantages(advantages)
    per_token = -phi * adv * logp
    stats = _trust_region_stats(torch.exp(log_ratio.detach()), advantages, mask, params)
    with torch.no_grad():
        if phi.shape[-1] == 1:
            stats["phi_seq_sum"] = phi.double().sum()
        else:
            m = mask.double()
            stats["phi_seq_sum"] = ((phi.double() * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    return per_token, stats


def off_policy_mask(
    advantages: torch.Tensor,
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: drop a sequence with a negative advantage whose
    sampling policy has drifted too far from the current one.

        d_i = sum_t m (sampling - sg(logp)) / max(1, sum_t m)    (a KL estimate, per sequence)
        keep_i = A_i >= 0  or  d_i <= threshold

    sampling: the log-probs the completions were sampled with (the engine's
    when it reports them, else pi_old: TRL 1.16's choice), so both the drift
    of the updates and the sampler / trainer mismatch count. A NaN difference
    (a token the engine could not score) counts as 0, so it cannot drop a
    sequence by itself (TRL's nan_to_num: an infinite one becomes the largest
    finite float). No gradient.

    advantages [N] or [N, T]; logp, sampling_logp, mask [N, T] -> float [N, 1] of 1 (keep)
    and 0 (drop) in mask's float dtype (logp's for an integer mask); [N, T] for per-token A.

    Example: threshold 0.5, sampling - logp = [[0.2, 0.4], [1.0, 0.6], [1.0, 0.6]],
    mask all 1, A = [-1, -1, +1]: d = [0.3, 0.8, 0.8] -> keep [[1], [0], [1]].
    """
    diff = torch.nan_to_num(sampling_logp.detach() - logp.detach(), nan=0.0)
    m = mask if mask.is_floating_point() else mask.to(diff.dtype)
    drift = (diff * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (token_advantages(advantages) >= 0) | (drift <= threshold)
    return keep.to(m.dtype)


def entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, quantile: float, scope: str
) -> torch.Tensor:
    """The high-entropy tokens that keep their policy loss ("Beyond the 80/20 rule", Wang et al. 2025).

    keep_{i,t} = m_{i,t} and H_{i,t} >= q_{1 - quantile}(H over the masked tokens)

    so quantile=0.2 keeps the top 20% (the paper's choice), 1.0 every masked
    token, 0.0 only the tokens of highest entropy. The threshold is the
    (1 - quantile) quantile with linear interpolation between the sorted values
    (torch.quantile's default, which TRL 1.16's get_high_entropy_mask uses):
    rank = (1 - quantile) (n - 1), threshold = lerp(v[floor rank], v[ceil rank], frac).
    Ties: every token at or above the threshold is kept, so equal entropies at
    the threshold can keep more than the quantile's share (all equal: all
    kept), and an interpolated threshold can keep fewer than quantile * n.

    scope "completion": a threshold per completion, over its own masked tokens,
    so the mask does not depend on how the batch is split into micro-batches.
    scope "batch": one threshold over all masked tokens of the tensors given
    (TRL: the tokens of one forward pass, gathered over processes; pass the
    tensors of the same piece to reproduce it).

    entropy, mask: [N, T] -> bool [N, T], False where mask is 0 and for a row
    (or batch) without masked tokens. Computed in float64, no gradient.

    Example: H = [[0.1, 0.2, 0.3, 0.4], [0.8, 0.9, x, x]], mask [[1,1,1,1],[1,1,0,0]],
    quantile 0.5: batch: sorted [.1 .2 .3 .4 .8 .9], rank 2.5 -> 0.35 ->
    [[F, F, F, T], [T, T, F, F]]; completion: row 0 rank 1.5 -> 0.25, row 1
    rank 0.5 -> 0.85 -> [[F, F, T, T], [F, T, F, F]].
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(
            f"top_entropy_quantile must be in [0, 1] (0.2 keeps the top 20%), got {quantile!r}"
        )
    if scope not in ENTROPY_MASK_SCOPES:
        raise ValueError(f"entropy mask scope must be one of {ENTROPY_MASK_SCOPES}, got {scope!r}")
    if entropy.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            f"entropy and mask must both be [N, T], got {tuple(entropy.shape)} and {tuple(mask.shape)}"
        )
    keep = mask.bool()
    values = entropy.detach().double()
    if scope == "batch":
        values, keep = values.reshape(1, -1), keep.reshape(1, -1)
    # masked-out entries sort last, so the first n of each row are its masked values in order
    ordered = torch.where(keep, values, torch.full_like(values, float("inf"))).sort(dim=-1).values
    n = keep.sum(dim=-1, keepdim=True)
    rank = (1.0 - quantile) * (n - 1).clamp(min=0).double()
    below, above = rank.floor().long(), rank.ceil().long()
    threshold = torch.lerp(ordered.gather(-1, below), ordered.gather(-1, above), rank - below)
    selected = keep & (values >= threshold) & (n > 0)
    return selected.reshape(entropy.shape)


@dataclass(frozen=True)
class LossSettings:
    """How a run's policy loss is computed (algorithm.*): the same for every micro-batch.

    objective:  the registered policy loss (`clipped`, `cispo`, `sapo`, `vespo`), reading `params`
    loss_type:  the registered aggregation (`grpo`, `bnpo`, `dr_grpo`, `dapo`, `luspo`)
    beta:       the KL term's weight (0: none), with `kl_estimator` (k1, k2, k3)
    kl_bias_correction: multiply the KL per token by the importance ratio pi_theta / pi_old
                (token or sequence level, as the policy's ratio; not detached), DeepSeek-V3.2's
                unbiased KL gradient (TRL's use_bias_correction_kl)
    correction: truncated importance sampling against the engine's sampling logprobs
                (`correction_weights`), or None
    off_policy_mask_threshold: drop negative-advantage sequences whose sampling policy drifted
                further than this (`off_policy_mask`); None: keep all
    """

    objective: str = "clipped"
    loss_type: str = "dapo"
    params: PolicyLossParams = PolicyLossParams()
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_bias_correction: bool = False
    correction: RolloutCorrection | None = None
    off_policy_mask_threshold: float | None = None

    @classmethod
    def of(cls, a: AlgorithmConfig, max_staleness: int = 0) -> "LossSettings":
        """The `algorithm:` section's loss settings (rollout_correction `token_truncate` is level
        token, mode truncate; none: no correction; auto: by rollout.max_staleness, `max_staleness`)."""
        correction = None
        mode_name = resolved_rollout_correction(a.rollout_correction, max_staleness)
        if mode_name != "none":
            level, mode = mode_name.split("_")
            correction = RolloutCorrection(level=level, mode=mode, cap=a.rollout_correction_cap)
        return cls(
            objective=a.policy_loss,
            loss_type=a.loss_type,
            params=PolicyLossParams.of(a),
            beta=a.beta,
            kl_estimator=a.kl_estimator,
            kl_bias_correction=a.kl_bias_correction,
            correction=correction,
            off_policy_mask_threshold=a.off_policy_mask_threshold,
        )


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings = LossSettings(),
    norms: LossNormalisers = LossNormalisers(),
    *,
    ref_logp: torch.Tensor | None = None,
    entropy_mask: torch.Tensor | None = None,
    sampling_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective for one minibatch: policy loss `settings.objective` (times the
    off-policy mask, the entropy mask and the rollout correction's weights, when given)
    + beta * KL (times the ratio with kl_bias_correction), aggregated by
    `settings.loss_type` with the batch's `norms`, minus the entropy bonus.

        l_{i,t} = opm_i * keep_{i,t} * w_{i,t} * policy_{i,t} + beta * KL_{i,t} (* rho_{i,t})
        loss    = aggregate(l) - entropy_coef * entropy_bonus(H, M, keep)

    logp:      [N, T] log pi_theta of the sampled tokens (requires grad)
    old_logp:  [N, T] log pi_old (the policy the update starts from); None means
               pi_old = pi_theta (num_iterations == 1), i.e. logp.detach(): ratio 1, no extra pass
    advantages:[N] (one per completion) or [N, T] (per token, GAE)
    mask:      [N, T] 1 for completion tokens that count
    ref_logp:  [N, T] log pi_ref, needed when beta > 0
    entropy_mask: bool [N, T] (`entropy_mask(...)`), or None for every token. It
               multiplies the policy term only, not the KL, and the normalisers
               stay those of `mask` (a dropped token still counts in the
               denominators), as TRL's top_entropy_quantile does.
    sampling_logp: [N, T] log-probs the rollout engine sampled with, or None;
               given, the statistics gain the mismatch sums (`mismatch_stats`), and
               `settings.correction` multiplies the policy term by the detached
               weights of `correction_weights(old_logp, sampling_logp, mask, correction)`.
               The policy loss's own ratio stays pi_theta / pi_old. A policy loss that
               folds the correction into its own weights (`folds_correction`: vespo) gets
               the weights as `correction_weights=` instead. The off-policy mask compares
               sampling_logp (else old_logp) with logp.
    entropy:   [N, T] the policy's entropy per token, with gradient; needed when
               entropy_coef != 0: the loss then subtracts entropy_coef * `entropy_bonus`
               (over mask * entropy_mask, scaled by the minibatch's share, see there).

    Returns the scalar loss and detached float64 statistics summed over masked
    tokens (the caller divides by token counts): clip_low, clip_high,
    clip_region (as the policy loss defines them, and whatever else it adds:
    vespo's phi_seq_sum); kl when beta > 0 (times the ratio with
    kl_bias_correction, as TRL logs it); logprob_diff_sum, logprob_diff_max (a
    max, not a sum), is_ratio_sum when sampling_logp is given; is_weight_sum,
    is_capped when a correction is too; off_policy_masked (sequences with
    counted tokens that the off-policy mask dropped) with a threshold;
    policy_loss (the loss before the bonus) when entropy_coef != 0.
    """
    if old_logp is None:
        old_logp = logp.detach()
    correction = settings.correction
    if correction is not None and sampling_logp is None:
        raise ValueError(
            "a rollout correction needs sampling_logp, the log-probs the engine sampled with"
        )
    if sampling_logp is not None and sampling_logp.shape != mask.shape:
        raise ValueError(
            f"sampling_logp must have mask's shape {tuple(mask.shape)}, got {tuple(sampling_logp.shape)}"
        )
    objective = POLICY_LOSSES.get(settings.objective)
    weights = (
        correction_weights(old_logp, sampling_logp, mask, correction)
        if correction is not None
        else None
    )
    if getattr(objective, "folds_correction", False):
        per_token, stats = objective(
            logp, old_logp, advantages, mask, settings.params, correction_weights=weights
        )
        weights = None  # already in the policy loss
    else:
        per_token, stats = objective(logp, old_logp, advantages, mask, settings.params)
    if settings.off_policy_mask_threshold is not None:
        drift_from = sampling_logp if sampling_logp is not None else old_logp
        keep_seq = off_policy_mask(
            advantages, logp, drift_from, mask, settings.off_policy_mask_threshold
        )
        per_token = per_token * keep_seq.to(per_token.dtype)
        with torch.no_grad():
            dropped = (keep_seq == 0) & mask.bool()
            stats["off_policy_masked"] = dropped.any(-1).double().sum()
    if entropy_mask is not None:
        if entropy_mask.shape != mask.shape:
            raise ValueError(
                f"entropy_mask must have mask's shape {tuple(mask.shape)}, got {tuple(entropy_mask.shape)}"
            )
        per_token = per_token * entropy_mask.to(per_token.dtype)
    if sampling_logp is not None:
        stats.update(mismatch_stats(old_logp, sampling_logp, mask, correction))
    if weights is not None:
        per_token = per_token * weights.to(per_token.dtype)
    if settings.beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        kl = kl_estimate(logp, ref_logp, settings.kl_estimator)
        if settings.kl_bias_correction:
            level = settings.params.importance_sampling_level
            kl = kl * torch.exp(log_importance_weights(logp, old_logp, mask, level))
        per_token = per_token + settings.beta * kl
        stats["kl"] = masked_sum(kl.detach().expand(mask.shape), mask)
    loss = aggregate_loss(per_token, mask, settings.loss_type, norms)
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy, the policy's entropy per token")
        counts = norms.filled(mask, entropy.dtype)
        bonus = entropy_bonus(
            entropy, mask, counts.minibatch_tokens, counts.num_minibatches, keep=entropy_mask
        )
        stats["policy_loss"] = loss.detach().double()
        loss = loss - entropy_coef * bonus
    return loss, stats


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) as a detached float64 scalar, for metrics."""
    return (x.detach().double() * mask.double()).sum()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v along the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
