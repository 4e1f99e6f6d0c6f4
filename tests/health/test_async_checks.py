"""The checks of generation ahead of training (rollout.max_staleness > 0) on synthetic histories:
rollout_wait (the trainer waits for the generator most of each step) and stale_ratio_drift (the
importance ratios against the sampler cut or clipped for several steps); silent on the healthy
history beside each, and on a synchronous run's rows, which log none of what they read."""

from __future__ import annotations

from grpo.config.health import HealthConfig
from grpo.health import checks


def test_rollout_wait_fires_when_the_trainer_waits_most_of_each_step(history, view_of):
    rows = history(
        6, **{"time/step": 1.0, "time/wait_for_rollout": lambda s: 0.9 if s > 1 else 0.0}
    )
    assert checks.rollout_wait(view_of(rows[:5])) is None  # steps 2-5: 4 < patience 5
    found = checks.rollout_wait(view_of(rows))
    assert found.severity == "warning" and "does not overlap" in found.message
    assert "time/wait_for_rollout 0.9 s of time/step 1 s (> 50%)" in found.evidence
    assert "steps 2–6" in found.evidence and "grpo serve --engine vllm" in found.fix
    # half of each step is not more than half; a lower share set fires
    half = history(6, **{"time/step": 1.0, "time/wait_for_rollout": 0.5})
    assert checks.rollout_wait(view_of(half)) is None
    assert checks.rollout_wait(view_of(half, limits=HealthConfig(rollout_wait_share=0.4)))


def test_rollout_wait_is_silent_when_the_generator_is_hidden_or_absent(history, view_of):
    hidden = history(10, **{"time/step": 1.0, "time/wait_for_rollout": 0.01})
    assert checks.rollout_wait(view_of(hidden)) is None
    assert checks.rollout_wait(view_of(history(10, **{"time/step": 1.0}))) is None


def test_stale_ratio_drift_fires_on_capped_weights_or_clipping_of_stale_batches(history, view_of):
    capped = history(
        5,
        **{"async/staleness_max": 2.0, "rollout/is_capped_ratio": lambda s: 0.3 if s > 1 else 0.0},
    )
    assert checks.stale_ratio_drift(view_of(capped)) is None  # 4 steps in a row
    capped = history(6, **{"async/staleness_max": 2.0, "rollout/is_capped_ratio": 0.3})
    found = checks.stale_ratio_drift(view_of(capped))
    assert "rollout/is_capped_ratio 0.3 (> 0.2)" in found.evidence
    assert "rollout.max_staleness" in found.fix and found.explains == ("clip_ratio_high",)
    clipped = history(6, **{"async/staleness_max": 1.0, "clip_ratio/region_mean": 0.5})
    assert checks.stale_ratio_drift(view_of(clipped)) is not None
    # the same numbers in a synchronous run are clip_ratio_high's, not this check's
    sync = history(6, **{"clip_ratio/region_mean": 0.5, "rollout/is_capped_ratio": 0.3})
    assert checks.stale_ratio_drift(view_of(sync)) is None
    assert checks.clip_ratio_high(view_of(sync)) is not None
    fresh = history(6, **{"async/staleness_max": 0.0, "rollout/is_capped_ratio": 0.3})
    assert checks.stale_ratio_drift(view_of(fresh)) is None


def test_the_async_checks_cannot_stop_a_synchronous_run():
    import pytest

    from grpo.config import loading
    from grpo.config.errors import ConfigError

    for name in ("rollout_wait", "stale_ratio_drift"):
        with pytest.raises(
            ConfigError, match=rf"health.fail_on\[0\]: {name} reads what generating ahead"
        ):
            loading.from_dict({}, [f"health.fail_on=[{name}]"])
        loading.from_dict(
            {},
            [f"health.fail_on=[{name}]", "rollout.engine=server", "rollout.max_staleness=1"],
        )
    with pytest.raises(
        ConfigError, match=r"health.rollout_wait_share: a share, must be in \(0, 1\)"
    ):
        loading.from_dict({}, ["health.rollout_wait_share=1.0"])
