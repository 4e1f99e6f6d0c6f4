"""A run's health from what it logged: the checks replayed over its metrics.

    diagnosis = diagnose(metrics, points, config)   # grpo.run.doctor reads them from a run directory
    print(diagnosis.text())                         # what `grpo doctor RUN_DIR` prints
    diagnosis.markdown()                            # report.md's "Health" section

The monitor the training loop runs (grpo.health.monitor) is fed the run's metrics row by row,
each step seeing the held-out scores logged before it (as the loop's monitor does), then the
end-of-run pass with every score: the same findings the run printed, and those only the
`after` evaluation can show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from grpo.config.errors import ConfigError
from grpo.config.health import HealthConfig
from grpo.health.checks import EvalPoint
from grpo.health.monitor import Episode, HealthMonitor
from grpo.registry import HEALTH_CHECKS


@dataclass
class Diagnosis:
    """The checks' findings over a run's logged steps."""

    episodes: list[Episode]
    logged: int
    """How many steps were replayed."""
    span: tuple[int, int] | None = None
    """The first and last step replayed (None: none)."""
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
        span = f" (steps {self.span[0]}–{self.span[1]})" if self.span else ""
        lines = [
            f"{where}{self.logged} steps logged{span}, {self.evaluations} held-out evaluations"
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
                f"No health check fired over the {self.logged} logged steps ({len(self.checks)} checks: "
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
    metrics: Iterable[Mapping[str, Any]],
    points: Sequence[EvalPoint] = (),
    config: Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
) -> Diagnosis:
    """The checks replayed over the step rows of metrics.jsonl, consumed as they come (any
    iterable; what is held is the monitor's: its window of recent steps and each step's reward,
    never the rows), each step
    seeing the held-out scores (of one decoding, grpo.health.monitor.one_decoding) logged before
    it, then the end-of-run pass. The rows come in step order (grpo.run.run_files.read_metrics
    sorts them); a row without a whole step, or whose step is not after the one before it, is
    passed over."""
    config = config or {}
    monitor = HealthMonitor(config, limits=health_config(config, overrides), console=False)
    points = sorted(points, key=lambda p: p.step)
    seen = 0  # the scores logged before the row's step
    logged, first, last = 0, None, None
    for row in metrics:
        step = row.get("step")
        if type(step) is not int or (last is not None and step <= last):
            continue
        before = seen
        while seen < len(points) and points[seen].step < step:
            seen += 1
        # the scores are handed over when there are new ones (None: the monitor keeps its own)
        monitor.step(row, points[:seen] if seen != before or logged == 0 else None)
        logged, first, last = logged + 1, step if first is None else first, step
    monitor.finish(points)
    return Diagnosis(
        monitor.episodes,
        logged,
        None if first is None else (first, last),
        len(points),
        run_dir,
        tuple(n for n, _ in monitor.checks),
    )
