"""`algorithm.preset`: the settings each paper used (`PRESETS`), filled into a config as read for
the keys it does not set (`apply_preset`), the reward a task implies (`apply_task_rewards`), and
the line a run starts with (`describe_preset`)."""

from __future__ import annotations

from typing import Any

from grpo.config.checks import WholeConfig
from grpo.config.rollout_rewards import TASK_REWARDS, RolloutConfig


def _fifth_of_completion_length(data: dict[str, Any]) -> int | None:
    """DAPO's overlong buffer, 4k of its 20k tokens: a fifth of this config's max_completion_length
    (None when that is not an integer: the rollout section's check names it)."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    length = rollout.get("max_completion_length", RolloutConfig.max_completion_length)
    return max(1, length // 5) if isinstance(length, int) and not isinstance(length, bool) else None


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # GRPO as DeepSeekMath ran it: group-normalised advantages, a per-sequence mean, a KL penalty
    "grpo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "beta": 0.04,
            "importance_sampling_level": "token",
        }
    },
    # Dr. GRPO (Liu et al. 2025): no std scaling, a fixed-length normaliser, no KL
    "dr_grpo": {
        "algorithm": {
            "advantage_estimator": "dr_grpo",
            "scale_rewards": "none",
            "loss_type": "dr_grpo",
            "epsilon": 0.2,
            "epsilon_high": 0.2,
            "beta": 0.0,
            "importance_sampling_level": "token",
        }
    },
    # DAPO (Yu et al. 2025): clip-higher, token-level mean, dynamic sampling, no KL, the soft
    # overlong penalty over the last fifth of the completion length (their 4k of 20k)
    "dapo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "dapo",
            "epsilon": 0.2,
            "epsilon_high": 0.28,
            "beta": 0.0,
            "dynamic_sampling": True,
            "importance_sampling_level": "token",
        },
        "rewards": {"overlong_buffer": _fifth_of_completion_length},
    },
    # GSPO (Zheng et al. 2025): the sequence-level ratio, with its much narrower clipping range
    "gspo": {
        "algorithm": {
            "advantage_estimator": "grpo",
            "scale_rewards": "group",
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-4,
            "epsilon_high": 4e-4,
            "beta": 0.0,
        }
    },
}
"""algorithm.preset -> the settings each paper used, per section; a value may be a function of the
config as read (dapo's overlong buffer follows max_completion_length). A key the user sets (in the
file or as an override) wins over its preset's value (`apply_preset`)."""


def _preset_name(data: dict[str, Any]) -> Any:
    algorithm = data.get("algorithm")
    return algorithm.get("preset") if isinstance(algorithm, dict) else None


def _preset_value(value: Any, data: dict[str, Any]) -> Any:
    return value(data) if callable(value) else value


def apply_preset(data: dict[str, Any]) -> None:
    """Fill in `algorithm.preset`'s settings for the keys `data` (a config as read, overrides
    applied) does not set itself: what the user wrote always wins. An unknown preset is left
    for the algorithm section's check to refuse by name."""
    name = _preset_name(data)
    if name not in PRESETS:
        return
    for section, values in PRESETS[name].items():
        node = data.setdefault(section, {})
        if not isinstance(node, dict):
            continue  # _build names the section that is not a mapping
        for key, value in values.items():
            if key not in node:
                node[key] = _preset_value(value, data)


def apply_task_rewards(data: dict[str, Any]) -> None:
    """rewards.funcs, when the config leaves it unset, for a task whose reward is not the default
    (TASK_REWARDS): set in the config itself, so the run's saved config names the reward used."""
    data_section, rewards = data.get("data"), data.get("rewards")
    task = data_section.get("task") if isinstance(data_section, dict) else None
    if task in TASK_REWARDS and (
        rewards is None or (isinstance(rewards, dict) and "funcs" not in rewards)
    ):
        data["rewards"] = {**(rewards or {}), "funcs": list(TASK_REWARDS[task])}


def describe_preset(cfg: WholeConfig) -> str | None:
    """One line for the start of a run: the preset and the values its keys resolved to,
    those set apart from the preset marked as overridden."""
    name = cfg.algorithm.preset
    if name is None:
        return None
    data = cfg.to_dict()
    parts = []
    for section, values in PRESETS[name].items():
        for key, value in values.items():
            resolved = data[section][key]
            mark = "" if resolved == _preset_value(value, data) else " (overridden)"
            parts.append(f"{section}.{key}={resolved}{mark}")
    return f"algorithm.preset {name}: " + ", ".join(parts)
