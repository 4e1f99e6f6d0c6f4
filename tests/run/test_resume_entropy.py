"""Exact resume with the adaptive entropy controller: its coefficient and last entropy are train
state (grpo.training.state.EntropyControl), saved in each checkpoint as plain floats, so a run
killed mid-way and resumed is the run that was never interrupted (the forked `grpo train` runs
of tests/run/conftest.py)."""

import pytest
import torch

from grpo.run import checkpoint

pytestmark = pytest.mark.usefixtures("quick")

ADAPTIVE = [
    "algorithm.use_adaptive_entropy=true",
    "algorithm.entropy_coef=0.01",
    "algorithm.entropy_coef_delta=0.004",
    "algorithm.entropy_target=100.0",  # above any entropy here: the coefficient rises every pass
    "algorithm.num_iterations=2",
    "eval.every=0",
]


def test_adaptive_entropy_resume_is_exact(
    tmp_path, write_config, run_grpo, read_rows, train_to, assert_same_run
):
    _, expected = train_to(tmp_path, "expected", ADAPTIVE)
    coefs = [row["entropy_coef"] for row in read_rows(expected / "metrics.jsonl")]
    # two passes a step, the mean of the coefficients after each: 0.01 + 0.004 * (2 step - 0.5)
    assert coefs == pytest.approx([0.01 + 0.004 * (2 * s - 0.5) for s in range(1, 7)])

    cfg = write_config(tmp_path, "killed", ADAPTIVE)
    assert run_grpo(["train", str(cfg)], kill_at="step:4") == -9
    latest = checkpoint.latest_checkpoint(tmp_path / "killed")
    state = torch.load(latest / checkpoint.STATE, weights_only=True)["train"]
    step = state["step"]
    assert 1 <= step < 6
    assert state["entropy"]["coef"] == pytest.approx(0.01 + 0.004 * 2 * step)
    assert run_grpo(["train", str(cfg), "--resume"]) == 0
    assert_same_run(tmp_path / "killed", expected)
