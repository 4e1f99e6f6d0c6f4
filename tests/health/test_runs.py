"""A scripted tiny run per check: the toy task (a+b=, 128 completions a step) set up to provoke
one failure fires that check, with its fix, at the step docs/health.md promises, and no other
warning or error. The zero-loss note (the toy's completions are all one token long, so its loss
is 0 by construction) is the only note any of them may carry."""

from __future__ import annotations

import json
import string

import pytest

from grpo.rewards.arithmetic import completion_text

NOTES = {"zero_loss"}


def _first(completions) -> list[str]:
    return [(completion_text(c) or " ")[0] for c in completions]


def constant(completions, **kwargs):
    return [0.5] * len(completions)


def ones(completions, **kwargs):
    """Pays for the answer "1", which no a+b (a, b in 1..4) is."""
    return [float(c == "1") for c in _first(completions)]


def not_ones(completions, **kwargs):
    return [float(c != "1") for c in _first(completions)]


def graded(completions, **kwargs):
    """A different reward for every first character: every group has a spread."""
    return [ord(c) / 128 for c in _first(completions)]


def _assert_fired(trainer, fired, check, step, *in_the_line):
    """`check` fired alone, with its fix, at `step`: a step where the run is built to make it fire
    (a level check's patience, a scripted spike), or a range of steps where it depends on how
    fast the tiny model learns, which another CPU's rounding shifts by a step or two."""
    problems, notes = fired(trainer)
    assert set(problems) == {check}, problems
    steps = step if isinstance(step, range) else range(step, step + 1)
    assert problems[check] in steps, (problems, steps)
    step = problems[check]
    assert notes <= NOTES, notes
    (line,) = [x for x in trainer.console if f"] {check} at step {step}: " in x]
    assert "Fix: " in line
    for text in in_the_line:
        assert text in line, (text, line)
    assert (
        json.loads((trainer.log.dir / "metrics.jsonl").read_text().splitlines()[step - 1])[
            f"health/{check}"
        ]
        == 1.0
    )


def test_the_toy_task_learning_fires_nothing_but_the_zero_loss_note(scripted_run, fired):
    """The note is recorded (health/zero_loss, doctor, the report) and not said on the console:
    a healthy run prints no health line."""
    trainer = scripted_run()
    assert fired(trainer) == ({}, {"zero_loss"})
    assert trainer.console == []
    (episode,) = trainer.health.episodes
    assert episode.fired_at == 10
    assert "the logged loss is 0 by construction" in episode.first.line()


def test_constant_rewards_have_no_learning_signal(scripted_run, fired):
    trainer = scripted_run(reward_funcs={"half": constant}, steps=8)
    _assert_fired(trainer, fired, "no_learning_signal", 5, "half (always 0.5)", "dynamic_sampling")


def test_every_completion_cut_and_masked_trains_nothing(scripted_run, fired):
    trainer = scripted_run(
        ["algorithm.mask_truncated_completions=true", "rollout.ignore_eos=true"], steps=8
    )
    _assert_fired(trainer, fired, "all_truncated", 5, "nothing is trained", "max_completion_length")


@pytest.mark.parametrize(
    "reward, said",
    [
        (lambda completions, **kw: [None] * len(completions), "returns None for every completion"),
        (
            lambda completions, **kw: [
                None if i % 4 else x for i, x in enumerate(graded(completions))
            ],
            "returns None for most completions",
        ),
        (lambda completions, **kw: 1 / 0, "raises"),
    ],
    ids=["all None", "None for three in four", "raises"],
)
def test_a_reward_function_that_gives_nothing(scripted_run, fired, reward, said):
    trainer = scripted_run(reward_funcs={"broken": reward}, steps=8)
    _assert_fired(trainer, fired, "reward_failing", 5, "broken", said)


def test_a_constant_function_beside_one_that_varies(scripted_run, fired, first_char_correct):
    trainer = scripted_run(
        ["rewards.funcs=[arithmetic_correct,arithmetic_format]"],
        reward_funcs={"correct": first_char_correct, "half": constant},
        steps=12,
    )
    _assert_fired(trainer, fired, "constant_reward", 10, "half", "samples.jsonl")


def test_a_near_greedy_sampler_collapses_entropy(scripted_run, fired):
    trainer = scripted_run(["rollout.temperature=0.001"], steps=8)
    _assert_fired(trainer, fired, "entropy_collapse", 5, "rollout.temperature (now 0.001)")


class Flatten:
    """At step 12 divides the output layer by 1000: the policy's distribution goes flat at once."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 12:
            import torch

            with torch.no_grad():
                model.lm_head.weight.mul_(0.001)


def test_a_flattened_policy_blows_entropy_up(scripted_run, fired):
    trainer = scripted_run(
        ["training.learning_rate=1e-5"],
        reward_funcs={"graded": graded},
        prepare=lambda model: model.lm_head.weight.mul_(50),  # a peaked start: entropy about 1
        steps=18,
        callbacks=[Flatten()],
    )
    # flat from step 13: five steps above 3x the early median
    _assert_fired(trainer, fired, "entropy_blowup", 17, "learning_rate", "entropy_coef")


def test_kl_runs_away_at_a_high_learning_rate(scripted_run, fired):
    trainer = scripted_run(["algorithm.beta=0.04", "training.learning_rate=0.01"], steps=14)
    # KL above 1 from about step 7 here; a level check fires 5 steps after it first holds
    _assert_fired(trainer, fired, "kl_runaway", range(5, 15), "raise algorithm.beta (now 0.04)")


def test_a_tiny_trust_region_pins_the_clip_ratio(scripted_run, fired):
    trainer = scripted_run(
        ["algorithm.num_iterations=4", "algorithm.epsilon=0.001", "training.learning_rate=0.002"],
        reward_funcs={"graded": graded},
        steps=8,
    )
    _assert_fired(trainer, fired, "clip_ratio_high", 5, "num_iterations")


def test_one_huge_reward_spikes_the_gradient(scripted_run, fired, first_char_correct):
    def spiky(completions, answer, trainer_state, **kwargs):
        if trainer_state.global_step == 20:  # step 21's batch: rewards of 0 and 10,000
            return [1e4 * (i % 2) for i in range(len(completions))]
        return first_char_correct(completions, answer)

    trainer = scripted_run(
        ["algorithm.scale_rewards=none", "training.max_grad_norm=0"],
        reward_funcs={"spiky": spiky},
        steps=24,
    )
    _assert_fired(trainer, fired, "grad_norm_spike", 21, "max_grad_norm is 0")


def test_a_nan_loss_is_a_skipped_update(scripted_run, fired, monkeypatch):
    from grpo import algorithm

    real, calls = algorithm.policy_loss, {"n": 0}

    def nan_at_step_3(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1  # one micro-batch a step here
        return (loss * float("nan"), stats) if calls["n"] == 3 else (loss, stats)

    monkeypatch.setattr(algorithm, "policy_loss", nan_at_step_3)
    trainer = scripted_run(steps=6)
    _assert_fired(trainer, fired, "nonfinite_updates", 3, "train/skipped_updates 1 at step 3")


def test_a_reward_the_held_out_score_does_not_share(scripted_run, fired):
    trainer = scripted_run(["eval.every=5"], reward_funcs={"ones": ones}, steps=27)
    # the evaluation at step 25 against the one at 5, seen at the next step
    _assert_fired(trainer, fired, "heldout_not_improving", 26, "held-out greedy score 0")


def test_a_reward_that_pays_for_length(scripted_run, fired):
    def length(completions, **kwargs):
        return [len(completion_text(c)) / 5 for c in completions]

    # most characters end a completion: it starts short, and grows as the policy avoids them
    stops = json.dumps(list(string.ascii_letters + string.digits))
    trainer = scripted_run(
        [
            "rollout.max_completion_length=5",
            "training.learning_rate=0.003",
            f"rollout.stop_strings={stops}",
        ],
        reward_funcs={"length": length},
        steps=24,
    )
    # a trend check: from step 20, once the lengths near the cap (step 22 on an AMD EPYC)
    _assert_fired(trainer, fired, "length_hacking", range(20, 25), "max_completion_length 5")


def test_two_rewards_pulling_apart(scripted_run, fired):
    trainer = scripted_run(
        ["rewards.funcs=[arithmetic_correct,arithmetic_format]", "rewards.weights=[1.0,0.5]"],
        reward_funcs={"ones": ones, "not_ones": not_ones},
        steps=25,
    )
    # a trend check: from step 20, once the rewards have moved apart (step 23 on an AMD EPYC)
    _assert_fired(
        trainer, fired, "reward_tradeoff", range(20, 26), "ones rises while not_ones falls"
    )


def test_a_learning_rate_below_float_resolution(scripted_run, fired):
    trainer = scripted_run(["training.learning_rate=1e-12"], steps=8)
    _assert_fired(trainer, fired, "lr_too_small", 5, "float32", "raise training.learning_rate")


def test_a_learning_rate_of_100(scripted_run, fired):
    trainer = scripted_run(["training.learning_rate=100.0"], steps=8)
    _assert_fired(trainer, fired, "lr_too_large", 1, "lower training.learning_rate")


# ---------------------------------------------------------------- fail_on, and the same diagnosis after


def test_fail_on_stops_the_run_after_the_step_with_a_checkpoint(scripted_run):
    trainer = scripted_run(
        ["health.fail_on=[no_learning_signal]"], reward_funcs={"half": constant}, steps=30
    )
    assert trainer.trained_steps == 5 and trainer.state.step == 5
    assert (trainer.health.stopped.check, trainer.health.stopped.step) == ("no_learning_signal", 5)
    run = trainer.log.dir
    assert (run / "checkpoint-5" / "manifest.json").is_file() and (run / "final").exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 5
    assert "health.fail_on names no_learning_signal" in trainer.console[-1]


def test_the_diagnosis_of_the_run_directory_is_what_the_run_said(scripted_run):
    from grpo.run.doctor import diagnose_run

    trainer = scripted_run(["eval.every=5"], reward_funcs={"ones": ones}, steps=27)
    live = [(e.check, e.fired_at, e.cleared_at, e.first.evidence) for e in trainer.health.episodes]
    replayed = [
        (e.check, e.fired_at, e.cleared_at, e.first.evidence)
        for e in diagnose_run(trainer.log.dir).episodes
    ]
    assert replayed == live and live
    report = (trainer.log.dir / "report.md").read_text()
    assert (
        "## Health" in report and "| heldout_not_improving | warning | fired at step 26" in report
    )


def test_the_tiny_example_fires_no_warning(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from grpo.cli import main

    monkeypatch.chdir(
        Path(__file__).resolve().parents[2]
    )  # its reward file is named from the repository
    run = tmp_path / "tiny"
    assert main(["train", "examples/tiny.yaml", f"output_dir={run}", "training.max_steps=120"]) == 0
    assert main(["doctor", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        "[note] zero_loss: noted at step 10" in out
        and "[warning]" not in out
        and "[error]" not in out
    )
