"""The `health:` section: the thresholds of the health checks (grpo.health) and `fail_on`.

Each check reads the step's metrics and a short history of them (docs/health.md lists every
check, what it reads and what it says). The defaults are set so that the project's own healthy
runs (examples/*.yaml, the demo) fire nothing; the page records the margins measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpo import registry
from grpo.config.errors import ConfigError

MAX_STEPS_WINDOW = 10_000
"""The most steps a window, a patience or a clearing delay may span (the history is kept in memory)."""


@dataclass
class HealthConfig:
    """Health checks on every step: each a registered function of the step's metrics and a short
    history (no extra forward pass); a check that fires prints one line, sets `health/<check>`
    to 1 in the step's metrics and is listed in report.md and by `grpo doctor RUN_DIR`."""

    enabled: bool = True
    """Run the checks on every step (false: no health/* metrics and no console lines;
    `grpo doctor` still diagnoses the run from its metrics.jsonl)."""
    fail_on: list[str] = field(default_factory=list)
    """Checks that stop the run when they fire, with a checkpoint of that step (as a
    callback's should_training_stop does: final/ is written and `grpo train` exits with
    status 5), for unattended runs; e.g. [no_learning_signal, nonfinite_updates]."""
    window: int = 10
    """Steps a trend is judged over: the run's first `window` steps against its last
    `window` (the reward-hacking checks, the entropy baseline, the gradient-norm median)."""
    patience: int = 5
    """Steps in a row a condition must hold before its check fires (one noisy step fires nothing)."""
    clear_after: int = 5
    """Steps in a row without the condition before a fired check clears (and says so)."""
    zero_spread_share: float = 1.0
    """no_learning_signal: the share of groups with zero reward spread (frac_reward_zero_std)
    at or above which a step carries no learning signal; 1.0: every group."""
    zero_loss_tolerance: float = 1e-6
    """zero_loss: a logged loss within this of 0 counts as zero."""
    reward_missing_share: float = 0.5
    """reward_failing: the share of a batch's completions a reward function gives no reward
    (rewards/<f>/missing: it returned None, or its call failed) above which it is failing."""
    truncated_share: float = 1.0
    """all_truncated (with algorithm.mask_truncated_completions): the share of completions cut at
    max_completion_length (completions/clipped_ratio) at or above which nothing is trained."""
    entropy_floor: float = 0.1
    """entropy_collapse: mean token entropy (nats) below which the policy is near-deterministic."""
    collapse_zero_spread_share: float = 0.9
    """entropy_collapse: fires only while at least this share of groups has zero reward spread
    (a low entropy whose groups still vary is a policy that learned, not one that collapsed)."""
    entropy_blowup_ratio: float = 3.0
    """entropy_blowup: entropy above this multiple of the run's early median."""
    kl_max: float = 1.0
    """kl_runaway: KL to the reference (nats per token) above which the policy has run away."""
    clip_ratio_max: float = 0.3
    """clip_ratio_high: the share of tokens whose ratio is clipped (clip_ratio/region_mean)
    above which the update is pinned at the trust region."""
    grad_norm_spike_ratio: float = 50.0
    """grad_norm_spike: a gradient norm this many times the median of the `window` steps before."""
    reward_rise: float = 0.1
    """The reward-hacking checks: a rise (or fall) of a mean reward between the run's first and
    last `window` steps that counts, in the reward's own units."""
    heldout_min_gain: float = 0.0
    """heldout_not_improving: the held-out score must gain more than this while the training
    reward rises by reward_rise."""
    length_cap_share: float = 0.9
    """length_hacking: mean completion length at or above this share of max_completion_length."""
    length_growth: float = 1.5
    """length_hacking: and at least this multiple of the run's early mean length."""
    weight_scale: float = 0.02
    """The learning-rate checks: a typical weight's magnitude (transformers' initializer_range);
    AdamW moves each weight by about the learning rate per step."""
    max_relative_update: float = 5.0
    """lr_too_large: a learning rate above this multiple of weight_scale (each step would move
    a typical weight by five times its size)."""

    def check(self, cfg=None, world_size: int = 1) -> None:
        for i, name in enumerate(self.fail_on):
            if name not in registry.HEALTH_CHECKS:
                try:
                    registry.HEALTH_CHECKS.check(name)
                except ConfigError as error:
                    raise ConfigError(f"health.fail_on[{i}]: {_after_key(error)}") from None
        for key in ("window", "patience", "clear_after"):
            value = getattr(self, key)
            if not 1 <= value <= MAX_STEPS_WINDOW:
                raise ConfigError(
                    f"health.{key}: must be in [1, {MAX_STEPS_WINDOW}] steps, got {value}"
                )
        for key in (
            "zero_spread_share",
            "reward_missing_share",
            "truncated_share",
            "collapse_zero_spread_share",
            "length_cap_share",
        ):
            value = getattr(self, key)
            if not 0.0 < value <= 1.0:
                raise ConfigError(
                    f"health.{key}: a share of the batch, must be in (0, 1], got {value}"
                )
        for key in ("entropy_blowup_ratio", "grad_norm_spike_ratio", "length_growth"):
            value = getattr(self, key)
            if not value > 1.0:
                raise ConfigError(f"health.{key}: a multiple, must be > 1, got {value}")
        for key in (
            "zero_loss_tolerance",
            "entropy_floor",
            "kl_max",
            "clip_ratio_max",
            "reward_rise",
            "weight_scale",
            "max_relative_update",
        ):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"health.{key}: must be > 0, got {value}")


def _after_key(error: ConfigError) -> str:
    """The registry's message without its own key (`health.fail_on: ...`)."""
    text = str(error)
    prefix = f"{registry.HEALTH_CHECKS.key}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
