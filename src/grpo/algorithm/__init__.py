"""The exact GRPO math as pure tensor functions.

Nothing here touches a model, an optimizer or a config object: every function
takes tensors and plain numbers and returns tensors, so each formula can be
checked by hand (tests/test_algorithm.py) and against TRL
(tests/test_trl_equivalence.py).

    advantages.py  rewards -> advantages (registered advantage estimators)
    losses.py      ratios, clipping, KL, policy losses and loss aggregations (registered)
    schedules.py   learning-rate schedules

Shapes use these letters: N completions in the batch (= prompts x G), G
completions per prompt (one group), K reward functions, T completion tokens.
"""

from grpo.algorithm.advantages import (
    ADVANTAGE_EPS,
    combine_rewards,
    group_advantages,
    group_reward_std,
    grpo_advantages,
    nan_std,
    overlong_penalty,
)
from grpo.algorithm.losses import (
    LossNormalisers,
    PolicyLossParams,
    aggregate_loss,
    batch_token_mean,
    clipped_policy_loss,
    clipped_surrogate,
    entropy_from_logits,
    fixed_length_mean,
    kl_estimate,
    log_importance_weights,
    masked_mean,
    masked_sum,
    minibatch_token_mean,
    per_sequence_mean,
    policy_loss,
)
from grpo.algorithm.schedules import lr_multiplier
from grpo.registry import IMPORTANCE_LEVELS, KL_ESTIMATORS, SCALE_REWARDS

__all__ = [
    "ADVANTAGE_EPS", "IMPORTANCE_LEVELS", "KL_ESTIMATORS", "SCALE_REWARDS", "LossNormalisers", "PolicyLossParams",
    "aggregate_loss", "batch_token_mean", "clipped_policy_loss", "clipped_surrogate", "combine_rewards",
    "entropy_from_logits", "fixed_length_mean", "group_advantages", "group_reward_std", "grpo_advantages",
    "kl_estimate", "log_importance_weights", "lr_multiplier", "masked_mean", "masked_sum", "minibatch_token_mean",
    "nan_std", "overlong_penalty", "per_sequence_mean", "policy_loss",
]
