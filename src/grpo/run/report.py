"""A run report: plots of the training metrics and a markdown summary.

    build_report("runs/grpo")  ->  runs/grpo/report.md, runs/grpo/plots/*.png

Reads from the run directory:

    metrics.jsonl   required: one JSON object per step (written by the trainer)
    config.yaml     optional: the resolved config (model, task, key settings)
    eval.jsonl      optional: grpo.training.evaluate results (before/after table, accuracy vs step)
                    and, with the metrics and config, the health checks' section (grpo.health)
    samples.jsonl   optional: {"step", "prompt", "completion", "reward"} per line

Plots are drawn with matplotlib's object API (no pyplot, no global backend
change; PNGs are rendered by Agg), one figure per quantity, 100 dpi, each PNG
written under a temporary name and renamed, so a PNG is never seen half-written. Every
write goes through grpo.run.run_writes: a link where report.md or plots/ goes is refused
(ReportError) before anything is drawn, and nothing is written through a link.

At the end of a run (`RunLog.report`) report.md is written at once and the plots
are drawn apart (`build_report(run_dir, plots_apart=True)`): by a fresh Python
interpreter, `python -m grpo.run.report RUN_DIR`, started with subprocess (fork
and exec, no Python code run in a copy of the trainer, so it is safe beside CUDA),
detached in its own session, so the run's process exits without waiting for
matplotlib. While it draws, plots/.rendering holds its PID; its errors, if any,
go to plots/render.log. `grpo report RUN_DIR` draws them in its own process.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

from grpo.run import run_writes
from grpo.run.eval_results import (
    ACCURACY_COUNTS,
    COLUMN_NAMES,
    EvalResult,
    format_table,
    latest,
    read_results,
)
from grpo.run.run_files import RunFileError, exists, iter_jsonl, read_config, read_metrics

DPI = 100
SMOOTH_FRACTION = 20
"""Curves of 40 points or more get a moving average over 1/20 of the points."""
FIGSIZE = (8.0, 4.5)
HEADLINE = [
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "clip_ratio/region_mean",
    "grad_norm",
]


ReportError = RunFileError
"""The run directory cannot be reported on; the message says why and what to do."""


def _values(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` is a finite number."""
    steps, values = [], []
    for row in metrics:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def _has(metrics: list[dict[str, Any]], key: str) -> bool:
    return bool(_values(metrics, key)[0])


def reward_names(metrics: list[dict[str, Any]]) -> list[str]:
    names: "OrderedDict[str, None]" = OrderedDict()
    for row in metrics:
        for key in row:
            if key.startswith("rewards/") and key.endswith("/mean"):
                names[key[len("rewards/") : -len("/mean")]] = None
    return list(names)


# --------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "the run report draws its plots with matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'grpo[report]')"
        ) from None
    return Figure


def _smooth(values: list[float]) -> list[float]:
    """Trailing moving average over about 1/SMOOTH_FRACTION of the points (at least 1)."""
    window = max(1, len(values) // SMOOTH_FRACTION)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _new_axes(title: str, ylabel: str, xlabel: str = "step"):
    Figure = _matplotlib()
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=13)
    ax.set_xlabel(xlabel, fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.grid(True, alpha=0.35)
    return fig, ax


def _line(ax, steps, values, label, color=None, smooth=True):
    """Raw values as a faint line, their moving average on top (when there are enough points)."""
    if smooth and len(values) >= 2 * SMOOTH_FRACTION:
        (raw,) = ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
        ax.plot(
            steps,
            _smooth(values),
            color=raw.get_color(),
            linewidth=2,
            label=f"{label} (moving avg.)",
        )
        return raw.get_color()
    (line,) = ax.plot(
        steps,
        values,
        color=color,
        linewidth=1.8,
        marker="o" if len(values) < 20 else None,
        markersize=3,
        label=label,
    )
    return line.get_color()


def _simple(metrics, title, ylabel, series: list[tuple[str, str]], ylim=None):
    fig, ax = _new_axes(title, ylabel)
    for key, label in series:
        steps, values = _values(metrics, key)
        if steps:
            _line(ax, steps, values, label)
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(loc="best", fontsize=9)
    return fig


def reward_figure(metrics):
    steps, mean = _values(metrics, "reward")
    std_by_step = dict(zip(*_values(metrics, "reward_std")))
    fig, ax = _new_axes("Training reward (mean over the generation batch)", "reward")
    color = _line(ax, steps, mean, "reward mean")
    band = [(s, m, std_by_step[s]) for s, m in zip(steps, mean) if s in std_by_step]
    if band:
        xs, ms, sds = [b[0] for b in band], [b[1] for b in band], [b[2] for b in band]
        if len(band) >= 2 * SMOOTH_FRACTION:  # the band follows the smoothed line
            ms, sds = _smooth(ms), _smooth(sds)
        ax.fill_between(
            xs,
            [m - sd for m, sd in zip(ms, sds)],
            [m + sd for m, sd in zip(ms, sds)],
            color=color,
            alpha=0.15,
            label="± reward_std (mean within-group std)",
        )
    ax.legend(loc="best", fontsize=9)
    return fig


def rewards_per_function_figure(metrics):
    names = reward_names(metrics)
    return _simple(
        metrics, "Reward per function (mean)", "reward", [(f"rewards/{n}/mean", n) for n in names]
    )


def length_figure(metrics):
    fig, ax = _new_axes("Completion length", "tokens")
    _line(ax, *_values(metrics, "completions/mean_length"), "mean length", color="tab:blue")
    handles, labels = ax.get_legend_handles_labels()
    if _has(metrics, "completions/clipped_ratio"):
        ax2 = ax.twinx()
        ax2.set_ylabel("fraction clipped (hit max_completion_length)", fontsize=11)
        _line(ax2, *_values(metrics, "completions/clipped_ratio"), "clipped ratio", color="tab:red")
        ax2.set_ylim(-0.02, 1.02)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="best", fontsize=9)
    return fig


def kl_figure(metrics):
    return _simple(
        metrics, "KL divergence to the reference model", "KL (nats/token)", [("kl", "kl")]
    )


def entropy_figure(metrics):
    return _simple(
        metrics,
        "Policy entropy over completion tokens",
        "entropy (nats/token)",
        [("entropy", "entropy")],
    )


def clip_ratio_figure(metrics):
    series = [
        ("clip_ratio/low_mean", "low (ratio < 1 - ε, A < 0)"),
        ("clip_ratio/high_mean", "high (ratio > 1 + ε_high, A > 0)"),
        ("clip_ratio/region_mean", "region (either)"),
    ]
    return _simple(metrics, "Clipped tokens", "fraction of tokens", series)


def zero_std_figure(metrics):
    return _simple(
        metrics,
        "Groups with zero reward spread (no learning signal)",
        "fraction of groups",
        [("frac_reward_zero_std", "frac_reward_zero_std")],
        ylim=(-0.02, 1.02),
    )


def eval_accuracy_figure(results: list[EvalResult]):
    """Held-out accuracy (solid; the mean reward for a task scored by its rewards alone) and the
    formatted fraction (dashed, when the scorer counts it) vs step, one colour per decoding setting
    (temperature, and wording when eval.instructions adds some)."""
    counted = next(
        (name for name in ACCURACY_COUNTS if any(name in r.counts for r in results)), None
    )
    fig, ax = _new_axes(
        "Held-out accuracy" if counted else "Held-out mean reward",
        "fraction of problems" if counted else "mean reward",
    )
    by_setting: dict[str, dict[int, EvalResult]] = {}
    for r in results:
        by_setting.setdefault(r.decoding, {})[r.step] = r  # last result per step wins
    for decoding, by_step in by_setting.items():
        steps = sorted(by_step)
        (line,) = ax.plot(
            steps,
            [by_step[s].accuracy for s in steps],
            marker="o",
            linewidth=2,
            label=f"{COLUMN_NAMES.get(counted, counted) if counted else 'mean reward'}, {decoding}",
        )
        formatted = [s for s in steps if by_step[s].formatted is not None]
        if formatted:
            ax.plot(
                formatted,
                [by_step[s].formatted / by_step[s].n if by_step[s].n else 0 for s in formatted],
                marker="s",
                linestyle="--",
                linewidth=1.2,
                color=line.get_color(),
                alpha=0.7,
                label=f"formatted, {decoding}",
            )
    if counted:
        ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="best", fontsize=9)
    return fig


def eval_steps(results: list[EvalResult]) -> set[int]:
    return {r.step for r in results}


def plot_names(
    metrics: list[dict[str, Any]], eval_results: list[EvalResult] | None = None
) -> list[str]:
    """The file stems of the plots the data allows, in the report's order (no matplotlib)."""
    names = []
    if _has(metrics, "reward"):
        names.append("reward")
    if any(_has(metrics, f"rewards/{n}/mean") for n in reward_names(metrics)):
        names.append("rewards_per_function")
    if _has(metrics, "completions/mean_length"):
        names.append("completion_length")
    if _has(metrics, "kl"):
        names.append("kl")
    if _has(metrics, "entropy"):
        names.append("entropy")
    if any(
        _has(metrics, k)
        for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
    ):
        names.append("clip_ratio")
    if _has(metrics, "frac_reward_zero_std"):
        names.append("frac_reward_zero_std")
    if eval_results and len(eval_steps(eval_results)) >= 2:
        names.append("eval_accuracy")
    return names


_FIGURES = {
    "reward": reward_figure,
    "rewards_per_function": rewards_per_function_figure,
    "completion_length": length_figure,
    "kl": kl_figure,
    "entropy": entropy_figure,
    "clip_ratio": clip_ratio_figure,
    "frac_reward_zero_std": zero_std_figure,
}


def _figure(name: str, metrics: list[dict[str, Any]], eval_results: list[EvalResult] | None):
    if name == "eval_accuracy":
        return eval_accuracy_figure(eval_results or [])
    return _FIGURES[name](metrics)


def figures(
    metrics: list[dict[str, Any]], eval_results: list[EvalResult] | None = None
) -> "OrderedDict[str, Any]":
    """{file stem: matplotlib Figure} for every plot the data allows."""
    return OrderedDict(
        (name, _figure(name, metrics, eval_results)) for name in plot_names(metrics, eval_results)
    )


PLOT_CAPTIONS = {
    "reward": "Mean reward per step; the band is ± the mean within-group standard deviation (reward_std).",
    "rewards_per_function": "Mean of each reward function per step.",
    "completion_length": "Mean completion length in tokens, and the fraction of completions cut at max_completion_length.",
    "kl": "KL estimate to the reference model, per completion token.",
    "entropy": "Mean entropy of the policy over completion tokens.",
    "clip_ratio": "Fraction of completion tokens whose ratio was clipped.",
    "frac_reward_zero_std": "Fraction of groups whose completions all got the same reward (zero advantage).",
    "eval_accuracy": "Held-out accuracy (solid) and fraction with an `Answer: N` line (dashed) per evaluation.",
}


# --------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _task(config: dict[str, Any]) -> str | None:
    task = _get(config, "data.task")
    if task == "arithmetic":
        operands = _get(config, "data.arithmetic.operands") or []
        operators = _get(config, "data.arithmetic.operators") or []
        pieces = []
        for i, rg in enumerate(operands):
            pieces.append(
                f"[{rg[0]}..{rg[1]}]" if isinstance(rg, list) and len(rg) == 2 else str(rg)
            )
            if i < len(operators):
                pieces.append(str(operators[i]))
        n_train, n_eval = (
            _get(config, "data.arithmetic.num_train"),
            _get(config, "data.arithmetic.num_eval"),
        )
        return f"arithmetic `{' '.join(pieces)}` ({n_train} training, {n_eval} held-out problems)"
    if task == "jsonl":
        return f"jsonl rows from `{_get(config, 'data.train_file')}` (held out: `{_get(config, 'data.eval_file')}`)"
    return task


SETTINGS = [
    ("rollout.num_generations", "G (completions per prompt)"),
    ("rollout.max_completion_length", "max_completion_length"),
    ("rollout.temperature", "sampling temperature"),
    ("training.per_device_train_batch_size", "per_device_train_batch_size"),
    ("training.gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("training.learning_rate", "learning_rate"),
    ("training.lr_scheduler_type", "lr_scheduler_type"),
    ("training.max_steps", "max_steps"),
    ("training.bf16", "bf16"),
    ("algorithm.loss_type", "loss_type"),
    ("algorithm.scale_rewards", "scale_rewards"),
    ("algorithm.beta", "beta (KL)"),
    ("algorithm.epsilon", "epsilon"),
    ("algorithm.epsilon_high", "epsilon_high"),
    ("algorithm.num_iterations", "num_iterations"),
    ("algorithm.dynamic_sampling", "dynamic_sampling"),
    ("rewards.funcs", "reward functions"),
    ("rewards.weights", "reward weights"),
]


def _summary(run_dir: Path, config: dict[str, Any], metrics: list[dict[str, Any]]) -> list[str]:
    lines = ["## Run summary", "", "| | |", "|---|---|"]
    rows: list[tuple[str, str]] = [("run directory", f"`{run_dir}`")]
    model = _get(config, "model.name")
    if model is not None:
        rows.append(("model", f"`{model}` ({_get(config, 'model.dtype')})"))
    task = _task(config)
    if task:
        rows.append(("task", task))
    steps = [m["step"] for m in metrics]
    rows.append(("steps logged", f"{len(steps)} (steps {steps[0]}–{steps[-1]})"))
    _, times = _values(metrics, "time/step")
    wall = sum(times)
    if times:
        rows.append(
            (
                "training time",
                f"{_duration(wall)} (sum of time/step; {wall / len(times):.2f} s/step)",
            )
        )
    _, gen = _values(metrics, "time/generate")
    if gen and wall > 0:
        rows.append(("time generating", f"{100 * sum(gen) / wall:.0f}% of step time"))
    _, tokens = _values(metrics, "num_tokens")
    _, tps = _values(metrics, "tokens_per_second")
    if tokens and wall > 0:
        rows.append(
            (
                "tokens/s",
                f"{tokens[-1] / wall:,.0f} (prompt + completion tokens, {tokens[-1]:,.0f} in all)",
            )
        )
    elif tps:
        rows.append(("tokens/s", f"{sum(tps) / len(tps):,.0f} (mean of tokens_per_second)"))
    for key, label in SETTINGS:
        value = _get(config, key)
        if value is not None:
            rows.append((label, f"`{value}`" if isinstance(value, list) else _fmt(value)))
    lines += [f"| {a} | {b} |" for a, b in rows]
    return lines


def _health(
    metrics: list[dict[str, Any]], eval_results: list[EvalResult], config: dict[str, Any]
) -> list[str]:
    """The health checks replayed over the run (grpo.health.diagnosis, as `grpo doctor` does: grpo.run.doctor):
    the steps each fired, what it found and the fix."""
    from grpo.health.diagnosis import diagnose
    from grpo.run.doctor import eval_points

    lines = diagnose(metrics, eval_points(eval_results), config).markdown()
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _first_last(metrics: list[dict[str, Any]]) -> list[str]:
    n = len(metrics)
    k = max(1, round(0.1 * n))
    first, last = metrics[:k], metrics[-k:]
    keys = ["reward"] + [f"rewards/{name}/mean" for name in reward_names(metrics)] + HEADLINE[1:]
    keys = list(dict.fromkeys(keys))

    def mean(rows, key):
        _, v = _values(rows, key)
        return sum(v) / len(v) if v else None

    span = lambda rows: (
        f"{rows[0]['step']}–{rows[-1]['step']}" if len(rows) > 1 else f"{rows[0]['step']}"
    )
    lines = [
        "## First vs last 10% of steps",
        "",
        f"Means over the first {k} and the last {k} of {n} logged steps.",
        "",
        f"| metric | first 10% (steps {span(first)}) | last 10% (steps {span(last)}) | change |",
        "|---|--:|--:|--:|",
    ]
    for key in keys:
        a, b = mean(first, key), mean(last, key)
        if a is None and b is None:
            continue
        change = _fmt(b - a, 3) if a is not None and b is not None else "n/a"
        if change not in ("n/a",) and not change.startswith("-"):
            change = "+" + change
        lines.append(
            f"| {key} | {_fmt(a) if a is not None else 'n/a'} | {_fmt(b) if b is not None else 'n/a'} | {change} |"
        )
    return lines


def reward_in_tens(metrics: list[dict[str, Any]]) -> list[tuple[int, int, float]]:
    """(first step, last step, mean reward) of each run of ten steps that have a reward, as the seed
    reports a run ("0.83 over the first 10 steps, 0.94 over the next 10"); the last may be shorter."""
    steps, rewards = _values(metrics, "reward")
    blocks = []
    for start in range(0, len(steps), 10):
        s, r = steps[start : start + 10], rewards[start : start + 10]
        blocks.append((s[0], s[-1], sum(r) / len(r)))
    return blocks


def _reward_in_tens(metrics: list[dict[str, Any]]) -> list[str]:
    blocks = reward_in_tens(metrics)
    if not blocks:
        return []
    lines = ["## Training reward, ten steps at a time", "", "| steps | mean reward |", "|---|--:|"]
    lines += [f"| {a}–{b} | {r:.3f} |" for a, b, r in blocks]
    return lines


def _fence(text: str) -> str:
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}text\n{text.rstrip()}\n{fence}"


def _one_line(text: Any, limit: int = 200) -> str:
    text = str(text).replace("\n", " ⏎ ").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _first_and_last_samples(
    path: Path, per_end: int
) -> tuple[tuple[int, list[dict]], tuple[int, list[dict]]] | None:
    """The first `per_end` sample rows (with a completion) of the first step and of the last,
    streamed from samples.jsonl: only those are held. A row whose step is not a whole number
    is passed over (one without a step is step 0)."""
    first: tuple[int, list[dict]] | None = None
    last: tuple[int, list[dict]] | None = None
    for _, row in iter_jsonl(path):
        step = row.get("step", 0)
        if "completion" not in row or type(step) is not int:
            continue
        if first is None or step < first[0]:
            first = (step, [])
        if last is None or step > last[0]:
            last = (step, [])
        for end in (first, last):
            if end[0] == step and len(end[1]) < per_end:
                end[1].append(row)
    return None if first is None else (first, last)


def _samples(run_dir: Path, per_end: int = 3) -> list[str]:
    path = run_dir / "samples.jsonl"
    found = _first_and_last_samples(path, per_end) if exists(path) else None
    if found is None:
        return []
    (first_step, first_rows), (last_step, last_rows) = found
    sections = [("Start of training", first_rows, first_step)]
    if last_step != first_step:
        sections.append(("End of training", last_rows, last_step))
    lines = ["## Sample completions", ""]
    for title, chosen, step in sections:
        lines += [f"### {title} (step {step})", ""]
        for r in chosen:
            reward = r.get("reward")
            lines.append(f"**Prompt:** {_one_line(r.get('prompt', ''))}  ")
            lines.append(f"**Reward:** {_fmt(reward) if reward is not None else 'n/a'}")
            lines += ["", _fence(str(r["completion"])), ""]
    return lines


def _eval_samples(before: list[EvalResult], after: list[EvalResult]) -> list[str]:
    lines = []
    for results in (before, after):
        greedy = [r for r in results if r.temperature == 0] or results
        if greedy and greedy[0].samples:
            r, s = greedy[0], greedy[0].samples[0]
            checked = (
                f"; answer {s.get('answer')}, extracted {s.get('predicted')}"
                if "answer" in s
                else ""
            )
            lines += [
                f"**{r.label}** ({r.decoding}, step {r.step}) — prompt: {_one_line(s.get('prompt', ''))}{checked}",
                "",
                _fence(str(s.get("completion", ""))),
                "",
            ]
    return (["### Held-out examples", ""] + lines) if lines else []


PLOTS_DIR = run_writes.PLOTS
RENDERING = ".rendering"
"""In plots/ while a renderer started by `build_report(plots_apart=True)` draws: its PID."""
RENDER_LOG = "render.log"


def _eval_results(run_dir: Path) -> list[EvalResult]:
    """eval.jsonl's results (grpo.run.eval_results.read_results); [] when there is none (one that
    is there but cannot be read is a ReportError naming it)."""
    path = run_dir / "eval.jsonl"
    return read_results(path) if exists(path) else []


def _render_plots(
    run_dir: Path, metrics: list[dict[str, Any]], eval_results: list[EvalResult]
) -> list[str]:
    """Draws plots/<name>.png for each of `plot_names` (each under a temporary name, then
    renamed, never through a link: run_writes); the names drawn."""
    run_writes.make_directory(run_dir, PLOTS_DIR)
    names = plot_names(metrics, eval_results)
    for name in names:
        figure = _figure(name, metrics, eval_results)
        run_writes.replace_file(
            run_dir,
            f"{PLOTS_DIR}/{name}.png",
            lambda f, figure=figure: figure.savefig(f, dpi=DPI, format="png"),
        )
    return names


def render_plots(run_dir: str | Path) -> list[str]:
    """The run directory's plots from its metrics.jsonl and eval.jsonl, in this process."""
    run_dir = Path(run_dir)
    return _render_plots(run_dir, read_metrics(run_dir), _eval_results(run_dir))


def start_renderer(run_dir: str | Path) -> subprocess.Popen:
    """Starts `python -m grpo.run.report RUN_DIR` (this interpreter, grpo from where this one has
    it) detached in a session of its own; plots/.rendering holds its PID until it is done. A
    fresh interpreter, exec'd: nothing of this process's state (CUDA, threads, locks) is copied
    into Python code that runs."""
    run_dir = Path(run_dir)
    run_writes.make_directory(run_dir, PLOTS_DIR)
    run_writes.remove(run_dir, f"{PLOTS_DIR}/{RENDER_LOG}")
    marker = f"{PLOTS_DIR}/{RENDERING}"
    run_writes.replace_file(run_dir, marker, "")
    source = str(Path(__file__).resolve().parents[2])  # the directory grpo is imported from
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": source + (os.pathsep + path if path else "")}
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "grpo.run.report", str(run_dir.resolve())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
    except OSError:
        run_writes.remove(run_dir, marker)
        raise
    run_writes.replace_file(run_dir, marker, f"{process.pid}\n")
    return process


def _draws_plots() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def build_report(run_dir: str | Path, plots_apart: bool = False) -> Path:
    """Write run_dir/plots/*.png and run_dir/report.md; return the report's path.

    `plots_apart`: report.md at once, the plots by a detached process (`start_renderer`); without
    matplotlib, report.md without plots (it says why) rather than an ImportError."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(
            f"run directory {run_dir} does not exist; pass the output_dir of a `grpo train` run"
        )
    try:  # before anything is read or drawn: the report never writes through a link
        run_writes.check_run_names(run_dir, (run_writes.REPORT, PLOTS_DIR))
    except run_writes.UnsafeRunPath as refusal:
        raise ReportError(str(refusal)) from None
    metrics = read_metrics(run_dir)
    drawn = _draws_plots() if plots_apart else bool(_matplotlib())
    # without plots_apart, _matplotlib() failed early, before writing anything, when it is missing
    config = read_config(run_dir)
    eval_results = _eval_results(run_dir)

    if not drawn:
        written: list[str] = []
    elif plots_apart:
        written = plot_names(metrics, eval_results)
    else:
        written = _render_plots(run_dir, metrics, eval_results)

    title = (
        config.get("logging", {}).get("run_name")
        if isinstance(config.get("logging"), dict)
        else None
    )
    lines = [f"# GRPO run report: {title or run_dir.name}", ""]
    # a step's missing reward is null in metrics.jsonl (NaN in a run's from before)
    if metrics and not _has(metrics, "reward"):
        lines += [
            "**No reward was computed in any step: every reward call failed or returned None, so nothing "
            "was learned.** See `rewards/<name>/errors` and `/timeouts` in metrics.jsonl, and the first "
            "failure's traceback in the console log.",
            "",
        ]
    lines += _summary(run_dir, config, metrics) + [""]
    lines += _health(metrics, eval_results, config) + [""]

    before, after = latest(eval_results, "before"), latest(eval_results, "after")
    if before or after:
        lines += ["## Held-out evaluation", ""]
        if before:
            lines += [format_table(before, after or None), ""]
        else:
            lines += [format_table(after), ""]
        from grpo.tasks.scorers import AnswerScorer, RewardScorer

        counted = any("formatted" in r.counts for r in before + after)
        lines += [(AnswerScorer if counted else RewardScorer).description, ""]
        lines += _eval_samples(before, after)
    elif eval_results:
        lines += [
            "## Held-out evaluation",
            "",
            format_table(latest(eval_results, eval_results[-1].label)),
            "",
        ]

    lines += _reward_in_tens(metrics) + [""]
    lines += _first_last(metrics) + [""]
    lines += ["## Plots", ""]
    if not drawn:
        lines += [
            "No plots: matplotlib is not installed (pip install 'grpo[report]', then "
            f"`grpo report {run_dir}`).",
            "",
        ]
    for name in written:
        lines += [f"![{name}](plots/{name}.png)", "", f"*{PLOT_CAPTIONS.get(name, name)}*", ""]
    lines += _samples(run_dir)

    path = run_writes.replace_file(run_dir, run_writes.REPORT, "\n".join(lines).rstrip() + "\n")
    if drawn and plots_apart and written:
        try:
            start_renderer(run_dir)
        except OSError:  # no process to be had (a process limit): drawn here, as grpo report does
            _render_plots(run_dir, metrics, eval_results)
    return path


def main(argv: list[str] | None = None) -> int:
    """The renderer `start_renderer` starts: RUN_DIR's plots; its errors to plots/render.log."""
    run_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    try:
        render_plots(run_dir)
        return 0
    except Exception:  # noqa: BLE001 - nobody waits on this process: the log says what went wrong
        failure = traceback.format_exc()
        try:  # into the run's own plots/ only: where that is a link, the failure goes unlogged
            run_writes.replace_file(run_dir, f"{PLOTS_DIR}/{RENDER_LOG}", failure)
        except (OSError, run_writes.UnsafeRunPath):
            pass
        return 1
    finally:
        try:
            run_writes.remove(run_dir, f"{PLOTS_DIR}/{RENDERING}")
        except (OSError, run_writes.UnsafeRunPath):
            pass


if __name__ == "__main__":
    sys.exit(main())
