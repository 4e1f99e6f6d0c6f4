"""The exact GRPO math as pure tensor functions.

Nothing here touches a model, an optimizer or a config object: every function
takes tensors and plain numbers and returns tensors, so each formula can be
checked by hand (tests/algorithm/, a file for each module here) and against
TRL (tests/test_trl_equivalence.py).

    advantages.py  rewards -> advantages (registered advantage estimators: grpo, dr_grpo, rloo, reinforce_pp)
    values.py      PPO's critic math: outcome token rewards, GAE (the `gae` estimator), whitening, value loss
    losses.py      ratios, clipping, KL, policy losses (clipped, cispo, sapo) and loss aggregations
                   (registered), the entropy mask, policy_loss
    correction.py  rollout correction: truncated importance sampling between the sampler and the trainer
    schedules.py   learning-rate schedules

Shapes use these letters: N completions in the batch (= prompts x G), G
completions per prompt (one group), K reward functions, T completion tokens.
"""

from grpo.algorithm.advantages import (
    ADVANTAGE_EPS,
    combine_rewards,
    dr_grpo_advantages,
    group_advantages,
    group_reward_std,
    grpo_advantages,
    nan_std,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from grpo.algorithm.correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    RolloutCorrection,
    correction_weights,
    mismatch_stats,
)
from grpo.algorithm.losses import (
    ENTROPY_MASK_SCOPES,
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
    kl_estimate,
    log_importance_weights,
    masked_mean,
    masked_sum,
    minibatch_token_mean,
    per_sequence_mean,
    policy_loss,
    sapo_policy_loss,
    token_advantages,
)
from grpo.algorithm.schedules import lr_multiplier
from grpo.algorithm.values import (
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    gae_estimator,
    masked_whiten,
    outcome_token_rewards,
)
from grpo.registry import IMPORTANCE_LEVELS, KL_ESTIMATORS, SCALE_REWARDS

__all__ = [
    "ADVANTAGE_EPS",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "ENTROPY_MASK_SCOPES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "SCALE_REWARDS",
    "LossNormalisers",
    "LossSettings",
    "PolicyLossParams",
    "RolloutCorrection",
    "aggregate_loss",
    "batch_token_mean",
    "cispo_policy_loss",
    "clipped_policy_loss",
    "clipped_surrogate",
    "clipped_value_loss",
    "combine_rewards",
    "correction_weights",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "entropy_mask",
    "explained_variance",
    "fixed_length_mean",
    "gae_advantages",
    "gae_estimator",
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
    "outcome_token_rewards",
    "overlong_penalty",
    "per_sequence_mean",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sapo_policy_loss",
    "token_advantages",
]
