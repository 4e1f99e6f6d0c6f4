"""The config's `algorithm:` section: the objective (a paper's preset, the advantage estimator,
policy loss, KL, clipping, aggregation, entropy terms, rollout correction, PPO's critic); it
checks its own fields."""

from __future__ import annotations

from dataclasses import dataclass

from grpo import registry
from grpo.config.checks import WholeConfig, one_of, positive
from grpo.config.errors import ConfigError
from grpo.config.presets import PRESETS

ROLLOUT_CORRECTIONS = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
    "auto",
)


def resolved_rollout_correction(correction: str, max_staleness: int) -> str:
    """algorithm.rollout_correction as a run applies it: `auto` is none in a synchronous run and
    token_truncate when generation runs ahead of training (rollout.max_staleness > 0)."""
    if correction != "auto":
        return correction
    return "token_truncate" if max_staleness > 0 else "none"


@dataclass
class AlgorithmConfig:
    preset: str | None = None
    """A paper's combination of the settings below: `grpo` (DeepSeekMath: group scaling,
    per-sequence mean, epsilon 0.2, beta 0.04), `dr_grpo` (no std scaling, the dr_grpo
    normaliser, beta 0), `dapo` (clip-higher 0.2/0.28, token-level mean, dynamic sampling,
    beta 0, the soft overlong penalty over the last fifth of max_completion_length) or `gspo`
    (sequence-level ratio, epsilon 3e-4/4e-4, beta 0). Keys set beside it override it; the
    resolved values are printed at start and saved in the run directory's config.yaml."""
    beta: float = 0.0
    """KL coefficient. 0 (TRL's default) loads no reference model; DeepSeekMath used 0.04."""
    kl_estimator: str = "k3"
    """k1, k2 or k3 (exp(x) - x - 1, the default)."""
    epsilon: float = 0.2
    """Lower clipping range: ratios below 1 - epsilon stop counting for negative advantages."""
    epsilon_high: float | None = None
    """Upper clipping range; None = epsilon. DAPO's clip-higher uses 0.28."""
    delta: float | None = None
    """Cap on the unclipped ratio (two-sided clipping); None disables. Must be > 1 + epsilon_high."""
    advantage_estimator: str = "grpo"
    """How rewards become advantages (grpo.registry.ADVANTAGE_ESTIMATORS): `grpo`
    (group-relative, scaled as `scale_rewards` says), `dr_grpo` (group mean only), `rloo`
    (leave-one-out group baseline), `reinforce_pp` (REINFORCE++: the batch's mean and std),
    or `gae` (PPO: per-token advantages from a learned critic, see `gamma`, `lam`, `critic_*`)."""
    scale_rewards: str = "group"
    """For the `grpo` estimator: group (GRPO), batch, or none (Dr. GRPO)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """How several reward functions become one advantage: `sum_then_normalize` (the weighted sum,
    then the estimator) or `normalize_then_sum` (GDPO: each function normalised within its group,
    the weighted sum, then normalised over the batch; `grpo` estimator only, `scale_rewards` unused).
    TRL's multi_objective_aggregation, with its default."""
    policy_loss: str = "clipped"
    """Per-token objective (grpo.registry.POLICY_LOSSES): `clipped`, the PPO-style clipped
    surrogate at `importance_sampling_level`, with `epsilon`, `epsilon_high` and `delta`;
    `cispo` (MiniMax-M1: the clipped importance weight, detached, times A log pi); `sapo`
    (a soft, sigmoid-gated ratio instead of hard clipping; `sapo_temperature_*`); `vespo`
    (a detached gamma weight of the sequence's importance weight times A log pi; `vespo_*`)."""
    sapo_temperature_pos: float = 1.0
    """SAPO's gate temperature for tokens with positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """SAPO's gate temperature for tokens with negative advantage (TRL's default)."""
    vespo_k_pos: float = 2.0
    """VESPO's power k for A >= 0: how fast sequences with importance weight < 1 are down-weighted (TRL's default)."""
    vespo_lambda_pos: float = 3.0
    """VESPO's decay lambda for A >= 0: how fast sequences with importance weight > 1 are down-weighted (TRL's default)."""
    vespo_k_neg: float = 3.0
    """VESPO's power k for A < 0 (TRL's default)."""
    vespo_lambda_neg: float = 2.0
    """VESPO's decay lambda for A < 0 (TRL's default)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose mean
    log-prob drift (sampling policy minus current) exceeds this is left out of the policy loss
    (e.g. 0.5); None: off (TRL's default). The engine's sampling logprobs are used when it reports them."""
    kl_bias_correction: bool = False
    """Multiply the KL term per token by the importance ratio pi_theta / pi_old (DeepSeek-V3.2's
    unbiased KL gradient; differentiable, so it changes the gradient even at ratio 1). TRL's
    use_bias_correction_kl, whose default is True (and the TRL API sets it); grpo's own default keeps
    the plain KL. Only acts with beta > 0."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy over the tokens the policy
    loss acts on (TRL's entropy_coef; 0: off). With use_adaptive_entropy, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control: after each optimizer pass the coefficient moves by
    entropy_coef_delta (up when the pass's entropy <= entropy_target, else down, within
    [entropy_coef_min, entropy_coef_max]), and it is applied only while the last entropy was
    <= entropy_target. The coefficient is saved in checkpoints."""
    entropy_target: float = 0.2
    """The adaptive controller's target mean entropy (nats per token; TRL's default 0.2 acts only near
    collapse: set it near the `entropy` logged early in training)."""
    entropy_coef_delta: float = 0.005
    """The adaptive controller's step per optimizer pass (TRL's default)."""
    entropy_coef_min: float = 0.0
    """The adaptive coefficient's lower bound (TRL's default)."""
    entropy_coef_max: float = 1.0
    """The adaptive coefficient's upper bound (TRL's default)."""
    top_entropy_quantile: float = 1.0
    """Train only on the highest-entropy tokens: 0.2 keeps the top 20% by the policy's entropy
    (Wang et al. 2025, "Beyond the 80/20 rule"); 1.0 keeps every token."""
    entropy_mask_scope: str = "completion"
    """Where `top_entropy_quantile`'s threshold is taken: `completion` (each completion's own
    tokens; independent of how the batch is split) or `batch` (the tokens of one forward pass, as TRL)."""
    rollout_correction: str = "auto"
    """Truncated importance sampling between the engine that sampled and the policy the update
    starts from (a different precision or engine gives slightly different logprobs; generating
    ahead, older weights): none, token_truncate, token_mask, sequence_truncate or sequence_mask
    (TRL's modes), or auto: none in a synchronous run, token_truncate when generation runs ahead
    of training (rollout.max_staleness > 0). The mismatch is logged either way
    (rollout/logprob_diff_mean, _max, rollout/is_ratio)."""
    rollout_correction_cap: float = 3.0
    """Upper bound of the correction's ratio: truncate modes cap at it, mask modes drop what exceeds it."""
    gamma: float = 1.0
    """`gae`: discount per token."""
    lam: float = 0.95
    """`gae`: GAE's lambda (1.0: Monte-Carlo returns minus the value baseline)."""
    critic_learning_rate: float = 1e-5
    """`gae`: learning rate of the critic (a value head on a copy of the policy's trunk, own AdamW)."""
    value_clip: float | None = 0.2
    """`gae`: the value loss's clipping range around the values before the update; None: unclipped."""
    whiten_advantages: bool = True
    """`gae`: normalise the batch's token advantages to mean 0 and std 1, as PPO does."""
    loss_type: str = "dapo"
    """How per-token losses are summed into the batch's loss (grpo.registry.LOSS_AGGREGATIONS):
    grpo, bnpo, dr_grpo, dapo (TRL's default) or luspo (each completion's sum, averaged over
    completions; LUSPO, meant with importance_sampling_level=sequence)."""
    importance_sampling_level: str = "token"
    """token, or sequence (GSPO)."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu). 1 needs no old-logprob pass."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length out of the loss."""
    ref_sync_steps: int | None = None
    """Replace the reference by the policy every N optimizer steps (R1: 400); None never."""
    ref_sync_alpha: float = 1.0
    """Blend on sync: ref <- alpha * policy + (1 - alpha) * ref; 1.0 replaces."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample new prompts until the batch is full."""
    max_sampling_rounds: int = 4
    """Most generation rounds per step when dynamic_sampling is on."""

    def check(self, cfg: WholeConfig, world_size: int = 1) -> None:
        if self.preset is not None:
            one_of("algorithm.preset", self.preset, tuple(PRESETS))
        registry.ADVANTAGE_ESTIMATORS.check(self.advantage_estimator)
        registry.POLICY_LOSSES.check(self.policy_loss)
        registry.LOSS_AGGREGATIONS.check(self.loss_type)
        one_of("algorithm.scale_rewards", self.scale_rewards, registry.SCALE_REWARDS)
        one_of("algorithm.kl_estimator", self.kl_estimator, registry.KL_ESTIMATORS)
        one_of(
            "algorithm.importance_sampling_level",
            self.importance_sampling_level,
            registry.IMPORTANCE_LEVELS,
        )
        positive("algorithm.beta", self.beta, allow_zero=True)
        if not 0 <= self.epsilon < 1:
            raise ConfigError(f"algorithm.epsilon: must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None:
            positive("algorithm.epsilon_high", self.epsilon_high, allow_zero=True)
        if self.delta is not None and self.delta <= 1 + cfg.epsilon_high:
            raise ConfigError(
                f"algorithm.delta: must be > 1 + epsilon_high = {1 + cfg.epsilon_high} to cap only large ratios, got {self.delta}"
            )
        if self.num_iterations < 1:
            raise ConfigError(f"algorithm.num_iterations: must be >= 1, got {self.num_iterations}")
        if self.ref_sync_steps is not None:
            positive("algorithm.ref_sync_steps", self.ref_sync_steps)
            if self.beta == 0:
                raise ConfigError(
                    "algorithm.ref_sync_steps: set with beta = 0, where no reference model is used; "
                    "set algorithm.beta > 0 or remove ref_sync_steps"
                )
        if not 0 < self.ref_sync_alpha <= 1:
            raise ConfigError(
                f"algorithm.ref_sync_alpha: must be in (0, 1], got {self.ref_sync_alpha}"
            )
        positive("algorithm.max_sampling_rounds", self.max_sampling_rounds)
        if self.advantage_estimator == "gae" and getattr(getattr(cfg.model, "lora", None), "r", 0):
            raise ConfigError(
                "algorithm.advantage_estimator: gae's critic is a full copy of the policy's trunk, which is not built "
                "for a LoRA policy (model.lora.r > 0); train PPO without LoRA (model.lora.r=0) or use a critic-free estimator"
            )
        positive("algorithm.sapo_temperature_pos", self.sapo_temperature_pos)
        positive("algorithm.sapo_temperature_neg", self.sapo_temperature_neg)
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(
                f"algorithm.top_entropy_quantile: must be in (0, 1] (the fraction of tokens kept, 1.0 keeps all), got {self.top_entropy_quantile}"
            )
        one_of("algorithm.entropy_mask_scope", self.entropy_mask_scope, ("completion", "batch"))
        one_of("algorithm.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction_cap <= 1:
            raise ConfigError(
                f"algorithm.rollout_correction_cap: must be > 1 (a bound on importance ratios), got {self.rollout_correction_cap}"
            )
        if not 0 <= self.gamma <= 1:
            raise ConfigError(f"algorithm.gamma: must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"algorithm.lam: must be in [0, 1], got {self.lam}")
        positive("algorithm.critic_learning_rate", self.critic_learning_rate)
        if self.value_clip is not None:
            positive("algorithm.value_clip", self.value_clip)
        self._check_trl_options()

    def _check_trl_options(self) -> None:
        """VESPO, the off-policy mask, the entropy bonus and GDPO's aggregation."""
        for side in ("pos", "neg"):
            positive(f"algorithm.vespo_k_{side}", getattr(self, f"vespo_k_{side}"), allow_zero=True)
            positive(f"algorithm.vespo_lambda_{side}", getattr(self, f"vespo_lambda_{side}"))
        if self.policy_loss == "vespo" and self.rollout_correction.startswith("sequence"):
            raise ConfigError(
                f"algorithm.rollout_correction={self.rollout_correction}: vespo folds the correction's weights "
                "into its own token by token (as TRL); set algorithm.rollout_correction to token_truncate, "
                "token_mask or none"
            )
        if self.off_policy_mask_threshold is not None:
            positive("algorithm.off_policy_mask_threshold", self.off_policy_mask_threshold)
        positive("algorithm.entropy_coef", self.entropy_coef, allow_zero=True)
        positive("algorithm.entropy_target", self.entropy_target, allow_zero=True)
        positive("algorithm.entropy_coef_delta", self.entropy_coef_delta, allow_zero=True)
        positive("algorithm.entropy_coef_min", self.entropy_coef_min, allow_zero=True)
        if self.entropy_coef_max < self.entropy_coef_min:
            raise ConfigError(
                f"algorithm.entropy_coef_max: must be >= entropy_coef_min = {self.entropy_coef_min}, "
                f"got {self.entropy_coef_max}; raise entropy_coef_max or lower entropy_coef_min"
            )
        one_of(
            "algorithm.multi_objective_aggregation",
            self.multi_objective_aggregation,
            registry.MULTI_OBJECTIVE_AGGREGATIONS,
        )
        if (
            self.multi_objective_aggregation == "normalize_then_sum"
            and self.advantage_estimator != "grpo"
        ):
            raise ConfigError(
                f"algorithm.multi_objective_aggregation=normalize_then_sum: is its own group-then-batch "
                f"normalisation, for advantage_estimator grpo, not {self.advantage_estimator}; set "
                "algorithm.advantage_estimator=grpo or multi_objective_aggregation=sum_then_normalize"
            )
