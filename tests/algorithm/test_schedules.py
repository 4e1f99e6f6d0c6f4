"""Hand-computed tests for the learning-rate schedules, grpo.algorithm.schedules: warm-up, then
linear, cosine or constant."""

import math

import pytest

from grpo.algorithm import lr_multiplier


def test_lr_multiplier_warmup_then_linear():
    # warmup 4 of 10 steps: (step+1)/4 for steps 0..3 -> .25 .5 .75 1
    assert [lr_multiplier("linear", s, 10, 4) for s in range(4)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0]
    )
    # then 1 - (step - 4)/6: step 4 -> 1, 7 -> 0.5, 10 -> 0, 12 -> 0 (clamped)
    assert [lr_multiplier("linear", s, 10, 4) for s in (4, 7, 10, 12)] == pytest.approx(
        [1.0, 0.5, 0.0, 0.0]
    )


def test_lr_multiplier_cosine_and_constant():
    # cosine after warmup 4 of 10: 0.5 (1 + cos(pi (step-4)/6)): 4 -> 1; 5 -> 0.5 (1 + cos(pi/6)) = 0.9330127;
    # 7 -> 0.5 (1 + cos(pi/2)) = 0.5; 10 -> 0
    got = [lr_multiplier("cosine", s, 10, 4) for s in (4, 5, 7, 10)]
    assert got == pytest.approx([1.0, 0.5 * (1 + math.sqrt(3) / 2), 0.5, 0.0], abs=1e-12)
    assert lr_multiplier("cosine", 1, 10, 4) == pytest.approx(0.5)  # warmup (1+1)/4
    # constant: warmup then 1 forever
    assert [lr_multiplier("constant", s, 10, 2) for s in (0, 1, 2, 50)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0]
    )


def test_lr_multiplier_without_warmup():
    # linear over 10 steps: step 0 -> 1, step 5 -> 0.5, step 9 -> 0.1
    assert [lr_multiplier("linear", s, 10, 0) for s in (0, 5, 9)] == pytest.approx([1.0, 0.5, 0.1])
    with pytest.raises(ValueError):
        lr_multiplier("step", 5, 10, 0)
