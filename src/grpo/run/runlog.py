"""The run directory, the trackers and the console, in one place.

    output_dir/
      config.yaml      the resolved config (config.resolved.yaml beside a config.yaml of the user's)
      metrics.jsonl    one line per step (every step; TRL's metric names)
      samples.jsonl    a few (prompt, completion, reward) per logged step
      eval.jsonl       one line per evaluation and decoding setting
      checkpoint-N/ final/   written by grpo.run.checkpoint (atomically); a resumed run
                             cuts the logs above back to its checkpoint's step
      plots/ report.md       grpo.run.report, at the end (report.md at once, the plots by a
                             detached process)
      .grpo.lock             held by the run using the directory (grpo.run.run_lock), taken
                             before anything here is read or changed

Every name above is in grpo.run.run_writes.RUN_NAMES and written through it: whole files
replaced atomically, logs appended with O_NOFOLLOW, never through a link (a link under one of
these names is refused at start-up, config.yaml's aside: that one is the user's).

The trackers of `logging.report_to` get the same numbers as metrics.jsonl.
Only the main process writes (is_main); the others keep quiet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from grpo.config import loading as config_module
from grpo.config.errors import ConfigError
from grpo.config.presets import describe_preset
from grpo.config.safe_yaml import escaped
from grpo.config.schema import Config
from grpo.run import checkpoint, run_writes
from grpo.run.eval_results import EvalResult, append_results, format_table
from grpo.run.progress import TrainProgress, bar

RUN_LOGS = (run_writes.METRICS, run_writes.SAMPLES, run_writes.EVAL)


def check_output_dir(output_dir: Path, overwrite: bool, resuming: bool = False) -> None:
    """Never write over another run's checkpoints unless asked to. A directory whose run stopped
    before its first checkpoint holds nothing to keep: it is simply run again."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(
            f"output_dir: {output_dir} is a file, not a directory; set output_dir to a directory path"
        )
    found = checkpoint.checkpoints(output_dir)
    if found and not (overwrite or resuming):
        names = ", ".join(f"{p.name}/" for p in found[-3:])
        raise ConfigError(
            f"output_dir: {output_dir} already holds a run ({names}); continue it with `grpo train CONFIG --resume`, "
            "choose another output_dir, or set overwrite_output_dir=true to delete it and start afresh"
        )


RESOLVED_ELSEWHERE = run_writes.RESOLVED_CONFIG


def resolved_config_path(run_dir: Path) -> Path:
    """Where the run's resolved config goes: config.yaml, unless a config.yaml is there that grpo
    did not write (not a regular file starting with grpo's first line: the config given on the
    command line, kept in output_dir by its user, or a link to any file, another run's config
    included), which is never replaced; then config.resolved.yaml."""
    header = config_module.RESOLVED_HEADER + "\n"
    try:
        first = run_writes.read_own(run_dir, run_writes.CONFIG, len(header.encode()))
    except (OSError, run_writes.UnsafeRunPath):
        first = b""
    if first is None:
        return run_dir / run_writes.CONFIG
    return run_dir / (
        run_writes.CONFIG
        if first.decode("utf-8", "replace") == header
        else run_writes.RESOLVED_CONFIG
    )


def cut_back(run_dir: Path, name: str, step: int, keep=lambda row: True) -> None:
    """Keeps the rows of run_dir/name, a .jsonl, up to `step` (and `keep`): a resumed run writes
    the later ones again. A last line cut short by a crash does not parse and goes too."""
    data = run_writes.read_own(run_dir, name)
    if data is None:
        return
    kept = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step and keep(row):
            kept.append(line + "\n")
    # a crash while this is written leaves the old file whole, to be cut back again
    run_writes.replace_file(run_dir, name, "".join(kept))


def _step_of(path: Path) -> float:
    step = checkpoint.manifest_step(path)
    return float("inf") if step is None else step  # unreadable: surely not one to keep


def _json_float(value: float) -> float | None:
    """JSON-friendly float: NaN (missing) becomes None."""
    value = float(value)
    return None if math.isnan(value) else value


def json_row(row: dict) -> str:
    """A metrics row as one line of JSON: NaN and inf, which are not JSON, as null (a missing
    number, as samples.jsonl writes a missing reward and the readers take it)."""

    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(row), allow_nan=False)


class RunLog:
    def __init__(
        self, cfg: Config, is_main: bool = True, resume: "checkpoint.Checkpoint | None" = None
    ):
        """Checks the output directory at once (start-up); writes nothing until `start`.
        `resume`: the checkpoint this run continues (its logs are kept up to its step)."""
        self.cfg, self.is_main, self.resume = cfg, is_main, resume
        self.dir = Path(cfg.output_dir)
        # continuing this directory's own run; a checkpoint from elsewhere starts a new run here
        continues = resume is not None and resume.path.resolve().parent == self.dir.resolve()
        check_output_dir(self.dir, cfg.overwrite_output_dir, resuming=continues)
        self.trackers = None
        self.progress: TrainProgress | None = None
        self._metrics = None

    def start(self) -> None:
        """The run directory: fresh (the old run's logs and, with overwrite_output_dir, its
        checkpoints deleted) or, resuming, cut back to the checkpoint; then the trackers."""
        if not self.is_main:
            return
        from grpo.run.trackers import Trackers

        self.dir.mkdir(parents=True, exist_ok=True)
        run_writes.check_run_names(self.dir)  # as at the claim: nothing is written through a link
        checkpoint.remove_leftovers(self.dir)
        run_writes.remove_temporaries(self.dir)
        if self.resume is None:
            if self.cfg.overwrite_output_dir:
                checkpoint.remove_checkpoints(checkpoint.checkpoints(self.dir))
            for name in RUN_LOGS:
                run_writes.remove(self.dir, name)
        else:
            step = self.resume.step
            found = checkpoint.checkpoints(self.dir)
            resolved = [p.resolve() for p in found]
            if self.resume.path.resolve() in resolved:
                later = found[resolved.index(self.resume.path.resolve()) + 1 :]
            else:  # resumed from a checkpoint elsewhere
                later = [p for p in found if _step_of(p) > step]
            if later:  # damaged, or from a continuation now abandoned: the logs past `step` go too
                self._print(
                    f"removing {', '.join(p.name for p in later)} (after the checkpoint resumed from)"
                )
                checkpoint.remove_checkpoints(later)
            cut_back(self.dir, run_writes.METRICS, step)
            cut_back(self.dir, run_writes.SAMPLES, step)
            # a run resumed at its last step evaluates "after" again (the first try may have been cut short)
            redone = self.cfg.eval.after and step == self.cfg.training.max_steps
            cut_back(
                self.dir,
                run_writes.EVAL,
                step,
                keep=lambda row: not (redone and row.get("label") == "after"),
            )
        config_path = resolved_config_path(self.dir)
        if config_path.name != "config.yaml":
            self._print(
                f"{self.dir / 'config.yaml'} was not written by grpo (your config?): left as it is, "
                f"the resolved config goes to {config_path.name}"
            )
        run_writes.replace_file(self.dir, config_path.name, config_module.dumps(self.cfg))
        preset = describe_preset(self.cfg)
        if preset:  # what the preset resolved to, so a run's algorithm is never a guess
            self._print(preset)
        self.trackers = Trackers.from_config(self.cfg)
        self._metrics = run_writes.open_append(self.dir, run_writes.METRICS)

    def start_training(self, step: int) -> None:
        """The training bar, from `step` (its ETA counts the steps trained from here)."""
        if self.is_main:
            self.progress = TrainProgress(
                self.cfg.training.max_steps, self.cfg.logging.log_every, start_step=step
            )

    def step(self, metrics: dict) -> None:
        if not self.is_main:
            return
        try:
            self._metrics.write(json_row(metrics) + "\n")
            self._metrics.flush()
        except (
            OSError
        ) as error:  # a full disk: said so, rather than a traceback (resuming cuts the line back)
            raise checkpoint.write_failed(
                self.dir / "metrics.jsonl", error, "the checkpoints so far are intact"
            ) from error
        self.trackers.log(metrics, metrics["step"])
        self.progress.update(metrics["step"], metrics)

    def samples(
        self,
        step: int,
        prompts: list,
        texts: list[str],
        rewards: list[float],
        group_size: int,
        per_step: int = 4,
        reward_columns: dict[str, list[float]] | None = None,
        extra_columns: dict[str, list] | None = None,
    ) -> None:
        """A few (prompt, completion, reward) examples, one per group, to samples.jsonl, the console and
        the trackers (a completions table); `reward_columns`: each reward function's values, by name;
        `extra_columns`: what reward functions logged with log_extra (None, bools, numbers, texts),
        under "extra" in samples.jsonl and as columns of the table."""
        if not self.is_main:
            return
        table = []
        try:
            with run_writes.open_append(self.dir, run_writes.SAMPLES) as f:
                for i in range(0, min(len(texts), per_step * group_size), group_size):
                    prompt = (
                        prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
                    )
                    record = {
                        "step": step,
                        "prompt": prompt,
                        "completion": texts[i],
                        "reward": _json_float(rewards[i]),
                    }
                    each = {
                        name: _json_float(values[i])
                        for name, values in (reward_columns or {}).items()
                    }
                    extra = {column: values[i] for column, values in (extra_columns or {}).items()}
                    written = {**record, "rewards": each} if each else dict(record)
                    if extra:
                        written["extra"] = extra
                    f.write(json.dumps(written) + "\n")
                    # a function named like a fixed column keeps its own column
                    row = {
                        **record,
                        **{
                            (f"{name} (reward)" if name in record else name): v
                            for name, v in each.items()
                        },
                    }
                    row.update(
                        {(c if c not in row else f"{c} (extra)"): v for c, v in extra.items()}
                    )
                    table.append(row)
        except OSError as error:  # as for metrics.jsonl
            raise checkpoint.write_failed(
                self.dir / "samples.jsonl", error, "the checkpoints so far are intact"
            ) from error
        if self.trackers is not None:
            self.trackers.log_completions(table, step)
        self.progress.sample(texts[0], _json_float(rewards[0]))

    def evaluation(
        self,
        label: str,
        step: int,
        num_rows: int,
        num_batches: int,
        run: Callable[[object], list[EvalResult]],
    ) -> list[EvalResult]:
        """Runs `run(progress)` under an evaluation bar; prints the table, appends eval.jsonl,
        sends each decoding's accuracy to the trackers."""
        if not self.is_main:
            return run(None)
        self._print(f"evaluating ({label}) on {num_rows} held-out problems...")
        with bar(num_batches, f"eval {label}", "batch") as progress:
            results = run(progress)
        self._print(format_table(results))
        append_results(self.dir / run_writes.EVAL, results)
        if self.trackers is not None:
            logged = {}
            for r in results:
                logged[f"eval/{r.decoding}/accuracy"] = r.accuracy
                logged[f"eval/{r.decoding}/mean_reward"] = r.mean_reward
            self.trackers.log(logged, step)
        return results

    def before_after(self, before: list[EvalResult], after: list[EvalResult]) -> None:
        self._print(
            "\nheld-out evaluation, before and after training:\n" + format_table(before, after)
        )

    def report(self) -> None:
        """report.md at once; its plots drawn by a detached process (grpo.run.report), so the run
        does not wait for them."""
        if not self.is_main:
            return
        from grpo.run.report import RENDERING, ReportError, build_report

        try:
            path = build_report(self.dir, plots_apart=True)
        except ReportError as error:  # the run is over and saved: said, not raised
            self._print(f"grpo: no report written: {error}")
            return
        drawing = (self.dir / run_writes.PLOTS / RENDERING).is_file()
        self._print(f"report: {path}" + (" (its plots are being drawn apart)" if drawing else ""))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self._metrics is not None:
            try:
                self._metrics.close()
            except (
                OSError
            ):  # every line was flushed as written: only a line `step` reported as failed is left
                pass
            self._metrics = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None

    def _print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.progress is not None:
            self.progress.write(text)
        else:
            print(escaped(text), flush=True)
