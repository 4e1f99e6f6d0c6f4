"""The built-in `code` task (grpo.tasks.code_problems) and `CodeScorer`, pass@1 in the sandbox.

A code row has HumanEval's columns: `prompt` (plain text, the start of the
program), `test` (defines `check(candidate)`), `entry_point` (the function's
name), `task_id` and `canonical_solution`. A completion passes when
prompt + completion + "\\n" + test + "\\ncheck(entry_point)\\n" runs to the end
in the sandbox (grpo.rewards.code); the training reward is `humaneval_tests`,
the same check with credit for each assertion that holds (rewards.code_reward:
fraction, its default), where pass@1 asks for all of them.
"""

from __future__ import annotations

from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import SandboxConfig
from grpo.config.schema import Config
from grpo.tasks import Row, Scores, Task
from grpo.tasks.code_problems import HELD_OUT, PROBLEMS


def code_task(cfg: Config) -> Task:
    """32 problems to train on and 8 held out, the same every run (the split is fixed,
    not drawn with data.seed, so evaluations of different runs compare)."""
    rows = [dict(p) for p in PROBLEMS]
    train = [r for r in rows if r["task_id"] not in HELD_OUT]
    held_out = [r for r in rows if r["task_id"] in HELD_OUT]
    return Task("code", train, held_out, CodeScorer(cfg.rollout.stop_strings, cfg.rewards.sandbox))


def cut_at_stop(text: str, stop_strings: list[str] | tuple[str, ...]) -> str:
    """`text` up to the first of `stop_strings`: the engine keeps the stop string that
    ended a completion ("\\ndef ..."), which is no part of the function's body."""
    cut = min((i for i in (text.find(s) for s in stop_strings if s) if i >= 0), default=len(text))
    return text[:cut]


class CodeScorer:
    """pass@1: one completion per problem, *passed* when its program ran to the end in
    the sandbox (every assert of `check` held).

    Example: the row of `double` ("def double(x: int) -> int: ... return ") and
    completions ["x * 2", "x + x", "None"] -> passed 2/3, details
    [{"status": "ok", "passed": True}, {"status": "ok", "passed": True},
     {"status": "failed", "passed": False}].
    """

    description = (
        "pass@1: a completion *passed* when the problem's prompt, the completion and the problem's tests "
        "(`check(entry_point)`) ran to the end in the sandbox; one completion per problem."
    )

    def __init__(
        self, stop_strings: list[str] | tuple[str, ...] = (), sandbox: SandboxConfig | None = None
    ):
        self.stop_strings = tuple(stop_strings)
        self.sandbox = (
            sandbox  # rewards.sandbox: the same limits and isolation as the training reward
        )

    def check(self, rows: list[Row]) -> None:
        for i, row in enumerate(rows):
            for column in ("test", "entry_point"):
                if not isinstance(row.get(column), str) or not row[column]:
                    raise ConfigError(
                        f"held-out row {i} has no string '{column}' column (columns: {sorted(row)}); code evaluation "
                        "runs prompt + completion + test + check(entry_point), so every held-out row needs "
                        "'test' and 'entry_point' (HumanEval's columns)"
                    )
            if not isinstance(row["prompt"], str):
                raise ConfigError(
                    f"held-out row {i}: 'prompt' must be plain text (the start of the program, e.g. a function "
                    "header and docstring), not chat messages"
                )

    def score(self, rows: list[Row], texts: list[str]) -> Scores:
        if len(texts) != len(rows):
            raise ValueError(f"score: {len(texts)} completions for {len(rows)} rows")
        self.check(rows)
        # the sandbox: imported only when code is scored
        from grpo.rewards.code import (
            HumanEvalTests,
        )

        completions = [cut_at_stop(t, self.stop_strings) for t in texts]
        outcomes = HumanEvalTests(self.sandbox).outcomes(
            [r["prompt"] for r in rows],
            completions,
            [r["test"] for r in rows],
            [r["entry_point"] for r in rows],
        )
        passed = [bool(o.passed) for o in outcomes]
        details = [{"status": o.status, "passed": p} for o, p in zip(outcomes, passed)]
        return Scores({"passed": (sum(passed), len(rows))}, details)
