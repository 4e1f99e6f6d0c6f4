"""GSM8K- and MATH-style tasks: word problems with a gold final answer, scored as math.

    gsm8k   rows {question, answer}: `answer` is a worked solution whose last line is
            `#### 72`; the gold answer is the text after `####`, commas removed ("1,000" -> "1000")
    math    rows {problem, solution}: the gold answer is the solution's last \\boxed{...}
            (nested braces included), as the `math_answer` reward reads it

Rows come from data.train_file / data.eval_file through the `datasets` library:
a `.jsonl`/`.json` or `.parquet` file, or a hub dataset `name[:subset[:split]]`
(e.g. `openai/gsm8k:main`; the split defaults to train for train_file and test
for eval_file). Each row's prompt is data.instruction with the question in
place of `{question}`, its `answer` column the gold answer (extracted once,
here, so that a row without one fails at load time, before any model loads);
its other columns are kept (GSM8K's worked solution as `solution`). The
training reward is `math_answer` unless rewards.funcs says otherwise, and the
held-out rows are scored by grpo.tasks.scorers.MathScorer (correct, answered).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.rewards.math_answer import extract_answer
from grpo.tasks import Row, Task
from grpo.tasks.scorers import MathScorer

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_GSM8K_FINAL = re.compile(r"####\s*([^\n]*)")


def gsm8k_gold(answer) -> str | None:
    """The final answer of a GSM8K solution: "... = 72 clips.\\n#### 1,072" -> "1072"."""
    if not isinstance(answer, str):
        return None
    found = _GSM8K_FINAL.findall(answer)
    value = found[-1].replace(",", "").strip().rstrip(".").strip() if found else ""
    return value or None


def math_gold(solution) -> str | None:
    """The last \\boxed{...} of a MATH solution: "so \\boxed{\\frac{1}{2}}." -> "\\frac{1}{2}"."""
    if not isinstance(solution, str):
        return None
    return extract_answer(solution, ("boxed",)) or None


def load_rows(source: str, key: str, default_split: str) -> tuple[list[Row], str]:
    """Every row of a local file or hub dataset (as dicts), and how to name it in errors."""
    import datasets

    path = Path(source).expanduser()
    progress_was_on = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # a "Generating train split" bar per file is noise here
    try:
        if path.suffix in FILE_BUILDERS:
            problem = safe_yaml.not_a_file(path)
            if problem:
                raise ConfigError(
                    f"{key}: {path} {problem}; give the path of a .jsonl or .parquet file"
                )
            where = str(path)
            dataset = datasets.load_dataset(
                FILE_BUILDERS[path.suffix], data_files=str(path), split="train"
            )
        elif path.exists():
            raise ConfigError(
                f"{key}: {path} is not a .jsonl, .json or .parquet file; convert it or rename it"
            )
        else:
            name, _, rest = source.partition(":")
            subset, _, split = rest.partition(":")
            where = f"{name} ({subset or 'default'}, {split or default_split})"
            dataset = datasets.load_dataset(name, subset or None, split=split or default_split)
    except ConfigError:
        raise
    except Exception as e:  # malformed file, unknown dataset, offline, ...
        raise ConfigError(
            f"{key}: cannot load {source!r} ({type(e).__name__}: {str(e)[:300]}); give a readable .jsonl or .parquet "
            "file, or a hub dataset as name[:subset[:split]] when online"
        ) from None
    finally:
        if progress_was_on:
            datasets.utils.enable_progress_bars()
    rows = dataset.to_list()
    if not rows:
        raise ConfigError(f"{key}: {where} has no rows")
    return rows, where


@dataclass(frozen=True)
class Style:
    """Where a style's rows keep the question and the solution, and how the gold answer is read."""

    task: str
    question: str
    solution: str
    gold: Callable[[object], str | None]
    fix: str
    """What a row without a gold answer needs."""


GSM8K = Style(
    "gsm8k", "question", "answer", gsm8k_gold, "end the answer with a line '#### <number>'"
)
MATH = Style(
    "math",
    "problem",
    "solution",
    math_gold,
    "write the final answer as \\boxed{...} in the solution",
)


def read_rows(
    source: str | None, key: str, default_split: str, style: Style, instruction: str
) -> list[Row]:
    """The rows of `source` with their prompt and gold `answer`; a ConfigError for a row without one."""
    if not source:
        return []
    rows, where = load_rows(source, key, default_split)
    out = []
    for number, row in enumerate(rows, 1):
        question = row.get(style.question)
        if not isinstance(question, str) or not question.strip():
            raise ConfigError(
                f"{key}: {where}, row {number}: no '{style.question}' text (columns: {sorted(row)}); "
                f"task {style.task!r} reads the question from '{style.question}'"
            )
        solution = row.get(style.solution)
        answer = style.gold(solution)
        if answer is None:
            raise ConfigError(
                f"{key}: {where}, row {number}: no final answer in '{style.solution}' "
                f"(it ends {str(solution)[-60:]!r}); {style.fix}, or drop the row"
            )
        prompt = [{"role": "user", "content": instruction.replace("{question}", question)}]
        kept = (
            {"solution": solution} if style.solution == "answer" and "solution" not in row else {}
        )
        # GSM8K's worked answer stays as `solution`
        out.append({**row, **kept, "prompt": prompt, "answer": answer})
    return out


def _task(cfg: Config, style: Style) -> Task:
    d = cfg.data
    train = read_rows(d.train_file, "data.train_file", "train", style, d.instruction)
    held_out = read_rows(d.eval_file, "data.eval_file", "test", style, d.instruction)
    return Task(
        style.task, train, held_out, MathScorer(cfg.rewards.math_forms, cfg.rewards.math_timeout)
    )


def gsm8k_task(cfg: Config) -> Task:
    return _task(cfg, GSM8K)


def math_task(cfg: Config) -> Task:
    return _task(cfg, MATH)
