"""Held-out evaluation results: one model x one decoding setting (EvalResult), the run's
eval.jsonl (append, read), and the before/after table the console, the log and the report show.
grpo.training.evaluate produces them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.run import run_writes
from grpo.run.run_files import MAX_LOG_BYTES, RunFileError

NUM_SAMPLES = 3
"""(prompt, completion, ...) examples kept in each EvalResult."""

ACCURACY_COUNTS = ("correct", "passed")
"""The scorer's counts that are a held-out accuracy: an answer task's *correct*, a code task's *passed*."""

COLUMN_NAMES = {"passed": "pass@1"}
"""Table headers for counts whose name alone would not say it (one completion per problem)."""


# --------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------


@dataclass
class EvalResult:
    """One model x one decoding setting on the held-out rows."""

    label: str
    """"before", "after", "step 50", ..."""
    step: int
    temperature: float
    """0 = greedy."""
    n: int
    counts: dict[str, list[int]]
    """The scorer's counts, name -> [count, out of], in table order (grpo.tasks.Scores)."""
    mean_reward: float
    """Mean weighted total of the configured rewards (NaN when every reward is missing)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Each reward function's mean."""
    mean_length: float = 0.0
    """Mean completion length in tokens."""
    clipped_ratio: float = 0.0
    """Fraction of completions that hit max_new_tokens without ending."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """A few {"prompt", "completion", ...the scorer's details} examples."""
    wording: int = 1
    """Which wording of the prompts: 1 the one trained on, k > 1 eval.instructions[k - 2]."""

    def count(self, name: str) -> int | None:
        return self.counts[name][0] if name in self.counts else None

    @property
    def correct(self) -> int | None:
        return self.count("correct")

    @property
    def formatted(self) -> int | None:
        return self.count("formatted")

    @property
    def accuracy(self) -> float:
        """correct (code: passed) / n where the scorer counts it, else the mean reward."""
        for name in ACCURACY_COUNTS:
            if name in self.counts:
                return self.counts[name][0] / self.n if self.n else 0.0
        return self.mean_reward

    @property
    def decoding(self) -> str:
        """ "greedy", "temperature 1", and for another wording "greedy, wording 2"."""
        name = decoding_name(self.temperature)
        return name if self.wording == 1 else f"{name}, wording {self.wording}"

    @property
    def setting(self) -> tuple[int, float]:
        """What a result is compared with its before or after on: its wording and temperature."""
        return self.wording, self.temperature

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalResult":
        data = dict(data)
        if (
            "counts" not in data and "correct" in data
        ):  # eval.jsonl written before counts were generic
            n, formatted = data["n"], data.get("formatted", 0)
            data["counts"] = {
                "correct": [data["correct"], n],
                "formatted": [formatted, n],
                "correct among formatted": [
                    data.get("correct_among_formatted", data["correct"]),
                    formatted,
                ],
            }
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def decoding_name(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"temperature {temperature:g}"


def append_results(path: str | Path, results: list[EvalResult]) -> None:
    """`results` appended to a run directory's eval.jsonl, never through a link (run_writes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with run_writes.open_append(path.parent, path.name) as f:
        for r in results:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_results(path: str | Path) -> list[EvalResult]:
    """Every EvalResult in an eval.jsonl, in file order: blank or broken lines, and rows whose
    numbers are not an evaluation's (a directory from anywhere is read back), skipped; a file
    larger than run_files.MAX_LOG_BYTES is a RunFileError."""
    path = Path(path)
    if path.stat().st_size > MAX_LOG_BYTES:
        raise RunFileError(
            f"{path}: more than the {MAX_LOG_BYTES:,} bytes read back; it is not an eval.jsonl grpo wrote"
        )
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            result = EvalResult.from_dict(data) if _plausible(data) else None
        except (ValueError, RecursionError, TypeError, KeyError):
            continue
        if result is not None:
            out.append(result)
    return out


def _plausible(data: Any) -> bool:
    """A row with an evaluation's types: whole step, wording and n, a finite temperature, counts
    of [count, total] whole numbers."""

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(data, dict):
        return False
    temperature, counts = data.get("temperature"), data.get("counts", {})
    return (
        all(whole(data.get(k, 1)) for k in ("step", "n", "wording"))
        and "step" in data
        and isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and math.isfinite(temperature)
        and isinstance(counts, dict)
        and all(
            isinstance(c, list) and len(c) == 2 and all(whole(x) for x in c)
            for c in counts.values()
        )
    )


def latest(results: list[EvalResult], label: str) -> list[EvalResult]:
    """The last result with `label` for each setting (wording and temperature), in order of first
    appearance."""
    by_setting: dict[tuple[int, float], EvalResult] = {}
    for r in results:
        if r.label == label:
            by_setting[r.setting] = r
    return list(by_setting.values())


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def _fraction(x: int, total: int) -> str:
    return f"{x}/{total} ({100 * x / total:.1f}%)" if total else f"{x}/{total}"


def _reward(value: float | None) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{value:.3f}"
    )


def format_table(before: list[EvalResult], after: list[EvalResult] | None = None) -> str:
    """A markdown table, one row per decoding setting, before (and after) side by side.

    Columns: each of the scorer's counts (x/out of), then the mean reward; a task
    with no counts also shows each reward function's mean. Each for before and,
    when given, after.
    """
    results = list(before) + list(after or [])
    count_names = list(dict.fromkeys(name for r in results for name in r.counts))
    columns = [
        (
            COLUMN_NAMES.get(name, name),
            lambda r, name=name: _fraction(*r.counts[name]) if name in r.counts else "—",
        )
        for name in count_names
    ]
    columns.append(("mean reward", lambda r: _reward(r.mean_reward)))
    if not count_names:
        for fn in dict.fromkeys(name for r in results for name in r.rewards):
            columns.append((f"reward {fn}", lambda r, fn=fn: _reward(r.rewards.get(fn))))
    before_by = {r.setting: r for r in before}
    after_by = {r.setting: r for r in after} if after is not None else {}
    settings = list(before_by) + [t for t in after_by if t not in before_by]
    before_name = before[0].label if before else "before"
    after_name = after[0].label if after else "after"
    header = ["decoding"]
    for name, _ in columns:
        header.append(f"{name} ({before_name})")
        if after is not None:
            header.append(f"{name} ({after_name})")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + [":-:"] * (len(header) - 1)) + "|",
    ]
    for t in settings:
        cells = [(before_by.get(t) or after_by[t]).decoding]
        for _, fmt in columns:
            cells.append(fmt(before_by[t]) if t in before_by else "—")
            if after is not None:
                cells.append(fmt(after_by[t]) if t in after_by else "—")
        lines.append("| " + " | ".join(cells) + " |")
    n = {r.n for r in results}
    if n:
        lines.append("")
        lines.append(
            f"{'/'.join(str(x) for x in sorted(n))} held-out problems, one completion each per decoding setting."
        )
    return "\n".join(lines)
