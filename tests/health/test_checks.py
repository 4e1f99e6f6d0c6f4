"""Each check on synthetic metric histories: what fires it, at which step, what it says, and the
healthy history next to it that does not."""

from __future__ import annotations

import math

import pytest

from grpo.config.health import HealthConfig
from grpo.health import checks
from grpo.health.checks import EvalPoint
from grpo.registry import HEALTH_CHECKS


def test_every_registered_check_is_a_function_of_the_checks_module_with_a_docstring():
    for name in HEALTH_CHECKS.names():
        fn = HEALTH_CHECKS.get(name)
        assert fn is getattr(checks, name), name
        assert fn.__doc__ and len(fn.__doc__) > 40, name


def test_the_healthy_history_fires_nothing(history, view_of):
    rows = history(40, reward=lambda s: 0.3 + 0.01 * s)
    for name in HEALTH_CHECKS.names():
        assert HEALTH_CHECKS.get(name)(view_of(rows)) is None, name


# ---------------------------------------------------------------- learning signal, loss, truncation


def test_no_learning_signal_after_patience_steps_names_the_constant_function(history, view_of):
    rows = history(
        5,
        frac_reward_zero_std=1.0,
        reward_std=0.0,
        reward=0.0,
        **{"rewards/correct/std": 0.0, "rewards/correct/mean": 0.0},
    )
    assert checks.no_learning_signal(view_of(rows[:4])) is None  # 4 < health.patience
    found = checks.no_learning_signal(view_of(rows, num_generations=16, temperature=0.7))
    assert found.severity == "warning"
    assert "all 16 completions got the same reward" in found.message
    assert "steps 1–5" in found.evidence and "correct (always 0)" in found.evidence
    assert "rollout.num_generations, now 16" in found.fix and "now 0.7" in found.fix
    assert "dynamic_sampling" in found.fix and "every completion scores 0" in found.fix


def test_no_learning_signal_between_prompts_says_each_prompt_is_always_or_never_solved(
    history, view_of
):
    rows = history(6, frac_reward_zero_std=1.0, reward_std=0.0)  # the batch still varies
    found = checks.no_learning_signal(view_of(rows))
    assert "constant over the whole batch" not in found.evidence
    assert "always or never" in found.fix


def test_no_learning_signal_after_the_reward_rose_to_its_best_says_it_may_be_learned(
    history, view_of
):
    rows = history(
        20, reward=lambda s: min(1.0, 0.1 * s), frac_reward_zero_std=lambda s: float(s >= 10)
    )
    assert "the task is learned at this difficulty" in checks.no_learning_signal(view_of(rows)).fix
    flat = history(20, reward=0.5, frac_reward_zero_std=1.0)  # never rose: not learned, constant
    assert "learned" not in checks.no_learning_signal(view_of(flat)).fix


def test_no_learning_signal_share_and_a_noisy_step(history, view_of):
    rows = history(6, frac_reward_zero_std=lambda s: 0.0 if s == 3 else 0.9)
    assert checks.no_learning_signal(view_of(rows)) is None
    lower = HealthConfig(zero_spread_share=0.8)
    assert checks.no_learning_signal(view_of(rows, limits=lower)) is None  # steps 4–6: 3 < 5
    rows = history(8, frac_reward_zero_std=lambda s: 0.0 if s == 2 else 0.9)
    found = checks.no_learning_signal(view_of(rows, limits=lower))
    assert "at least 80% of the groups" in found.message


def test_a_firing_check_holds_on_one_step_of_its_condition(history, view_of):
    rows = history(8, frac_reward_zero_std=lambda s: 1.0 if s in (1, 2, 3, 4, 5, 8) else 0.0)
    assert checks.no_learning_signal(view_of(rows)) is None
    assert checks.no_learning_signal(view_of(rows, firing={"x"}, check="x")) is not None


def test_zero_loss_is_a_note_only_when_the_configuration_makes_it_so(history, view_of):
    rows = history(10, loss=lambda s: 0.0 if s != 4 else 0.01)
    found = checks.zero_loss(view_of(rows))
    assert found.severity == "note"
    assert "by construction" in found.message and "9 of steps 1–10" in found.evidence
    assert "reward_std" in found.fix
    assert checks.zero_loss(view_of(rows[:9])) is None  # fewer than health.window steps
    for facts in ({"num_iterations": 2}, {"beta": 0.04}, {"advantage_estimator": "gae"}):
        assert checks.zero_loss(view_of(rows, **facts)) is None, facts
    assert checks.zero_loss(view_of(history(10, loss=0.02))) is None
    # nothing learned either (no gradient): that is no_learning_signal's to say
    assert checks.zero_loss(view_of(history(10, loss=0.0, grad_norm=0.0))) is None


def test_all_truncated_with_the_mask_is_an_error_and_without_it_nothing(history, view_of):
    rows = history(5, **{"completions/clipped_ratio": 1.0})
    found = checks.all_truncated(
        view_of(rows, mask_truncated_completions=True, max_completion_length=64)
    )
    assert found.severity == "error" and "nothing is trained" in found.message
    assert "max_completion_length (now 64)" in found.fix and "stop_strings" in found.fix
    assert "no_learning_signal" in found.explains
    assert checks.all_truncated(view_of(rows)) is None  # trained on: a cut answer is scored
    some = history(5, **{"completions/clipped_ratio": 0.97})
    assert checks.all_truncated(view_of(some, mask_truncated_completions=True)) is None


def test_no_learning_signal_says_when_every_completion_was_also_cut(history, view_of):
    rows = history(5, frac_reward_zero_std=1.0, **{"completions/clipped_ratio": 1.0})
    found = checks.no_learning_signal(view_of(rows, max_completion_length=32))
    assert "also cut at max_completion_length=32" in found.fix


# ---------------------------------------------------------------- reward functions


def test_reward_failing_tells_none_from_errors_from_timeouts(history, view_of):
    none = history(5, **{"rewards/correct/mean": math.nan})
    found = checks.reward_failing(view_of(none))
    assert found.severity == "error" and "correct" in found.message
    assert "returns None for every completion" in found.fix
    errors = history(5, **{"rewards/correct/mean": math.nan, "rewards/correct/errors": 1})
    assert "raises" in checks.reward_failing(view_of(errors)).fix
    slow = history(5, **{"rewards/correct/timeouts": 2})
    found = checks.reward_failing(view_of(slow))
    assert "rewards.timeout" in found.fix and "10 timed out" in found.evidence
    assert checks.reward_failing(view_of(none[:4])) is None
    # JSON writes a missing mean as null: read back, it is missing too
    assert checks.reward_failing(view_of(history(5, **{"rewards/correct/mean": None}))) is not None


def test_a_failing_function_of_weight_zero_is_a_warning(history, view_of):
    rows = history(5, **{"rewards/logged/mean": math.nan})
    found = checks.reward_failing(view_of(rows, reward_weights=(1.0, 0.0)))
    assert found.severity == "warning" and "logged only" in found.message


def test_constant_reward_needs_the_others_to_carry_the_signal(history, view_of):
    rows = history(10, **{"rewards/format/mean": 1.0, "rewards/format/std": 0.0})
    found = checks.constant_reward(view_of(rows))
    assert "format" in found.message and "always 1" in found.evidence
    assert checks.constant_reward(view_of(rows[:9])) is None  # fewer than health.window steps
    assert checks.constant_reward(view_of(rows, reward_weights=(1.0, 0.0))) is None  # logged only
    flat = history(10, reward_std=0.0, **{"rewards/correct/std": 0.0})
    assert checks.constant_reward(view_of(flat)) is None  # no_learning_signal's case


# ---------------------------------------------------------------- entropy, KL, clipping, gradients


def test_entropy_collapse_needs_uniform_groups(history, view_of):
    rows = history(5, entropy=0.01, frac_reward_zero_std=0.95)
    found = checks.entropy_collapse(view_of(rows, temperature=0.3))
    assert "near-deterministic" in found.message and "now 0.3" in found.fix
    assert (
        checks.entropy_collapse(view_of(history(5, entropy=0.01, frac_reward_zero_std=0.5))) is None
    )
    # no token in the loss (every completion masked): entropy 0 and no gradient is no reading
    masked = history(5, entropy=0.0, grad_norm=0.0, frac_reward_zero_std=1.0)
    assert checks.entropy_collapse(view_of(masked)) is None


def test_entropy_blowup_against_the_early_median(history, view_of):
    rows = history(20, entropy=lambda s: 0.5 if s <= 15 else 2.0)
    found = checks.entropy_blowup(view_of(rows))
    assert "4x the median 0.5 of steps 1–10" in found.evidence
    assert checks.entropy_blowup(view_of(rows[:19])) is None  # 4 steps above
    tiny = history(20, entropy=lambda s: 1e-10 if s <= 15 else 1e-8)  # a collapsed policy's noise
    assert checks.entropy_blowup(view_of(tiny)) is None


def test_kl_runaway_and_clip_ratio_high(history, view_of):
    found = checks.kl_runaway(view_of(history(5, kl=2.0), beta=0.04))
    assert "raise algorithm.beta (now 0.04)" in found.fix
    assert checks.kl_runaway(view_of(history(5, kl=0.5))) is None
    assert checks.kl_runaway(view_of(history(5))) is None  # no kl logged (beta 0)
    found = checks.clip_ratio_high(
        view_of(history(5, **{"clip_ratio/region_mean": 0.5}), num_iterations=4)
    )
    assert "num_iterations 4" in found.evidence
    assert checks.clip_ratio_high(view_of(history(5, **{"clip_ratio/region_mean": 0.2}))) is None


def test_grad_norm_spike_against_the_median_before(history, view_of):
    rows = history(12, grad_norm=lambda s: 2.0 if s < 12 else 500.0)
    found = checks.grad_norm_spike(view_of(rows))
    assert "grad_norm 500 at step 12, 250x the median 2" in found.evidence
    assert "max_grad_norm=1 clipped" in found.fix
    assert "set it to 1.0" in checks.grad_norm_spike(view_of(rows, max_grad_norm=0.0)).fix
    assert (
        checks.grad_norm_spike(view_of(history(12, grad_norm=lambda s: 2.0 if s < 12 else 90.0)))
        is None
    )
    # steps that trained nothing (norm 0) are left out of the median; too few left: no verdict
    sparse = history(12, grad_norm=lambda s: 500.0 if s == 12 else (2.0 if s % 3 == 0 else 0.0))
    assert checks.grad_norm_spike(view_of(sparse)) is None


def test_nonfinite_updates(history, view_of):
    rows = history(
        3, **{"train/skipped_updates": lambda s: int(s == 3), "train/skipped_updates_total": 1}
    )
    found = checks.nonfinite_updates(view_of(rows))
    assert found.severity == "error" and "at step 3, 1 in the run" in found.evidence
    assert checks.nonfinite_updates(view_of(rows[:2])) is None


# ---------------------------------------------------------------- reward hacking


def test_heldout_not_improving_compares_the_reward_around_each_evaluation(history, view_of):
    rows = history(30, reward=lambda s: 0.1 + 0.02 * s)
    flat = [EvalPoint(0, 0.25), EvalPoint(20, 0.25)]
    found = checks.heldout_not_improving(view_of(rows, evaluations=flat))
    assert "0.25 at step 0 -> 0.25 at step 20" in found.evidence
    assert "samples.jsonl" in found.fix
    assert (
        checks.heldout_not_improving(
            view_of(rows, evaluations=[EvalPoint(0, 0.2), EvalPoint(20, 0.4)])
        )
        is None
    )
    assert (
        checks.heldout_not_improving(
            view_of(rows, evaluations=[EvalPoint(5, 0.2), EvalPoint(10, 0.2)])
        )
        is None
    )
    assert checks.heldout_not_improving(view_of(rows, evaluations=flat[:1])) is None
    still = history(30, reward=0.5)
    assert checks.heldout_not_improving(view_of(still, evaluations=flat)) is None


def test_length_hacking_needs_growth_to_the_cap_and_a_rising_reward(history, view_of):
    rows = history(
        20,
        **{"completions/mean_length": lambda s: 10.0 if s <= 10 else 60.0},
        reward=lambda s: 0.2 if s <= 10 else 0.6,
    )
    found = checks.length_hacking(view_of(rows, max_completion_length=64))
    assert "10 over steps 1–10 -> 60 over steps 11–20" in found.evidence
    assert "overlong_buffer" in found.fix
    assert checks.length_hacking(view_of(rows, max_completion_length=128)) is None  # not at the cap
    assert (
        checks.length_hacking(view_of(rows[:19], max_completion_length=64)) is None
    )  # windows overlap
    capped = history(20, **{"completions/mean_length": 64.0}, reward=lambda s: 0.01 * s)
    assert checks.length_hacking(view_of(capped, max_completion_length=64)) is None  # no growth


def test_reward_tradeoff(history, view_of):
    rows = history(
        20,
        **{
            "rewards/format/mean": lambda s: 0.2 if s <= 10 else 0.9,
            "rewards/format/std": 0.3,
            "rewards/correct/mean": lambda s: 0.6 if s <= 10 else 0.3,
        },
    )
    found = checks.reward_tradeoff(view_of(rows))
    assert "format rises while correct falls" in found.message
    assert "normalize_then_sum" in found.fix
    assert checks.reward_tradeoff(view_of(rows, reward_weights=(1.0, 0.0))) is None


# ---------------------------------------------------------------- the learning rate


def test_lr_too_small_in_the_weights_dtype(history, view_of):
    assert checks.lr_too_small(view_of(history(5, learning_rate=1e-6))) is None
    found = checks.lr_too_small(view_of(history(5, learning_rate=1e-10)))
    assert found.severity == "error" and "float32" in found.message
    # bf16 weights drop a step below 2^-9 of a weight of 0.02: 3.9e-5
    found = checks.lr_too_small(view_of(history(5, learning_rate=1e-6), weight_dtype="bfloat16"))
    assert "bfloat16" in found.message and "model.dtype: float32" in found.fix
    assert checks.lr_too_small(view_of(history(4, learning_rate=1e-10))) is None
    # a warm-up or a decay to 0 is not a learning rate that does nothing
    warm = history(12, learning_rate=lambda s: 0.0 if s < 3 else 1e-6)
    assert checks.lr_too_small(view_of(warm)) is None


def test_lr_too_large(history, view_of):
    found = checks.lr_too_large(view_of(history(1, learning_rate=1.0)))
    assert "50x a typical weight" in found.message
    assert (
        checks.lr_too_large(view_of(history(1, learning_rate=0.01))) is None
    )  # examples/code_tiny.yaml's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_resolution_is_a_quarter_of_the_dtypes_epsilon(dtype):
    import torch

    assert checks.WEIGHT_DTYPE_RESOLUTION[dtype] == torch.finfo(getattr(torch, dtype)).eps / 4
