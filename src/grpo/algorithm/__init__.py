"""The exact GRPO math as pure tensor functions.

Nothing here touches a model, an optimizer or a config object: every function
takes tensors and plain numbers and returns tensors, so each formula can be
checked by hand (tests/algorithm/, a file for each module here) and against
TRL (tests/test_trl_equivalence.py).

    advantages.py  rewards -> advantages: `AdvantageInputs`, the registered estimators (grpo, dr_grpo, rloo,
                   reinforce_pp) and multi-objective aggregations (sum_then_normalize, GDPO's normalize_then_sum)
    values.py      PPO's critic math: outcome token rewards, GAE (the registered `gae` estimator, needs_values),
                   the critic's returns, whitening, value loss
    losses.py      ratios, clipping, KL (optionally importance-weighted), policy losses (clipped, cispo,
                   sapo, vespo) and loss aggregations (grpo, bnpo, dr_grpo, dapo, luspo; registered),
                   the entropy mask, the off-policy sequence mask, policy_loss
    entropy.py     the entropy bonus and its adaptive coefficient
    correction.py  rollout correction: truncated importance sampling between the sampler and the trainer
    schedules.py   learning-rate schedules

Shapes use these letters: N completions in the batch (= prompts x G), G
completions per prompt (one group), K reward functions, T completion tokens.
"""

from grpo.algorithm.advantages import (
    ADVANTAGE_EPS,
    AdvantageInputs,
    combine_rewards,
    dr_grpo_advantages,
    group_advantages,
    group_reward_std,
    grpo_advantages,
    nan_std,
    needs_values,
    normalize_then_sum,
    normalize_then_sum_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    sum_then_normalize,
)
from grpo.algorithm.correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    RolloutCorrection,
    correction_weights,
    mismatch_stats,
)
from grpo.algorithm.entropy import applied_entropy_coef, entropy_bonus, next_entropy_coef
from grpo.algorithm.losses import (
    ENTROPY_MASK_SCOPES,
    GAMMA_LOG_FLOOR,
    LossNormalisers,
    LossSettings,
    PolicyLossParams,
    aggregate_loss,
    batch_token_mean,
    cispo_policy_loss,
    clipped_policy_loss,
    clipped_surrogate,
    entropy_from_logits,
    entropy_mask,
    fixed_length_mean,
    gamma_weights,
    kl_estimate,
    log_importance_weights,
    masked_mean,
    masked_sum,
    minibatch_token_mean,
    off_policy_mask,
    per_sequence_mean,
    policy_loss,
    sapo_policy_loss,
    sequence_sum_mean,
    token_advantages,
    vespo_policy_loss,
)
from grpo.algorithm.schedules import lr_multiplier
from grpo.algorithm.values import (
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    gae_estimator,
    gae_returns,
    masked_whiten,
    outcome_token_rewards,
)
from grpo.registry import (
    IMPORTANCE_LEVELS,
    KL_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
)

__all__ = [
    "ADVANTAGE_EPS",
    "AdvantageInputs",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "ENTROPY_MASK_SCOPES",
    "GAMMA_LOG_FLOOR",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS",
    "LossNormalisers",
    "LossSettings",
    "PolicyLossParams",
    "RolloutCorrection",
    "aggregate_loss",
    "applied_entropy_coef",
    "batch_token_mean",
    "cispo_policy_loss",
    "clipped_policy_loss",
    "clipped_surrogate",
    "clipped_value_loss",
    "combine_rewards",
    "correction_weights",
    "dr_grpo_advantages",
    "entropy_bonus",
    "entropy_from_logits",
    "entropy_mask",
    "explained_variance",
    "fixed_length_mean",
    "gae_advantages",
    "gae_estimator",
    "gae_returns",
    "gamma_weights",
    "group_advantages",
    "group_reward_std",
    "grpo_advantages",
    "kl_estimate",
    "log_importance_weights",
    "lr_multiplier",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "minibatch_token_mean",
    "mismatch_stats",
    "nan_std",
    "needs_values",
    "next_entropy_coef",
    "normalize_then_sum",
    "normalize_then_sum_advantages",
    "off_policy_mask",
    "outcome_token_rewards",
    "overlong_penalty",
    "per_sequence_mean",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sapo_policy_loss",
    "sequence_sum_mean",
    "sum_then_normalize",
    "token_advantages",
    "vespo_policy_loss",
]
