"""The `health:` section: the thresholds of the health checks (grpo.health) and `fail_on`.

Each check reads the step's metrics and a short history of them (docs/health.md lists every
check, what it reads and what it says). The defaults are set so that the project's own healthy
runs (examples/*.yaml, the demo) fire nothing; the page records the margins measured.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from grpo import registry
from grpo.config.errors import ConfigError

MAX_STEPS_WINDOW = 10_000
"""The most steps a window, a patience or a clearing delay may span (the history is kept in memory)."""
NOTES = ("zero_loss",)
"""The checks whose finding is a note (grpo.health.checks): it explains how the run is built and is
never a fault, so it never stops a run, and health.fail_on refuses it."""
WEIGHT_SCALE_RANGE = (1e-6, 100.0)
"""health.weight_scale's range: a typical weight's magnitude (initializer ranges are 0.002 to 0.1,
a norm's weights 1); the learning rate is divided by it (health/update_to_weight), so a value
far smaller turns any learning rate into an overflow."""
MIN_RELATIVE_UPDATE = 0.01
"""health.max_relative_update's least value: a step of a hundredth of a weight's size is already
twenty times fine-tuning's (1e-5 over 0.02); below it lr_too_large would fire on ordinary runs."""


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
    status 5), for unattended runs; e.g. [no_learning_signal, nonfinite_updates]. A check that
    can never stop this run is refused: a note (zero_loss), or one the run's settings keep from
    firing (kl_runaway without beta, all_truncated without mask_truncated_completions,
    heldout_not_improving without two evaluations during training `window` steps apart)."""
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
    above which the update is pinned at the trust region (below 1)."""
    rollout_wait_share: float = 0.5
    """rollout_wait (rollout.max_staleness > 0): the share of a step's time the trainer waits for the
    generation server (time/wait_for_rollout over time/step) above which generating ahead is not
    overlapping with training."""
    capped_share_max: float = 0.2
    """stale_ratio_drift (rollout.max_staleness > 0): the share of tokens whose importance weight
    against the sampler the correction's cap cut (rollout/is_capped_ratio) above which the policy
    has drifted too far from the weights that sampled the batch."""
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
    """The learning-rate checks: a typical weight's magnitude (transformers' initializer_range;
    in [1e-6, 100]); AdamW moves each weight by about the learning rate per step."""
    max_relative_update: float = 5.0
    """lr_too_large: a learning rate above this multiple of weight_scale (each step would move
    a typical weight by five times its size; at least 0.01)."""

    def check(self, cfg=None, world_size: int = 1) -> None:
        """Each key's range, and `fail_on` against the registered checks and (with the run's `cfg`)
        against what can fire in this run."""
        for i, name in enumerate(self.fail_on):
            if name not in registry.HEALTH_CHECKS:
                try:
                    registry.HEALTH_CHECKS.check(name)
                except ConfigError as error:
                    raise ConfigError(f"health.fail_on[{i}]: {_after_key(error)}") from None
            problem = _cannot_stop(name, self, cfg, world_size)
            if problem:
                raise ConfigError(f"health.fail_on[{i}]: {name} {problem}")
        for key in ("window", "patience", "clear_after"):
            value = getattr(self, key)
            if not 1 <= value <= MAX_STEPS_WINDOW:
                raise ConfigError(
                    f"health.{key}: must be in [1, {MAX_STEPS_WINDOW}] steps, got {value}"
                )
        for key in dataclasses.fields(self):  # a subnormal threshold is no number to compare with
            value = getattr(self, key.name)
            if isinstance(value, float) and 0 < abs(value) < sys.float_info.min:
                raise ConfigError(
                    f"health.{key.name}: {value} is subnormal (closer to 0 than {sys.float_info.min:.3g}), "
                    "where dividing by it overflows and multiplying by it vanishes; set a normal number"
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
        for key in ("rollout_wait_share", "capped_share_max"):
            value = getattr(self, key)
            if not 0.0 < value < 1.0:  # a share that must be exceeded: 1 never is
                raise ConfigError(f"health.{key}: a share, must be in (0, 1), got {value}")
        if not 0.0 < self.clip_ratio_max < 1.0:  # a share that must be exceeded: 1 never is
            raise ConfigError(
                f"health.clip_ratio_max: a share of the tokens that clip_ratio_high fires above, must be "
                f"in (0, 1), got {self.clip_ratio_max}"
            )
        for key in ("entropy_blowup_ratio", "grad_norm_spike_ratio", "length_growth"):
            value = getattr(self, key)
            if not value > 1.0:
                raise ConfigError(f"health.{key}: a multiple, must be > 1, got {value}")
        for key in ("zero_loss_tolerance", "entropy_floor", "kl_max", "reward_rise"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"health.{key}: must be > 0, got {value}")
        low, high = WEIGHT_SCALE_RANGE
        if not low <= self.weight_scale <= high:
            raise ConfigError(
                f"health.weight_scale: a typical weight's magnitude (transformers' initializer_range, "
                f"0.02 in most models), must be in [{low:g}, {high:g}], got {self.weight_scale}"
            )
        if not self.max_relative_update >= MIN_RELATIVE_UPDATE:
            raise ConfigError(
                f"health.max_relative_update: the multiple of health.weight_scale a learning rate must "
                f"exceed to be too large, must be at least {MIN_RELATIVE_UPDATE:g} (fine-tuning's "
                f"rates are about 5e-4 of a weight), got {self.max_relative_update}"
            )


def _cannot_stop(name: str, health: HealthConfig, cfg, world_size: int) -> str | None:
    """Why the registered check `name` can never stop this run (health.fail_on), and the fix; or
    None."""
    drop = "remove it from health.fail_on"
    if name in NOTES:
        return (
            "is a note (it explains how the run is built, e.g. a loss of 0 by construction), never a "
            f"fault: notes never stop a run; {drop}"
        )
    if not health.enabled:
        return f"cannot fire: the health checks are off (health.enabled: false); turn them on, or {drop}"
    if cfg is None:
        return None
    a = cfg.algorithm
    if name == "all_truncated" and not a.mask_truncated_completions:
        return (
            "fires only with algorithm.mask_truncated_completions: true (cut completions left out of "
            f"the loss), which this run does not set; set it, or {drop}"
        )
    if name == "kl_runaway" and not a.beta > 0:
        return (
            "reads kl, which a run logs only with algorithm.beta > 0 (a KL reference), and beta is "
            f"{a.beta}; set algorithm.beta, or {drop}"
        )
    if name in ("rollout_wait", "stale_ratio_drift") and not cfg.rollout.max_staleness:
        return (
            "reads what generating ahead of training logs, which this run does not do "
            f"(rollout.max_staleness 0); set rollout.max_staleness, or {drop}"
        )
    if name == "heldout_not_improving":
        problem = _heldout_cannot_stop(health, cfg, world_size)
        return f"{problem}, or {drop}" if problem else None
    return None


def evaluation_steps(cfg) -> tuple[int, int, int] | None:
    """(first, last, count) of the steps after which a run evaluates during training (0: eval.before;
    then every eval.every steps short of training.max_steps, when the `after` one runs instead);
    None when it never does."""
    e, max_steps = cfg.eval, cfg.training.max_steps
    every = e.every if e.every and e.every < max_steps else 0
    if not e.before and not every:
        return None
    first = 0 if e.before else every
    last = (max_steps - 1) // every * every if every else 0
    count = int(e.before) + ((max_steps - 1) // every if every else 0)
    return first, last, count


def _heldout_cannot_stop(health: HealthConfig, cfg, world_size: int) -> str | None:
    """heldout_not_improving stops a run of one process that evaluates during training at two
    steps at least health.window apart (an evaluation after step s is read at step s + 1; the
    `after` one comes when no step is left to stop)."""
    if world_size > 1:
        return (
            f"reads the held-out evaluations, which only rank 0 holds, so it never stops a run of "
            f"{world_size} processes (they must stop at the same step)"
        )
    steps = evaluation_steps(cfg)
    if steps is not None and steps[2] >= 2 and steps[1] - steps[0] >= health.window:
        return None
    when = (
        "at no step"
        if steps is None
        else f"after step {steps[0]} only"
        if steps[2] == 1
        else f"after steps {steps[0]} to {steps[1]}, {steps[1] - steps[0]} apart"
    )
    e = cfg.eval
    return (
        f"needs two held-out evaluations during training at least health.window={health.window} steps "
        f"apart, and this run evaluates {when} (eval.every={e.every}, eval.before={str(e.before).lower()}, "
        f"training.max_steps={cfg.training.max_steps}); evaluate more often (eval.every, eval.before: true)"
    )


def _after_key(error: ConfigError) -> str:
    """The registry's message without its own key (`health.fail_on: ...`)."""
    text = str(error)
    prefix = f"{registry.HEALTH_CHECKS.key}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
