"""The monitor's history saved with a checkpoint (HealthMonitor.state_dict, in the train state):
a monitor restored from it finds what the uninterrupted one finds, at the same steps, and
health.fail_on stops it at the same step; the state loads with weights_only=True; a run
stopped by fail_on stays stopped when resumed, unless the check is dropped from fail_on; a
train state without it (a checkpoint from before) starts the checks afresh."""

from __future__ import annotations

import io
import logging

import torch

from grpo.config import loading
from grpo.health.monitor import HealthMonitor

OVERRIDES = [
    "health.fail_on=[no_learning_signal]",
    "eval.every=2",
    "eval.before=true",
    "training.max_steps=40",
]


def _rows(history):
    # no learning signal at steps 3-9 (fires at 7 after 5 in a row, clears at 14), a training
    # reward that rises while the held-out score stays flat (heldout_not_improving, from step 11)
    return history(
        24,
        frac_reward_zero_std=lambda s: 1.0 if 3 <= s <= 9 else 0.0,
        reward=lambda s: 0.1 + 0.02 * s,
    )


def _eval_row(step):
    return {"eval_greedy/accuracy": 0.25, "step": step}


def _observe(monitor, rows, log_history):
    """Each step's health/* metrics; after every even step an evaluation's row is logged, as the
    loop logs it after the step's checks."""
    out = []
    for row in rows:
        out.append(monitor.observe(row, log_history))
        if row["step"] % 2 == 0:
            log_history.append(_eval_row(row["step"]))
    return out


def _through_a_checkpoint(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # as a checkpoint's train state is read


def _episodes(monitor):
    return [(e.check, e.fired_at, e.cleared_at, e.held) for e in monitor.episodes]


def test_a_restored_monitor_finds_what_the_uninterrupted_one_finds_at_the_same_steps(history):
    cfg = loading.from_dict({}, OVERRIDES)
    rows = _rows(history)
    uninterrupted = HealthMonitor(cfg)
    expected = _observe(uninterrupted, rows, [_eval_row(0)])
    assert ("no_learning_signal", 7, 14) in [e[:3] for e in _episodes(uninterrupted)]
    assert "heldout_not_improving" in [e[0] for e in _episodes(uninterrupted)]
    assert uninterrupted.stopped.step == 7

    cut = 4  # the checkpoint of step 4, written after that step's evaluation was logged
    first = HealthMonitor(cfg)
    assert _observe(first, rows[:cut], [_eval_row(0)]) == expected[:cut]
    state = _through_a_checkpoint(first.state_dict())
    resumed = HealthMonitor(cfg, state=state)
    # a resumed run's log_history starts empty: the evaluations before it come from the state
    assert _observe(resumed, rows[cut:], []) == expected[cut:]
    assert _episodes(resumed) == _episodes(uninterrupted)
    assert resumed.stopped.step == 7

    fresh = HealthMonitor(cfg)  # what a resumed run did before the history was saved
    assert _observe(fresh, rows[cut:], []) != expected[cut:]


def test_a_run_stopped_by_fail_on_stays_stopped_unless_the_check_is_dropped(history):
    cfg = loading.from_dict({}, OVERRIDES)
    monitor = HealthMonitor(cfg)
    _observe(monitor, _rows(history)[:7], [])
    state = _through_a_checkpoint(monitor.state_dict())
    assert HealthMonitor(cfg, state=state).stopped.step == 7
    dropped = loading.from_dict({}, [*OVERRIDES, "health.fail_on=[]"])
    assert HealthMonitor(dropped, state=state).stopped is None


def test_a_state_kept_under_another_window_or_unreadable_starts_afresh(history, caplog):
    cfg = loading.from_dict({}, OVERRIDES)
    monitor = HealthMonitor(cfg)
    _observe(monitor, _rows(history)[:5], [])
    wider = loading.from_dict({}, [*OVERRIDES, "health.window=12"])
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        restarted = HealthMonitor(wider, state=monitor.state_dict())
    assert list(restarted.rows) == [] and restarted.episodes == []
    assert "kept under health.window=10; the checks start afresh" in caplog.text
    # a checkpoint's train state is untrusted: a history that does not parse is not one
    broken = {**monitor.state_dict(), "rows": 5, "firing": {"x": 99}}
    with caplog.at_level(logging.WARNING, logger="grpo.health.monitor"):
        assert list(HealthMonitor(cfg, state=broken).rows) == []
    assert "in a form this grpo cannot read" in caplog.text


def test_the_train_state_carries_the_history_and_an_old_one_resumes_afresh(
    tokenizer, tmp_path, make_trainer, monkeypatch
):
    from grpo.run import runlog

    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)  # plots: seconds, not tested
    small = [
        "training.per_device_train_batch_size=16",
        "rollout.num_generations=4",
        "training.max_steps=2",
        "training.save_steps=0",
    ]
    trainer = make_trainer(tokenizer, tmp_path / "a", small)
    trainer.train()
    state = trainer.state_dict()
    assert [row["step"] for row in state["health"]["rows"]] == [1, 2]
    resumed = make_trainer(tokenizer, tmp_path / "b", small, restore=state)
    assert [row["step"] for row in resumed.health.rows] == [1, 2]
    del state["health"]  # a train state written before the history was saved
    old = make_trainer(tokenizer, tmp_path / "c", [*small, "training.max_steps=3"], restore=state)
    assert list(old.health.rows) == []
    old.train()
    assert [row["step"] for row in old.health.rows] == [3]
