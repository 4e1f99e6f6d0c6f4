"""The health checks' state across steps: which have fired, when they clear, what they say.

    monitor = HealthMonitor(cfg)                      # a Config, or a config as a dict
    metrics.update(monitor.observe(metrics, log_history, control))   # every step, before logging

`observe` runs every registered check (grpo.health.checks, in grpo.registry.HEALTH_CHECKS'
order) on the step's metrics and the history it keeps, and returns the step's `health/*`
metrics: `health/<check>` is 1 while the check is firing, 0 otherwise, and
`health/update_to_weight` is the learning rate over health.weight_scale (AdamW's step on a
typical weight, relative to its size: what the learning-rate checks compare). A check fires at
the first step it finds something and clears after health.clear_after steps without it (a
note, which explains how the run is built, never clears); each
transition of a warning or an error is one console line (a logging warning), never a line per
step; a note is said by `grpo doctor` and report.md only. A finding that
explains another (all_truncated explains no_learning_signal) is reported alone.

`log_history` (the callbacks' state.log_history) carries the held-out evaluations' rows
(`eval_<decoding>/accuracy`); `control` (a callbacks Control, or transformers' TrainerControl)
gets should_save and should_training_stop when a check named in health.fail_on fires, so the
loop stops after this step with a checkpoint, as a callback's stop does; `stopped` says which.

The same monitor, fed a finished run's metrics.jsonl row by row, gives the same findings
(grpo.health.diagnosis: `grpo doctor`, report.md).
"""

from __future__ import annotations

import collections
import logging
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from grpo.config.health import HealthConfig
from grpo.health.checks import READS_EVALUATIONS, READS_TIMES, EvalPoint, Finding, RunFacts, View
from grpo.registry import HEALTH_CHECKS

log = logging.getLogger(__name__)

PREFIX = "grpo health"
"""How each console line starts."""


@dataclass
class Episode:
    """One firing of a check: from the step it fired to the step it cleared (None: still firing)."""

    check: str
    severity: str
    first: Finding
    """What it said when it fired."""
    last: Finding
    """What it said at the last step it held."""
    fired_at: int
    cleared_at: int | None = None
    held: list[int] = field(default_factory=list)
    """The steps at which it found something."""
    at_end: bool = False
    """Found by the pass after the last step (with the `after` evaluation)."""

    def held_ranges(self) -> str:
        """The steps it held, as ranges: "3–12, 20"."""
        return ranges(self.held)


def ranges(numbers: Sequence[int]) -> str:
    parts, start, prev = [], None, None
    for n in sorted(set(numbers)):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}" if start == prev else f"{start}–{prev}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}–{prev}")
    return ", ".join(parts)


def _kept(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers a check may read (times but READS_TIMES, and counts of tokens, left out): what
    the history holds."""
    return {
        k: v
        for k, v in metrics.items()
        if (v is None or isinstance(v, (int, float)))
        and not k.startswith("health/")
        and (not k.startswith("time/") or k in READS_TIMES)
        and k != "tokens_per_second"
    }


_EVAL_KEY = re.compile(r"eval_(.+)/accuracy")


def points_from_log_history(
    rows: Sequence[Mapping[str, Any]], num_iterations: int = 1
) -> list[EvalPoint]:
    """The held-out scores of the callbacks' log_history (its `eval_<decoding>/accuracy` rows,
    at optimizer steps: num_iterations per grpo step), under one decoding: greedy, else the first
    logged for the wording trained on."""
    found: dict[str, list[EvalPoint]] = {}
    _scan(rows, num_iterations, found)
    return one_decoding(found)


def _scan(
    rows: Sequence[Mapping[str, Any]], num_iterations: int, found: dict[str, list[EvalPoint]]
) -> None:
    """Adds the held-out scores of `rows` to `found` (decoding -> points)."""
    for row in rows:
        for key, value in row.items():
            m = _EVAL_KEY.fullmatch(key) if key.startswith("eval_") else None
            if m and isinstance(value, (int, float)) and not isinstance(value, bool):
                step = int(row.get("step", 0)) // max(1, num_iterations)
                found.setdefault(m.group(1), []).append(EvalPoint(step, float(value), m.group(1)))


def one_decoding(found: dict[str, list[EvalPoint]]) -> list[EvalPoint]:
    if not found:
        return []
    name = (
        "greedy"
        if "greedy" in found
        else next((d for d in found if "wording" not in d), next(iter(found)))
    )
    return sorted(found[name], key=lambda p: p.step)


class HealthMonitor:
    def __init__(
        self,
        cfg: Any,
        *,
        is_main: bool = True,
        world_size: int = 1,
        limits: HealthConfig | None = None,
        console: bool = True,
        state: Mapping[str, Any] | None = None,
    ):
        """`cfg`: the run's Config (or a config as a dict, e.g. a run's config.yaml as read);
        `limits`: the health section to use (default: the config's). `is_main`: this process
        speaks (under torchrun every rank runs the checks on the same gathered metrics, rank 0
        prints; `world_size`: how many, for health.fail_on's decision, which every rank must
        take alike). `console`: print the transitions (False: keep them only, as `grpo doctor`
        does). `state`: a checkpoint's `state_dict()`, continued from (see there)."""
        data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg or {})
        self.limits = (
            limits if limits is not None else getattr(cfg, "health", None) or HealthConfig()
        )
        self.facts = RunFacts.from_config(data)
        self.speaks = is_main and console
        self.world_size = world_size
        self.checks = [(name, HEALTH_CHECKS.get(name)) for name in HEALTH_CHECKS.names()]
        n = self.limits
        self.rows: collections.deque = collections.deque(
            maxlen=max(n.window, n.patience, n.clear_after) + 1
        )
        self.early: list[dict[str, Any]] = []
        self.rewards: list[tuple[int, float]] = []
        self.evaluations: list[EvalPoint] = []
        self.firing: dict[str, Episode] = {}
        self.episodes: list[Episode] = []
        self._misses: dict[str, int] = {}
        self._broken: set[str] = set()
        self._history: Sequence[Mapping] | None = None
        self._scanned = 0
        self._found: dict[str, list[EvalPoint]] = {}
        self.stopped: Finding | None = None
        """The health.fail_on finding that stopped the run, if one did."""
        self._carried: dict[str, list[EvalPoint]] = {}
        """The held-out scores of a resumed run's earlier log_history (the checkpoint's)."""
        if state is not None:
            self._restore(state)

    # -------------------------------------------------------------- the trainer's call

    def observe(
        self,
        metrics: Mapping[str, Any],
        log_history: Sequence[Mapping] | None = None,
        control: Any = None,
    ) -> dict[str, float]:
        """The step's checks: transitions said on the console, health.fail_on acted on through
        `control`; returns the `health/*` metrics to add to the step's."""
        if not self.limits.enabled:
            return {}
        evaluations = self._evaluations_in(log_history) if log_history is not None else None
        stopped_before = self.stopped
        for line in self.step(metrics, evaluations):
            self._say(line)
        if self.stopped is not None and stopped_before is None:
            self._say(
                f"stopping after step {self.stopped.step}: health.fail_on names {self.stopped.check}; "
                "a checkpoint of this step is written"
            )
            if control is not None:
                control.should_save = True
                control.should_training_stop = True
        return self.metrics()

    def _evaluations_in(self, log_history: Sequence[Mapping]) -> list[EvalPoint]:
        """The held-out scores of the callbacks' log_history, read from where the last call
        stopped (it only grows; a shorter or other list is read again from its start)."""
        if log_history is not self._history or len(log_history) < self._scanned:
            self._history, self._scanned = log_history, 0
            self._found = {d: list(points) for d, points in self._carried.items()}
        _scan(log_history[self._scanned :], self.facts.num_iterations, self._found)
        self._scanned = len(log_history)
        return one_decoding(self._found)

    def metrics(self) -> dict[str, float]:
        """`health/<check>` (1 firing, 0 not) for every registered check, and `health/update_to_weight`."""
        out = {f"health/{name}": float(name in self.firing) for name, _ in self.checks}
        lr = self.rows[-1].get("learning_rate") if self.rows else None
        if isinstance(lr, (int, float)) and math.isfinite(lr):
            ratio = lr / self.limits.weight_scale
            if math.isfinite(ratio):  # a learning rate of 1e300 is no ratio to log
                out["health/update_to_weight"] = ratio
        return out

    # -------------------------------------------------------------- the checks, step by step

    def step(
        self, metrics: Mapping[str, Any], evaluations: Sequence[EvalPoint] | None = None
    ) -> list[str]:
        """Runs every check on this step; returns the console lines of what fired or cleared."""
        row = _kept(metrics)
        step = int(row.get("step", len(self.early) + 1))
        row["step"] = step
        self.rows.append(row)
        if len(self.early) < self.limits.window:
            self.early.append(row)
        reward = row.get("reward")
        if isinstance(reward, (int, float)) and math.isfinite(reward):
            self.rewards.append((step, float(reward)))
        if evaluations is not None:
            self.evaluations = list(evaluations)
        found = self._run(self._view(), [name for name, _ in self.checks])
        return self._transitions(step, found)

    def finish(self, evaluations: Sequence[EvalPoint] | None = None) -> list[str]:
        """After the last step: the checks of READS_EVALUATIONS once more, with every evaluation of the run
        (the `after` one included); what they find is kept as firing at the last step."""
        if not self.rows:
            return []
        if evaluations is not None:
            self.evaluations = list(evaluations)
        step, lines = int(self.rows[-1]["step"]), []
        found = self._run(
            self._view(final=True), [n for n in READS_EVALUATIONS if n in dict(self.checks)]
        )
        for name, finding in found.items():
            if name in self.firing:
                continue
            episode = Episode(
                name, finding.severity, finding, finding, step, held=[step], at_end=True
            )
            self.firing[name] = episode
            self.episodes.append(episode)
            lines.append(f"{finding.line()} (judged after the last step)")
        return lines

    def _view(self, final: bool = False) -> View:
        return View(
            rows=list(self.rows),
            early=self.early,
            run=self.facts,
            limits=self.limits,
            rewards=self.rewards,
            evaluations=self.evaluations,
            final=final,
        )

    def _run(self, view: View, names: list[str]) -> dict[str, Finding]:
        """Each named check's finding at this step, those another one explains left out."""
        checks = dict(self.checks)
        found: dict[str, Finding] = {}
        firing = frozenset(self.firing)
        for name in names:
            try:
                finding = checks[name](replace(view, check=name, firing=firing))
            except Exception as error:  # noqa: BLE001 - a broken check (a user's too) never stops training
                if name not in self._broken:
                    self._broken.add(name)
                    log.warning(
                        "%s: the check %s failed and is skipped: %s: %s",
                        PREFIX,
                        name,
                        type(error).__name__,
                        error,
                    )
                continue
            if finding is not None:
                found[name] = replace(finding, check=name, step=view.step)
        explained = {other for f in found.values() for other in f.explains}
        return {name: f for name, f in found.items() if name not in explained}

    def _transitions(self, step: int, found: dict[str, Finding]) -> list[str]:
        lines = []
        for name, finding in found.items():
            self._misses[name] = 0
            episode = self.firing.get(name)
            if episode is None:
                episode = Episode(name, finding.severity, finding, finding, step)
                self.firing[name] = episode
                self.episodes.append(episode)
                if finding.severity != "note":  # a note answers a question; the console stays quiet
                    lines.append(finding.line())
            # a fail_on check found at a step stops the run: where it fires, or at a resumed run's
            # first step while it still holds (a note never stops one); every rank decides alike,
            # and only rank 0 holds the held-out results
            stops = self.world_size == 1 or name not in READS_EVALUATIONS
            if name in self.limits.fail_on and self.stopped is None and stops:
                if finding.severity != "note":
                    self.stopped = finding
            episode.last = finding
            episode.held.append(step)
        # a note explains how the run is built: once said, it holds for the run
        for name in [n for n, e in self.firing.items() if n not in found and e.severity != "note"]:
            self._misses[name] = self._misses.get(name, 0) + 1
            if self._misses[name] >= self.limits.clear_after:
                episode = self.firing.pop(name)
                episode.cleared_at = step
                lines.append(f"{name} cleared at step {step} (fired at step {episode.fired_at})")
        return lines

    # -------------------------------------------------------------- saved with a checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The history the checks read and what has fired, as plain lists and dicts (a checkpoint's
        train state loads with weights_only=True), so that a resumed run's checks find what the
        uninterrupted run's find, at the same steps (health.fail_on included). The held-out
        scores of the log_history rows not yet read (an evaluation after this step) are in it."""
        found = {d: list(points) for d, points in self._found.items()}
        if self._history is not None:
            _scan(self._history[self._scanned :], self.facts.num_iterations, found)
        episodes = {id(e): i for i, e in enumerate(self.episodes)}
        return {
            "version": STATE_VERSION,
            "window": self.limits.window,
            "rows": [dict(r) for r in self.rows],
            "early": [dict(r) for r in self.early],
            "rewards": [[step, reward] for step, reward in self.rewards],
            "evaluations": [_point(p) for p in self.evaluations],
            "found": {d: [_point(p) for p in points] for d, points in found.items()},
            "episodes": [_episode(e) for e in self.episodes],
            "firing": {name: episodes[id(e)] for name, e in self.firing.items()},
            "misses": dict(self._misses),
            "broken": sorted(self._broken),
            "stopped": None if self.stopped is None else _finding(self.stopped),
        }

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Continues from `state_dict()`'s; one of another version, kept under another
        health.window (the run's first `window` steps are its trend baseline) or unreadable (a
        checkpoint's train state is untrusted) starts afresh, said once."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            return self._afresh("by another version of grpo")
        if state.get("window") != self.limits.window:
            return self._afresh(f"under health.window={state.get('window')!r}")
        try:
            rows = [dict(r) for r in state["rows"]]
            early = [dict(r) for r in state["early"]][: self.limits.window]
            rewards = [(int(step), float(reward)) for step, reward in state["rewards"]]
            evaluations = [EvalPoint(*p) for p in state["evaluations"]]
            carried = {str(d): [EvalPoint(*p) for p in ps] for d, ps in state["found"].items()}
            episodes = [_unepisode(e) for e in state["episodes"]]
            firing = {str(name): episodes[i] for name, i in state["firing"].items()}
            misses = {str(name): int(n) for name, n in state["misses"].items()}
            broken = {str(name) for name in state["broken"]}
            stopped = state.get("stopped")
            stopped = None if stopped is None else _unfinding(stopped)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            return self._afresh("in a form this grpo cannot read")
        self.rows.extend(rows)
        self.early, self.rewards, self.evaluations = early, rewards, evaluations
        self._carried, self._found = carried, {d: list(ps) for d, ps in carried.items()}
        self.episodes, self.firing, self._misses, self._broken = episodes, firing, misses, broken
        # a run stopped by health.fail_on stays stopped while that check is in it (resumed with the
        # check dropped from fail_on, it trains on)
        if stopped is not None and stopped.check in self.limits.fail_on:
            self.stopped = stopped

    def _afresh(self, why: str) -> None:
        log.warning(
            "%s: the checkpoint's health history was kept %s; the checks start afresh from here",
            PREFIX,
            why,
        )

    def _say(self, line: str) -> None:
        if self.speaks:
            log.warning("%s: %s", PREFIX, line)


STATE_VERSION = 1
"""The layout of `HealthMonitor.state_dict()`."""


def _point(p: EvalPoint) -> list:
    return [p.step, p.score, p.decoding]


def _finding(f: Finding) -> dict[str, Any]:
    return {
        "severity": f.severity,
        "message": f.message,
        "evidence": f.evidence,
        "fix": f.fix,
        "explains": list(f.explains),
        "check": f.check,
        "step": f.step,
    }


def _unfinding(d: Mapping[str, Any]) -> Finding:
    return Finding(**{**d, "explains": tuple(d["explains"])})


def _episode(e: Episode) -> dict[str, Any]:
    return {
        "check": e.check,
        "severity": e.severity,
        "first": _finding(e.first),
        "last": _finding(e.last),
        "fired_at": e.fired_at,
        "cleared_at": e.cleared_at,
        "held": list(e.held),
        "at_end": e.at_end,
    }


def _unepisode(d: Mapping[str, Any]) -> Episode:
    return Episode(
        **{
            **d,
            "first": _unfinding(d["first"]),
            "last": _unfinding(d["last"]),
            "held": list(d["held"]),
        }
    )
