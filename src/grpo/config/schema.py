"""Typed run configuration: `Config`, the root of the sections, and `validate`.

Option names and defaults follow TRL's GRPOConfig where the meaning is the
same, so a TRL user can carry settings over. Every mistake a user can make in
a config is reported at start-up, naming the key and the fix: each section
checks its own fields (`check`, beside its fields in grpo.config.model_data,
.rollout_rewards, .algorithm and .training), `validate` runs them in order and
is the one place a config error comes from. Choices between implementations
are registry names (grpo.registry), so the known names are listed from there.
A config is read and written by grpo.config.loading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from grpo.config.algorithm import AlgorithmConfig
from grpo.config.checks import all_finite
from grpo.config.errors import ConfigError
from grpo.config.health import HealthConfig
from grpo.config.model_data import DataConfig, ModelConfig
from grpo.config.rollout_rewards import RewardsConfig, RolloutConfig
from grpo.config.training import CPUConfig, EvalConfig, LoggingConfig, TrainingConfig


@dataclass
class Config:
    output_dir: str = "runs/grpo"
    """Run directory: resolved config, metrics.jsonl, checkpoints, report."""
    overwrite_output_dir: bool = False
    """Allow training into a directory that already holds a run (its logs are replaced)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    @property
    def epsilon_high(self) -> float:
        a = self.algorithm
        return a.epsilon if a.epsilon_high is None else a.epsilon_high

    def generation_batch_size(self, world_size: int = 1) -> int:
        t = self.training
        return t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Impossible combinations fail here, before any model is loaded: each section
    checks itself, in the order of the file, with the whole config at hand for the
    fields that depend on another section."""
    all_finite(cfg)
    for key, seed in (
        ("data.seed", cfg.data.seed),
        ("training.seed", cfg.training.seed),
        ("eval.seed", cfg.eval.seed),
    ):
        if not 0 <= seed < 2**32:
            raise ConfigError(
                f"{key}: must be in [0, 2**32) as in TRL, whose seeds go to NumPy; got {seed}"
            )
    for section in (
        cfg.model,
        cfg.data,
        cfg.rollout,
        cfg.rewards,
        cfg.algorithm,
        cfg.training,
        cfg.eval,
        cfg.logging,
        cfg.cpu,
        cfg.health,
    ):
        section.check(cfg, world_size)
