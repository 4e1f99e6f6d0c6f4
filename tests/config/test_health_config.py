"""health.* checked for meaning at load: a health.fail_on entry that can never stop the run (a
note, a check whose metric this run does not log or whose evaluations it does not schedule, the
checks turned off) and a threshold outside the range where it means something are refused, each
with one line naming the key and the fix; what can work is accepted."""

from __future__ import annotations

import pytest

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.config.schema import validate


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as error:
        loading.from_dict({}, list(overrides))
    message = str(error.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            ["health.fail_on=[no_learning_signal,zero_loss]"],
            "health.fail_on[1]: zero_loss is a note (it explains how the run is built",
        ),
        (
            ["health.fail_on=[heldout_not_improving]"],
            "health.fail_on[0]: heldout_not_improving needs two held-out evaluations during training "
            "at least health.window=10 steps apart, and this run evaluates at no step",
        ),
        (  # one evaluation during training, then only the `after` one: nothing left to stop
            ["health.fail_on=[heldout_not_improving]", "eval.every=60", "eval.after=true"],
            "this run evaluates after step 60 only (eval.every=60, eval.before=false, "
            "training.max_steps=100)",
        ),
        (
            [
                "health.fail_on=[heldout_not_improving]",
                "eval.every=4",
                "eval.before=true",
                "training.max_steps=9",
            ],
            "this run evaluates after steps 0 to 8, 8 apart",
        ),
        (
            ["health.fail_on=[all_truncated]"],
            "health.fail_on[0]: all_truncated fires only with algorithm.mask_truncated_completions",
        ),
        (
            ["health.fail_on=[kl_runaway]"],
            "health.fail_on[0]: kl_runaway reads kl, which a run logs only with algorithm.beta > 0",
        ),
        (
            ["health.enabled=false", "health.fail_on=[no_learning_signal]"],
            "health.fail_on[0]: no_learning_signal cannot fire: the health checks are off",
        ),
    ],
)
def test_a_fail_on_check_that_can_never_stop_the_run_is_refused(overrides, said):
    message = _refused(*overrides)
    assert message.startswith("health.fail_on[") and said in message, message
    assert message.endswith("remove it from health.fail_on"), message


def test_the_held_out_check_is_refused_under_torchrun():
    cfg = loading.from_dict(
        {}, ["health.fail_on=[heldout_not_improving]", "eval.every=20", "eval.before=true"]
    )  # one process: accepted
    with pytest.raises(ConfigError, match="never stops a run of 2 processes"):
        validate(cfg, world_size=2)  # as the distributed backend checks it


def test_fail_on_checks_that_can_fire_are_accepted():
    cfg = loading.from_dict(
        {},
        [
            "health.fail_on=[heldout_not_improving,kl_runaway,all_truncated,no_learning_signal]",
            "eval.every=5",
            "eval.before=true",
            "training.max_steps=20",
            "algorithm.beta=0.04",
            "algorithm.mask_truncated_completions=true",
        ],
    )
    assert len(cfg.health.fail_on) == 4


@pytest.mark.parametrize(
    "override, said",
    [
        ("health.weight_scale=5e-324", "health.weight_scale: 5e-324 is subnormal"),
        ("health.weight_scale=1e-9", "health.weight_scale: a typical weight's magnitude"),
        ("health.weight_scale=1000.0", "must be in [1e-06, 100], got 1000.0"),
        ("health.kl_max=1e-310", "health.kl_max: 1e-310 is subnormal"),
        ("health.zero_spread_share=1e-320", "health.zero_spread_share: 1e-320 is subnormal"),
        ("health.clip_ratio_max=1.0", "health.clip_ratio_max: a share of the tokens"),
        ("health.max_relative_update=0.001", "health.max_relative_update: the multiple of"),
        ("health.reward_rise=0", "health.reward_rise: must be > 0, got 0"),
    ],
)
def test_a_threshold_outside_its_meaningful_range_is_refused(override, said):
    assert said in _refused(override)
