"""Exact resume of a run generating ahead of training (rollout.max_staleness 2): SIGKILLed while a
batch is being generated ahead, while a push runs beside the next step, and at other moments,
and resumed with --resume, it ends with the uninterrupted run's metrics (timings aside),
samples, evaluations and final weights: each checkpoint holds the batches generated ahead (and
waits for the one being generated).

`grpo train` runs in forked children (tests/run/conftest.py) against one `grpo serve --engine hf`
in a thread of the test process (tests/conftest.py's serve_in_thread); a killed child's server
keeps serving, and the resumed child pushes its checkpoint's weights to it first."""

import random
import signal

import pytest

from grpo.run import checkpoint

pytestmark = pytest.mark.usefixtures("quick")


def _ahead(url: str) -> list[str]:
    # health.patience past the run's 6 steps: no level check (rollout_wait reads timings) fires
    return [
        "rollout.engine=server",
        f"rollout.server.url={url}",
        "rollout.server.timeout=20",
        "rollout.server.weight_sync_timeout=20",
        "rollout.max_staleness=2",
        "health.patience=50",
    ]


def _expected(tmp_path, overrides, write_config, run_grpo, read_rows):
    assert run_grpo(["train", str(write_config(tmp_path, "expected", overrides))]) == 0
    rows = read_rows(tmp_path / "expected" / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2, 2]
    return tmp_path / "expected"


def test_killed_while_a_batch_is_generated_ahead_and_resumed_is_the_uninterrupted_run(
    tmp_path, serve_in_thread, write_config, run_grpo, read_rows, assert_same_run
):
    overrides = _ahead(serve_in_thread().url)
    expected = _expected(tmp_path, overrides, write_config, run_grpo, read_rows)
    cfg = write_config(tmp_path, "killed", overrides)
    # the 5th generation: step 5's batch, generated ahead from step 2's weights while step 3
    # trains; checkpoint-1 (with steps 2-4's batches) and maybe -2 are written
    assert run_grpo(["train", str(cfg)], kill_at="ahead:5") == -signal.SIGKILL
    assert checkpoint.latest_checkpoint(tmp_path / "killed") is not None
    # the resumed run's first push (after step 2 or 3, whichever checkpoint it resumed from),
    # which runs beside the step after it: the server holds the new weights, the trainer has
    # not counted them yet
    assert run_grpo(["train", str(cfg), "--resume"], kill_at="push:1") == -signal.SIGKILL
    # the second step of the resumed run logged, its checkpoint not yet written
    assert run_grpo(["train", str(cfg), "--resume"], kill_at="logged:2") == -signal.SIGKILL
    assert run_grpo(["train", str(cfg), "--resume"]) == 0
    assert_same_run(tmp_path / "killed", expected)


@pytest.mark.slow
def test_killed_five_times_at_random_moments_and_resumed_is_the_uninterrupted_run(
    tmp_path, serve_in_thread, write_config, run_grpo, read_rows, assert_same_run
):
    overrides = _ahead(serve_in_thread().url)
    expected = _expected(tmp_path, overrides, write_config, run_grpo, read_rows)
    cfg = write_config(tmp_path, "killed", overrides)
    rng = random.Random(49)
    points = ["ahead", "push", "step", "logged", "save", "manifest"]
    kills = [(rng.choice(points), rng.randint(1, 3)) for _ in range(3)]
    kills.insert(
        rng.randint(0, 3), ("ahead", rng.randint(2, 4))
    )  # at least once while generating ahead
    kills.append(
        (None, rng.uniform(0.5, 2.0))
    )  # a wall-clock moment (a push may be cut: it is redone)
    outcomes = []
    for point, when in kills:
        rc = run_grpo(
            ["train", str(cfg), "--resume"],
            kill_at=f"{point}:{when}" if point else None,
            kill_after=None if point else when,
        )
        outcomes.append(rc)
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, (point, when, rc)
    if outcomes[-1] != 0:
        assert run_grpo(["train", str(cfg), "--resume"]) == 0
    assert outcomes.count(-signal.SIGKILL) >= 4, (kills, outcomes)
    assert_same_run(tmp_path / "killed", expected)
