"""Held-out evaluation results: one model x one decoding setting (EvalResult), the run's
eval.jsonl (append, read), and the before/after table the console, the log and the report show.
grpo.training.evaluate produces them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from grpo.run import run_writes
from grpo.run.run_files import json_lines

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


def iter_results(path: str | Path) -> Iterator[EvalResult]:
    """Every EvalResult in an eval.jsonl, in file order, streamed through grpo.run.run_files'
    reader (a file that is there but not a regular file, cannot be read or is larger than
    run_files.MAX_LOG_BYTES is a RunFileError); blank or broken lines, lines longer than
    run_files.MAX_LINE_BYTES, integers beyond run_files.MAX_INTEGER and rows whose values are
    not an evaluation's (`_plausible`: a directory from anywhere is read back) passed over.
    Each result keeps its first sample only (what the report shows)."""
    for _, data in json_lines(path, strict=False):
        if _plausible(data):
            data["samples"] = data.get("samples", [])[:1]
            yield EvalResult.from_dict(data)


def read_results(path: str | Path) -> list[EvalResult]:
    """`iter_results`, an evaluation logged twice (the same label, step, wording and temperature:
    a resumed run's) kept once, its last record, in the order of the last records."""
    kept: dict[tuple[Any, ...], EvalResult] = {}
    for r in iter_results(path):
        key = (r.label, r.step, r.setting)
        kept.pop(key, None)
        kept[key] = r
    return list(kept.values())


def _number(x: Any, finite: bool = False) -> bool:
    return type(x) in (int, float) and (not finite or math.isfinite(x))


def _whole(x: Any) -> bool:
    return type(x) is int


def _plausible(data: Any) -> bool:
    """A row with an evaluation's types, as EvalResult and the report read them: a text label; a
    whole step, wording and n; a finite temperature; a mean reward that is a number (NaN: no
    reward); counts of [count, total] whole numbers; each reward function's mean a number or
    null; the mean length and clipped ratio numbers; samples a list of objects. (A key an
    earlier eval.jsonl lacks takes its default; rows of before counts were generic are read.)"""
    if not isinstance(data, dict):
        return False
    if "counts" not in data and "correct" in data:  # eval.jsonl written before counts were generic
        old = (data.get("correct"), data.get("n"), data.get("formatted", 0))
        old += (data.get("correct_among_formatted", 0),)
        if not all(_whole(x) for x in old):
            return False
    counts, rewards = data.get("counts", {}), data.get("rewards", {})
    samples = data.get("samples", [])
    return (
        all(k in data for k in ("label", "step", "temperature", "n", "mean_reward"))
        and ("counts" in data or "correct" in data)
        and isinstance(data.get("label"), str)
        and all(_whole(data.get(k, 1)) for k in ("step", "n", "wording"))
        and _number(data.get("temperature"), finite=True)
        and _number(data.get("mean_reward"))
        and all(_number(data.get(k, 0.0)) for k in ("mean_length", "clipped_ratio"))
        and isinstance(counts, dict)
        and all(
            isinstance(c, list) and len(c) == 2 and all(_whole(x) for x in c)
            for c in counts.values()
        )
        and isinstance(rewards, dict)
        and all(v is None or _number(v) for v in rewards.values())
        and isinstance(samples, list)
        and all(isinstance(x, dict) for x in samples)
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
