"""The run directory, the trackers and the console, in one place.

    output_dir/
      config.yaml      the resolved config
      metrics.jsonl    one line per step (every step; TRL's metric names)
      samples.jsonl    a few (prompt, completion, reward) per logged step
      eval.jsonl       one line per evaluation and decoding setting
      checkpoint-N/ final/   written by grpo.checkpoint (atomically)
      plots/ report.md       grpo.report, at the end

The trackers of `logging.report_to` get the same numbers as metrics.jsonl.
Only the main process writes (is_main); the others keep quiet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from grpo import config as config_module
from grpo.config import Config, ConfigError
from grpo.evaluate import EvalResult, append_results, format_table
from grpo.progress import TrainProgress, bar

RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "eval.jsonl")


def check_output_dir(output_dir: Path, overwrite: bool) -> None:
    """Never write over another run's logs unless asked to."""
    if (output_dir / "metrics.jsonl").exists() and not overwrite:
        raise ConfigError(
            f"output_dir: {output_dir} already holds a run (metrics.jsonl); choose another output_dir "
            "or set overwrite_output_dir=true to replace its logs"
        )


def _json_float(value: float) -> float | None:
    """JSON-friendly float: NaN (missing) becomes None."""
    value = float(value)
    return None if math.isnan(value) else value


class RunLog:
    def __init__(self, cfg: Config, is_main: bool = True):
        """Checks the output directory at once (start-up); writes nothing until `start`."""
        self.cfg, self.is_main = cfg, is_main
        self.dir = Path(cfg.output_dir)
        check_output_dir(self.dir, cfg.overwrite_output_dir)
        self.trackers = None
        self.progress: TrainProgress | None = None
        self._metrics = None

    def start(self) -> None:
        """A fresh run directory (overwrite_output_dir was checked at start-up) and the trackers."""
        if not self.is_main:
            return
        from grpo.trackers import Trackers

        self.dir.mkdir(parents=True, exist_ok=True)
        for name in RUN_LOGS:
            (self.dir / name).unlink(missing_ok=True)
        config_module.save(self.cfg, self.dir / "config.yaml")
        self.trackers = Trackers.from_config(self.cfg)
        self._metrics = open(self.dir / "metrics.jsonl", "a")

    def start_training(self, step: int) -> None:
        """The training bar, from `step` (its ETA counts the steps trained from here)."""
        if self.is_main:
            self.progress = TrainProgress(self.cfg.training.max_steps, self.cfg.logging.log_every, start_step=step)

    def step(self, metrics: dict) -> None:
        if not self.is_main:
            return
        self._metrics.write(json.dumps(metrics) + "\n")
        self._metrics.flush()
        self.trackers.log(metrics, metrics["step"])
        self.progress.update(metrics["step"], metrics)

    def samples(self, step: int, prompts: list, texts: list[str], rewards: list[float], group_size: int, per_step: int = 4) -> None:
        """A few (prompt, completion, reward) examples, one per group, to samples.jsonl and the console."""
        if not self.is_main:
            return
        with open(self.dir / "samples.jsonl", "a") as f:
            for i in range(0, min(len(texts), per_step * group_size), group_size):
                prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
                record = {"step": step, "prompt": prompt, "completion": texts[i], "reward": _json_float(rewards[i])}
                f.write(json.dumps(record) + "\n")
        self.progress.sample(texts[0], _json_float(rewards[0]))

    def evaluation(self, label: str, step: int, num_rows: int, num_batches: int,
                   run: Callable[[object], list[EvalResult]]) -> list[EvalResult]:
        """Runs `run(progress)` under an evaluation bar; prints the table, appends eval.jsonl,
        sends each decoding's accuracy to the trackers."""
        if not self.is_main:
            return run(None)
        self._print(f"evaluating ({label}) on {num_rows} held-out problems...")
        with bar(num_batches, f"eval {label}", "batch") as progress:
            results = run(progress)
        self._print(format_table(results))
        append_results(self.dir / "eval.jsonl", results)
        if self.trackers is not None:
            logged = {}
            for r in results:
                logged[f"eval/{r.decoding}/accuracy"] = r.accuracy
                logged[f"eval/{r.decoding}/mean_reward"] = r.mean_reward
            self.trackers.log(logged, step)
        return results

    def before_after(self, before: list[EvalResult], after: list[EvalResult]) -> None:
        self._print("\nheld-out evaluation, before and after training:\n" + format_table(before, after))

    def report(self) -> None:
        if not self.is_main:
            return
        try:
            from grpo.report import build_report

            self._print(f"report: {build_report(self.dir)}")
        except ImportError as err:  # matplotlib is optional
            self._print(f"no report written ({err})")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self._metrics is not None:
            self._metrics.close()
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
            print(text, flush=True)
