"""A run directory's diagnosis (`grpo doctor`, report.md's Health section): what it reads, how
it reads a run still being written, and the command's answers and refusals."""

from __future__ import annotations

import json
import math

import pytest

from grpo.cli import main
from grpo.health.diagnosis import diagnose
from grpo.registry import HEALTH_CHECKS
from grpo.run.doctor import diagnose_run, eval_points
from grpo.run.eval_results import EvalResult
from grpo.run.run_files import read_config, read_metrics


def _write_run(directory, rows, evaluations=(), config=None, lock=True):
    directory.mkdir(parents=True, exist_ok=True)
    if lock:
        (directory / ".grpo.lock").write_text("1 host\n")
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evaluations:
        (directory / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    if config is not None:
        import yaml

        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return directory


def test_doctor_on_a_run_that_had_no_signal(tmp_path, history, capsys):
    run = _write_run(tmp_path / "run", history(12, frac_reward_zero_std=lambda s: float(s >= 3)))
    assert main(["doctor", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"{run}: 12 steps logged (steps 1–12), 0 held-out evaluations" in out
    assert "[warning] no_learning_signal: fired at step 7, still firing at the end" in out
    assert "  evidence: frac_reward_zero_std 1 over 5 steps (steps 3–7)" in out
    assert (
        "  fix: " in out and f"{len(HEALTH_CHECKS.names()) - 1} other checks fired nothing" in out
    )


def test_doctor_on_a_healthy_run_exits_0(tmp_path, history, capsys):
    run = _write_run(tmp_path / "run", history(30, reward=lambda s: 0.2 + 0.01 * s))
    assert main(["doctor", str(run)]) == 0
    assert f"no health check fired ({len(HEALTH_CHECKS.names())} checks" in capsys.readouterr().out


def test_doctor_judges_with_the_thresholds_given(tmp_path, history, capsys):
    run = _write_run(tmp_path / "run", history(12, frac_reward_zero_std=lambda s: float(s >= 3)))
    assert main(["doctor", str(run), "health.patience=2"]) == 1
    assert "fired at step 4" in capsys.readouterr().out
    assert main(["doctor", str(run), "training.max_steps=3"]) == 2
    assert "only the health section's thresholds" in capsys.readouterr().err
    assert main(["doctor", str(run), "health.patience=0"]) == 2
    assert "grpo: config error: health.patience: must be in [1, 10000]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda d: d, "is not a run directory"),  # an empty directory
        (lambda d: d / "missing", "is not a directory"),
        (lambda d: (d / "file").write_text("x") and d / "file", "is not a directory"),
        (lambda d: (d / ".grpo.lock").write_text("") or d, "has logged no step yet"),
    ],
    ids=["empty", "missing", "a file", "a run before its first step"],
)
def test_doctor_refuses_what_is_not_a_run_in_one_line(tmp_path, capsys, make, said):
    path = make(tmp_path)
    assert main(["doctor", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("grpo: doctor: ") and said in line


def test_a_run_being_written_is_read_as_far_as_it_goes(tmp_path, history):
    rows = history(6)
    run = _write_run(tmp_path / "run", rows, lock=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({**rows[0], "step": 1, "reward": 0.9}) + "\n"
        )  # step 1 again: a resumed run
        f.write('{"step": 7, "rew')  # cut short
    metrics, config = read_metrics(run), read_config(run)
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6] and metrics[0]["reward"] == 0.9
    assert config == {}
    diagnosis = diagnose_run(run)
    assert (diagnosis.logged, diagnosis.span) == (6, (1, 6))


def test_the_held_out_score_is_the_one_the_results_report(tmp_path):
    results = [
        EvalResult("before", 0, 0.0, 4, {"correct": [1, 4], "formatted": [2, 4]}, 0.3),
        EvalResult("before", 0, 1.0, 4, {"correct": [3, 4]}, 0.3),
        EvalResult("step 5", 5, 0.0, 4, {"passed": [2, 4]}, 0.1),
        EvalResult("step 9", 9, 0.0, 4, {}, 0.7),
        EvalResult("step 9", 9, 0.0, 4, {"correct": [4, 4]}, 0.7, wording=2),
    ]
    points = eval_points(results)
    greedy = [r for r in results if r.temperature == 0 and r.wording == 1]
    assert [(p.step, p.score, p.decoding) for p in points] == [
        (r.step, r.accuracy, "greedy") for r in greedy
    ]
    assert eval_points([EvalResult("step 3", 3, 1.0, 2, {}, math.nan)]) == []


def test_the_after_evaluation_is_judged_after_the_last_step(history):
    rows = history(30, reward=lambda s: 0.1 + 0.02 * s)
    evaluations = [
        EvalResult("before", 0, 0.0, 4, {"correct": [1, 4]}, 0.0),
        EvalResult("after", 30, 0.0, 4, {"correct": [1, 4]}, 0.0),
    ]
    diagnosis = diagnose(rows, eval_points(evaluations))
    (episode,) = diagnosis.episodes
    assert (episode.check, episode.at_end, episode.fired_at) == ("heldout_not_improving", True, 30)
    assert "after the last step (30), with every evaluation" in diagnosis.text()


def test_the_runs_own_health_section_is_used(history):
    rows = history(12, frac_reward_zero_std=lambda s: float(s >= 3))
    assert diagnose(rows, config={"health": {"patience": 8}}).episodes[0].fired_at == 10
    # a section written by another version (an unknown key): the defaults
    assert diagnose(rows, config={"health": {"no_such_key": 1}}).episodes[0].fired_at == 7


def test_the_report_has_a_health_section(tmp_path, history):
    from grpo.run.report import build_report

    run = _write_run(tmp_path / "run", history(12, frac_reward_zero_std=lambda s: float(s >= 3)))
    text = build_report(run, plots_apart=True).read_text()
    section = text[text.index("## Health") : text.index("## Training reward")]
    assert (
        "| no_learning_signal | warning | fired at step 7, still firing at the end | 7–12 |"
        in section
    )
    assert "**no_learning_signal** (warning, step 7)" in section and "Fix: " in section
    quiet = _write_run(tmp_path / "quiet", history(12))
    assert (
        "No health check fired over the 12 logged steps"
        in build_report(quiet, plots_apart=True).read_text()
    )


@pytest.mark.parametrize(
    "spoil, said",
    [
        (lambda run: (run / "metrics.jsonl").write_text('{"step": "abc"}\n'), "not a step number"),
        (lambda run: (run / "metrics.jsonl").write_text("[" * 200_000 + "\n"), "nested too deeply"),
        (
            lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n'),
            ":2: not valid JSON",
        ),
    ],
    ids=["a step that is not one", "deep nesting", "a broken line inside"],
)
def test_doctor_refuses_a_spoilt_log_in_one_line(tmp_path, history, capsys, spoil, said):
    run = _write_run(tmp_path / "run", history(3))
    spoil(run)
    assert main(["doctor", str(run)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("grpo: doctor: ") and "metrics.jsonl" in line and said in line


def test_doctor_refuses_a_log_larger_than_it_reads(tmp_path, history, capsys, monkeypatch):
    from grpo.run import run_files

    run = _write_run(tmp_path / "run", history(3))
    monkeypatch.setattr(run_files, "MAX_LOG_BYTES", 100)
    assert main(["doctor", str(run)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "metrics.jsonl" in line and "more than the 100 read back" in line


def test_a_spoilt_config_or_evaluation_row_is_read_as_far_as_it_makes_sense(tmp_path, history):
    evaluations = [
        {
            "label": "step 5",
            "step": "abc",
            "temperature": 0.0,
            "n": 4,
            "counts": {},
            "mean_reward": 0.1,
        },
        {
            "label": "step 6",
            "step": 6,
            "temperature": [1],
            "n": 4,
            "counts": {},
            "mean_reward": 0.1,
        },
        EvalResult("step 7", 7, 0.0, 4, {"correct": [1, 4]}, 0.1).to_dict(),
    ]
    config = {"algorithm": {"num_iterations": "abc", "beta": [1]}, "rewards": {"weights": ["x"]}}
    run = _write_run(tmp_path / "run", history(8), evaluations, config)
    diagnosis = diagnose_run(run)
    assert diagnosis.evaluations == 1 and (diagnosis.logged, diagnosis.span) == (8, (1, 8))
