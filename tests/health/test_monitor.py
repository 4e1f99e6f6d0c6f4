"""The monitor: a check fires once, holds, clears after health.clear_after quiet steps, says
each transition in one line; health/* metrics; one cause reported alone; health.fail_on asks the
loop to stop and save; a broken check never stops training."""

from __future__ import annotations

import logging

from grpo.config import loading
from grpo.health.monitor import HealthMonitor, points_from_log_history, ranges
from grpo.registry import HEALTH_CHECKS
from grpo.training.callbacks import Control


def _monitor(*overrides):
    return HealthMonitor(loading.from_dict({}, list(overrides)))


def test_fires_once_holds_and_clears_after_quiet_steps_with_one_line_each(history, caplog):
    monitor = _monitor()
    rows = history(20, frac_reward_zero_std=lambda s: 1.0 if s <= 8 else 0.0)
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        for row in rows:
            monitor.observe(row)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("grpo health: [warning] no_learning_signal at step 5: ")
    assert "Fix: " in lines[0] and "\n" not in lines[0]
    assert lines[1] == "grpo health: no_learning_signal cleared at step 13 (fired at step 5)"
    (episode,) = monitor.episodes
    assert (episode.fired_at, episode.cleared_at, episode.held_ranges()) == (5, 13, "5–8")


def test_health_metrics_mark_the_firing_checks(history):
    monitor = _monitor()
    for row in history(5, frac_reward_zero_std=1.0, learning_rate=2e-6):
        metrics = monitor.observe(row)
    assert set(metrics) == {f"health/{n}" for n in HEALTH_CHECKS.names()} | {
        "health/update_to_weight"
    }
    assert metrics["health/no_learning_signal"] == 1.0
    assert sum(metrics[f"health/{n}"] for n in HEALTH_CHECKS.names()) == 1.0
    assert metrics["health/update_to_weight"] == 2e-6 / 0.02


def test_a_cause_is_reported_alone(history):
    monitor = _monitor("algorithm.mask_truncated_completions=true")
    rows = history(6, frac_reward_zero_std=1.0, **{"completions/clipped_ratio": 1.0})
    for row in rows:
        monitor.observe(row)
    assert [e.check for e in monitor.episodes] == ["all_truncated"]


def test_a_note_never_clears(history):
    monitor = _monitor()
    for row in history(30, loss=lambda s: 0.0 if s <= 12 else 0.3):
        monitor.observe(row)
    (note,) = monitor.episodes
    assert (note.check, note.severity, note.cleared_at) == ("zero_loss", "note", None)


def test_fail_on_asks_the_loop_to_save_and_stop_once(history, caplog):
    monitor = _monitor("health.fail_on=[no_learning_signal]")
    control = Control()
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        for row in history(5, frac_reward_zero_std=1.0):
            monitor.observe(row, control=control)
    assert control.should_save and control.should_training_stop
    assert (monitor.stopped.check, monitor.stopped.step) == ("no_learning_signal", 5)
    assert "health.fail_on names no_learning_signal" in caplog.records[-1].getMessage()
    other = _monitor("health.fail_on=[kl_runaway]", "algorithm.beta=0.04")
    control = Control()
    for row in history(5, frac_reward_zero_std=1.0):
        other.observe(row, control=control)
    assert not control.should_training_stop and other.stopped is None


def test_a_broken_check_is_skipped_and_said_once(history, caplog):
    @HEALTH_CHECKS.register("broken_for_the_test")
    def broken(view):
        raise KeyError("a bug")

    try:
        monitor = _monitor()
        with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
            for row in history(3):
                metrics = monitor.observe(row)
        assert metrics["health/broken_for_the_test"] == 0.0
        said = [r.getMessage() for r in caplog.records]
        assert said == [
            "grpo health: the check broken_for_the_test failed and is skipped: KeyError: 'a bug'"
        ]
    finally:
        HEALTH_CHECKS.unregister("broken_for_the_test")


def test_disabled_runs_nothing(history):
    monitor = _monitor("health.enabled=false")
    assert all(monitor.observe(row) == {} for row in history(6, frac_reward_zero_std=1.0))
    assert monitor.episodes == []


def test_a_process_that_does_not_speak_still_decides(history, caplog):
    monitor = HealthMonitor(loading.from_dict({}), is_main=False)
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        for row in history(5, frac_reward_zero_std=1.0):
            monitor.observe(row)
    assert caplog.records == [] and monitor.firing


def test_held_out_scores_from_the_callbacks_log_history():
    log_history = [
        {"eval_greedy/accuracy": 0.25, "eval_temperature 1/accuracy": 0.5, "step": 0},
        {"reward": 0.1, "step": 2},
        {"eval_greedy/accuracy": 0.5, "eval_greedy/mean_reward": 0.5, "step": 20},
    ]
    points = points_from_log_history(log_history, num_iterations=2)
    assert [(p.step, p.score, p.decoding) for p in points] == [
        (0, 0.25, "greedy"),
        (10, 0.5, "greedy"),
    ]
    only_sampled = [
        {
            "eval_temperature 1/accuracy": 0.5,
            "eval_temperature 1, wording 2/accuracy": 0.1,
            "step": 4,
        }
    ]
    assert [p.decoding for p in points_from_log_history(only_sampled)] == ["temperature 1"]


def test_ranges():
    assert ranges([3, 4, 5, 9, 11, 12]) == "3–5, 9, 11–12"
    assert ranges([]) == ""


def test_the_log_history_is_read_as_it_grows(history):
    monitor = _monitor()
    log_history: list[dict] = []
    rows = history(3)
    log_history.append({"eval_greedy/accuracy": 0.25, "step": 0})
    monitor.observe(rows[0], log_history)
    log_history += [{"reward": 0.5, "step": 1}, {"eval_greedy/accuracy": 0.5, "step": 1}]
    monitor.observe(rows[1], log_history)
    assert [(p.step, p.score) for p in monitor.evaluations] == [(0, 0.25), (1, 0.5)]
    monitor.observe(
        rows[2], [{"eval_greedy/accuracy": 1.0, "step": 2}]
    )  # another list: read afresh
    assert [(p.step, p.score) for p in monitor.evaluations] == [(2, 1.0)]


def test_under_torchrun_the_held_out_check_never_stops_the_run(history):
    from grpo.health.checks import EvalPoint

    cfg = loading.from_dict(
        {}, ["health.fail_on=[heldout_not_improving]", "eval.every=20", "eval.before=true"]
    )
    flat = [EvalPoint(0, 0.25), EvalPoint(20, 0.25)]
    for world_size, stops in ((1, True), (2, False)):
        # rank 0 holds the evaluations, the others none: only a decision no evaluation takes is alike
        monitor, control = HealthMonitor(cfg, world_size=world_size), Control()
        for row in history(22, reward=lambda s: 0.1 + 0.02 * s):
            monitor.step(row, flat if row["step"] > 20 else [])
        monitor.observe(history(23, reward=0.6)[-1], control=control)
        assert "heldout_not_improving" in monitor.firing
        assert (monitor.stopped is not None) == stops, world_size
