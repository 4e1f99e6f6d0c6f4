"""health.fail_on across a resume: the health checks' history is in each checkpoint, so a run
SIGKILLed before the step a check fires, and resumed, stops at the step the uninterrupted run
stops at, with the same logs and weights; resumed from the checkpoint of that stop, it stays
stopped (exit 5, no further step). `grpo train` runs in forked children (tests/run/conftest.py)."""

import signal

import pytest

pytestmark = pytest.mark.usefixtures("quick")


def _constant_reward(tmp_path):
    path = tmp_path / "constant.py"
    path.write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    return f"{path}:zero"


def test_fail_on_stops_a_killed_and_resumed_run_at_the_uninterrupted_step(
    tmp_path, write_config, run_grpo, read_rows, assert_same_run
):
    # no reward spread at any step: no_learning_signal fires at step 5 (health.patience) of 6
    overrides = [
        f"rewards.funcs=[{_constant_reward(tmp_path)}]",
        "health.fail_on=[no_learning_signal]",
    ]
    expected = tmp_path / "expected"
    assert run_grpo(["train", str(write_config(tmp_path, "expected", overrides))]) == 5
    assert [r["step"] for r in read_rows(expected / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    cfg = write_config(tmp_path, "killed", overrides)
    # step 3 logged, its checkpoint not yet written: resumed from checkpoint-2, with steps 1-2's history
    assert run_grpo(["train", str(cfg)], kill_at="logged:3") == -signal.SIGKILL
    assert run_grpo(["train", str(cfg), "--resume"]) == 5
    assert_same_run(tmp_path / "killed", expected)

    # resumed from the checkpoint of the stop: still stopped there, nothing trained
    assert run_grpo(["train", str(cfg), "--resume"]) == 5
    assert [r["step"] for r in read_rows(tmp_path / "killed" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
