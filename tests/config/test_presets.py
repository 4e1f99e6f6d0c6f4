"""algorithm.preset: each paper's combination, overridden by keys set beside it, refused by name when unknown."""

import pytest
import yaml

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.config.presets import describe_preset

EXPECTED = {
    "grpo": {
        "algorithm.advantage_estimator": "grpo",
        "algorithm.scale_rewards": "group",
        "algorithm.loss_type": "grpo",
        "algorithm.epsilon": 0.2,
        "algorithm.epsilon_high": 0.2,
        "algorithm.beta": 0.04,
        "algorithm.importance_sampling_level": "token",
        "algorithm.dynamic_sampling": False,
        "rewards.overlong_buffer": None,
    },
    "dr_grpo": {
        "algorithm.advantage_estimator": "dr_grpo",
        "algorithm.scale_rewards": "none",
        "algorithm.loss_type": "dr_grpo",
        "algorithm.beta": 0.0,
        "algorithm.epsilon": 0.2,
        "algorithm.dynamic_sampling": False,
    },
    "dapo": {
        "algorithm.loss_type": "dapo",
        "algorithm.epsilon": 0.2,
        "algorithm.epsilon_high": 0.28,
        "algorithm.beta": 0.0,
        "algorithm.dynamic_sampling": True,
        "algorithm.scale_rewards": "group",
        # the soft overlong penalty over the last fifth of max_completion_length (default 512)
        "rewards.overlong_buffer": 102,
    },
    "gspo": {
        "algorithm.importance_sampling_level": "sequence",
        "algorithm.epsilon": 3e-4,
        "algorithm.epsilon_high": 4e-4,
        "algorithm.beta": 0.0,
        "algorithm.loss_type": "grpo",
    },
}


def value(cfg, dotted):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_resolves_to_the_papers_values(name):
    cfg = config.from_dict({"algorithm": {"preset": name}})
    for dotted, expected in EXPECTED[name].items():
        assert value(cfg, dotted) == expected, dotted
    assert cfg.epsilon_high == EXPECTED[name].get("algorithm.epsilon_high", cfg.algorithm.epsilon)


def test_without_a_preset_the_defaults_are_trls():
    cfg = config.from_dict({})
    a = cfg.algorithm
    assert (a.preset, a.beta, a.loss_type, a.epsilon_high, a.dynamic_sampling) == (
        None,
        0.0,
        "dapo",
        None,
        False,
    )


def test_explicit_keys_override_the_preset_in_the_file_and_as_overrides():
    cfg = config.from_dict(
        {
            "algorithm": {"preset": "dapo", "epsilon_high": 0.3},
            "rollout": {"max_completion_length": 40},
        },
        ["algorithm.dynamic_sampling=false"],
    )
    a = cfg.algorithm
    assert a.epsilon_high == 0.3 and a.dynamic_sampling is False
    assert a.loss_type == "dapo" and a.beta == 0.0  # the preset's other keys still apply
    assert cfg.rewards.overlong_buffer == 8  # a fifth of this config's max_completion_length
    line = describe_preset(cfg)
    assert "algorithm.epsilon_high=0.3 (overridden)" in line
    assert "algorithm.dynamic_sampling=False (overridden)" in line
    assert "algorithm.loss_type=dapo," in line and "loss_type=dapo (overridden)" not in line


def test_preset_as_an_override_of_a_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  beta: 0.1\n")
    cfg = config.load(path, ["algorithm.preset=grpo"])
    assert cfg.algorithm.beta == 0.1 and cfg.algorithm.loss_type == "grpo"


def test_unknown_preset_is_refused_by_name():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.preset: 'dapoo' is not one of grpo, dr_grpo, dapo, gspo \(did you mean 'dapo'\?\)",
    ):
        config.from_dict({"algorithm": {"preset": "dapoo"}})


def test_the_saved_config_reloads_to_the_same_values(tmp_path):
    """The run directory's config.yaml holds the resolved values, so a resumed or re-read run is the same."""
    cfg = config.from_dict({"algorithm": {"preset": "gspo", "beta": 0.02}})
    config.save(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (
        saved["algorithm"]["importance_sampling_level"] == "sequence"
        and saved["algorithm"]["beta"] == 0.02
    )
    assert config.load(tmp_path / "config.yaml").to_dict() == cfg.to_dict()


def test_describe_preset_is_none_without_one():
    assert describe_preset(config.from_dict({})) is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["algorithm.advantage_estimator=ppo"],
            r"algorithm.advantage_estimator: 'ppo' is not one of grpo, .*gae",
        ),
        (["algorithm.policy_loss=sapoo"], r"algorithm.policy_loss: 'sapoo' is not one of .*sapo"),
        (
            ["algorithm.top_entropy_quantile=0"],
            r"algorithm.top_entropy_quantile: must be in \(0, 1\]",
        ),
        (
            ["algorithm.entropy_mask_scope=token"],
            r"algorithm.entropy_mask_scope: 'token' is not one of completion, batch",
        ),
        (
            ["algorithm.rollout_correction=token"],
            r"algorithm.rollout_correction: 'token' is not one of none, token_truncate",
        ),
        (["algorithm.rollout_correction_cap=1"], r"algorithm.rollout_correction_cap: must be > 1"),
        (["algorithm.lam=1.5"], r"algorithm.lam: must be in \[0, 1\]"),
        (["algorithm.gamma=-0.1"], r"algorithm.gamma: must be in \[0, 1\]"),
        (["algorithm.critic_learning_rate=0"], r"algorithm.critic_learning_rate: must be > 0"),
        (["algorithm.value_clip=-1"], r"algorithm.value_clip: must be > 0"),
        (["algorithm.sapo_temperature_neg=0"], r"algorithm.sapo_temperature_neg: must be > 0"),
    ],
)
def test_bad_algorithm_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.from_dict({}, overrides)
