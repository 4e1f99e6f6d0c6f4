"""A run's health from its directory: the checks replayed over what it logged.

    diagnosis = diagnose_run("runs/grpo")     # metrics.jsonl, eval.jsonl, config.yaml
    print(diagnosis.text())                   # what `grpo doctor RUN_DIR` prints
    diagnosis.markdown()                      # report.md's "Health" section

The monitor the training loop runs (grpo.health.monitor) is fed the run's metrics row by row,
each step seeing the evaluations logged before it (as the loop's monitor does), then the
end-of-run pass with every evaluation: the same findings the run printed, and those only the
`after` evaluation can show. A run still going is read as far as it has written (a last line
cut short is skipped).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo.config import safe_yaml
from grpo.config.errors import ConfigError
from grpo.config.health import HealthConfig
from grpo.health.checks import EvalPoint
from grpo.health.monitor import Episode, HealthMonitor, one_decoding
from grpo.registry import HEALTH_CHECKS

ACCURACY_COUNTS = ("correct", "passed")
"""An evaluation's counts that are its accuracy (as grpo.run.eval_results.EvalResult.accuracy
reads them: correct, or a code task's passed; else its mean reward)."""


@dataclass
class Diagnosis:
    """The checks' findings over a run's logged steps."""

    episodes: list[Episode]
    steps: list[int]
    evaluations: int = 0
    run_dir: str | None = None
    checks: tuple[str, ...] = field(default_factory=lambda: HEALTH_CHECKS.names())

    @property
    def problems(self) -> list[Episode]:
        """The warnings and errors (notes explain; they are never a problem)."""
        return [e for e in self.episodes if e.severity != "note"]

    def text(self) -> str:
        """The diagnosis as `grpo doctor` prints it."""
        where = f"{self.run_dir}: " if self.run_dir else ""
        span = f" (steps {self.steps[0]}–{self.steps[-1]})" if self.steps else ""
        lines = [
            f"{where}{len(self.steps)} steps logged{span}, {self.evaluations} held-out evaluations"
        ]
        if not self.episodes:
            lines.append(
                f"no health check fired ({len(self.checks)} checks; docs/health.md says what each reads)"
            )
            return "\n".join(lines)
        for e in _in_order(self.episodes):
            lines.append(f"[{e.severity}] {e.check}: {_when(e)}")
            lines.append(f"  {e.first.message}")
            lines.append(f"  evidence: {e.first.evidence}")
            if e.last is not e.first and e.last.evidence != e.first.evidence:
                lines.append(f"  latest (step {e.last.step}): {e.last.evidence}")
            lines.append(f"  fix: {e.first.fix}")
        quiet = len(self.checks) - len({e.check for e in self.episodes})
        if not self.problems:
            lines.append("no problem found: no warning or error fired")
        lines.append(f"{quiet} other checks fired nothing (docs/health.md)")
        return "\n".join(lines)

    def markdown(self) -> list[str]:
        """report.md's "Health" section."""
        lines = ["## Health", ""]
        if not self.episodes:
            lines.append(
                f"No health check fired over the {len(self.steps)} logged steps ({len(self.checks)} checks: "
                "see docs/health.md, or `grpo doctor` on this directory)."
            )
            return lines
        lines += [
            "Each check read the step's metrics (`health/<check>` in metrics.jsonl is 1 while it fired); "
            "`grpo doctor` on this directory prints the same.",
            "",
            "| check | severity | fired | steps it held |",
            "|---|---|---|---|",
        ]
        for e in _in_order(self.episodes):
            lines.append(f"| {e.check} | {e.severity} | {_when(e)} | {e.held_ranges()} |")
        lines.append("")
        for e in _in_order(self.episodes):
            lines += [
                f"**{e.check}** ({e.severity}, step {e.fired_at}): {_cell(e.first.message)}. "
                f"Evidence: {_cell(e.first.evidence)}. Fix: {_cell(e.first.fix)}.",
                "",
            ]
        return lines


def _in_order(episodes: Sequence[Episode]) -> list[Episode]:
    rank = {"error": 0, "warning": 1, "note": 2}
    return sorted(episodes, key=lambda e: (rank.get(e.severity, 3), e.fired_at))


def _when(e: Episode) -> str:
    if e.at_end:
        return f"after the last step ({e.fired_at}), with every evaluation"
    if e.severity == "note":
        return f"noted at step {e.fired_at}"
    held = f"fired at step {e.fired_at}"
    return held + (
        f", cleared at step {e.cleared_at}"
        if e.cleared_at is not None
        else ", still firing at the end"
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------ the replay


def eval_points(rows: Sequence[Mapping[str, Any]]) -> list[EvalPoint]:
    """The held-out scores of eval.jsonl's rows under one decoding: greedy on the wording trained
    on, else the first setting logged; a score is the accuracy (correct, or passed, over n), or
    the mean reward for a task scored by its rewards alone."""
    found: dict[str, list[EvalPoint]] = {}
    for row in rows:
        score = _score(row)
        temperature = row.get("temperature")
        if score is None or not isinstance(temperature, (int, float)):
            continue
        name = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        wording = row.get("wording", 1)
        if wording != 1:
            name += f", wording {wording}"
        found.setdefault(name, []).append(EvalPoint(int(row.get("step", 0)), score, name))
    return one_decoding(found)


def _score(row: Mapping[str, Any]) -> float | None:
    counts, n = row.get("counts"), row.get("n")
    if isinstance(counts, Mapping):
        for name in ACCURACY_COUNTS:
            count = counts.get(name)
            if isinstance(count, list) and count and isinstance(count[0], (int, float)):
                return count[0] / n if isinstance(n, int) and n > 0 else 0.0
    reward = row.get("mean_reward")
    if isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward):
        return float(reward)
    return None


def health_config(config: Mapping[str, Any], overrides: Sequence[str] = ()) -> HealthConfig:
    """The run's health section (its defaults where the run has none), with `overrides`
    (health.key=value) applied; an override the section refuses is a ConfigError."""
    from grpo.config import loading

    section = config.get("health") if isinstance(config, Mapping) else None
    section = section if isinstance(section, Mapping) else {}
    try:
        return loading.from_dict({"health": dict(section)}, list(overrides)).health
    except ConfigError:
        if overrides:
            raise
        return HealthConfig()  # a section from another version of grpo: the defaults


def diagnose(
    metrics: Sequence[Mapping[str, Any]],
    evaluations: Sequence[Mapping[str, Any]] = (),
    config: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
) -> Diagnosis:
    """The checks replayed over the step rows of metrics.jsonl (in step order), each step seeing
    the evaluations (eval.jsonl's rows) logged before it, then the end-of-run pass."""
    config = config or {}
    monitor = HealthMonitor(config, limits=health_config(config, overrides), console=False)
    points = eval_points(evaluations)
    rows = sorted((r for r in metrics if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    for row in rows:
        monitor.step(row, [p for p in points if p.step < row["step"]])
    monitor.finish(points)
    return Diagnosis(
        monitor.episodes,
        [r["step"] for r in rows],
        len(points),
        run_dir,
        tuple(n for n, _ in monitor.checks),
    )


# ------------------------------------------------------------------ reading a run directory


class NotDiagnosable(ValueError):
    """The directory holds nothing to diagnose yet; the message says why."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl; a line that does not parse (a run's last line being written) is skipped."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_run(run_dir: str | Path) -> tuple[list[dict], list[dict], dict]:
    """(metrics rows, one per step (a step logged twice, by a resumed run, keeps its last),
    eval.jsonl's rows, the run's resolved config as a dict ({} when unreadable))."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise NotDiagnosable(f"{path} does not exist: the run has logged no step yet")
    by_step: dict[int, dict] = {}
    for row in _jsonl(path):
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    if not by_step:
        raise NotDiagnosable(f"{path} holds no step yet: nothing to diagnose")
    evaluations = _jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").is_file() else []
    return [by_step[s] for s in sorted(by_step)], evaluations, _config(run_dir)


def _config(run_dir: Path) -> dict[str, Any]:
    # config.resolved.yaml: the run's own, beside a config.yaml of the user's (grpo.run.runlog)
    for name in ("config.resolved.yaml", "config.yaml"):
        path = run_dir / name
        if path.is_file():
            try:
                data = safe_yaml.read(path, "run config")
            except ConfigError:
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def diagnose_run(run_dir: str | Path, overrides: Sequence[str] = ()) -> Diagnosis:
    """`diagnose` over a run directory's files (NotDiagnosable when it has logged no step)."""
    metrics, evaluations, config = read_run(run_dir)
    return diagnose(metrics, evaluations, config, overrides, str(run_dir))
