"""Optional experiment trackers: TensorBoard, Weights & Biases, Trackio.

metrics.jsonl in the run directory is always written by the trainer; these
are extra views of the same numbers. A backend is imported only when it is
listed in `logging.report_to`, so an empty list costs nothing:

    trackers = Trackers.from_config(cfg)
    trackers.log({"reward": 0.5, "kl": 0.01}, step=1)
    trackers.log_completions([{"step": 1, "prompt": "2+2=", "completion": "4", "reward": 1.0}], step=1)
    trackers.close()

`log_completions` sends the sample completions the run log prints (every
`logging.sample_every` steps) as a table: a `wandb.Table` and a `trackio.Table`
under the key `completions`, and a markdown table in TensorBoard's text tab.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from typing import Any

from grpo.config.errors import ConfigError
from grpo.config.schema import Config

BACKENDS = ("tensorboard", "wandb", "trackio")
PIP_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "grpo"
COMPLETIONS = "completions"
"""The key (wandb, trackio) and tag (TensorBoard) of the sample completions' table."""

log = logging.getLogger(__name__)


def _missing(name: str, error: ImportError) -> ConfigError:
    return ConfigError(
        f"logging.report_to: '{name}' is listed but cannot be imported ({error}); "
        f"install it with `pip install {PIP_PACKAGES[name]}`, or remove '{name}' from logging.report_to"
    )


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries of `metrics` (trackers reject strings and NaN differently)."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def _cell(value: Any) -> Any:
    """A table cell: text and finite numbers as they are, NaN (a missing reward) as None,
    chat messages as their last message's text."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "content" in m for m in value)
    ):
        return str(value[-1]["content"])
    if value is None or isinstance(value, (str, int, float)):
        return value
    return str(value)


def markdown_table(columns: list[str], data: list[list]) -> str:
    """A markdown table (TensorBoard's text tab renders it); a cell's `|` and newlines escaped."""

    def text(value: Any) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            value = f"{value:.4g}"
        return (
            str(value)
            .replace("\\", "\\\\")
            .replace("|", "\\|")
            .replace("\r", "")
            .replace("\n", "<br>")
        )

    lines = ["| " + " | ".join(map(text, columns)) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(text, row)) + " |" for row in data]
    return "\n".join(lines)


class _TensorBoard:
    def __init__(self, log_dir: Path):
        try:
            importlib.import_module("tensorboard")
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard", e) from None
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_table(self, columns: list[str], data: list[list], step: int) -> None:
        self.writer.add_text(COMPLETIONS, markdown_table(columns, data), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _InitLogFinish:
    """wandb and trackio share the same API: init(project, name, config), log(metrics, step), finish()."""

    def __init__(self, name: str, run_name: str | None, config: dict[str, Any]):
        try:
            self.module = importlib.import_module(name)
        except ImportError as e:
            raise _missing(name, e) from None
        self.run = self.module.init(project=PROJECT, name=run_name, config=config)
        self._said_no_table = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.module.log(metrics, step=step)

    def log_table(self, columns: list[str], data: list[list], step: int) -> None:
        table_type = getattr(self.module, "Table", None)
        if table_type is None:
            if not self._said_no_table:
                self._said_no_table = True
                log.warning(
                    "%s %s has no Table type: the sample completions are not sent to it (samples.jsonl has "
                    "them); upgrade it for a completions table",
                    self.module.__name__,
                    getattr(self.module, "__version__", ""),
                )
            return
        if (
            self.module.__name__ == "trackio"
        ):  # trackio's Table takes its column names from a DataFrame only
            import pandas

            table = table_type(dataframe=pandas.DataFrame(data, columns=columns))
        else:
            table = table_type(columns=columns, data=data)
        self.module.log({COMPLETIONS: table}, step=step)

    def close(self) -> None:
        self.module.finish()


class Trackers:
    """The trackers named in `report_to`; with none, every method does nothing."""

    def __init__(
        self,
        report_to: list[str] | tuple[str, ...],
        output_dir: str | Path,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        unknown = [name for name in report_to if name not in BACKENDS]
        if unknown:
            raise ConfigError(
                f"logging.report_to: unknown tracker {unknown[0]!r}; use any of {', '.join(BACKENDS)} (or [] for none)"
            )
        self.output_dir = Path(output_dir)
        self.run_name = run_name or self.output_dir.name
        self.backends: dict[str, Any] = {}
        try:
            for name in dict.fromkeys(report_to):  # each once, in order
                if name == "tensorboard":
                    self.backends[name] = _TensorBoard(self.output_dir / "tensorboard")
                else:
                    self.backends[name] = _InitLogFinish(name, self.run_name, config or {})
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg: Config) -> "Trackers":
        return cls(cfg.logging.report_to, cfg.output_dir, cfg.logging.run_name, cfg.to_dict())

    def __bool__(self) -> bool:
        return bool(self.backends)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.backends:
            return
        numbers = _numbers(metrics)
        for backend in self.backends.values():
            backend.log(numbers, step)

    def log_completions(self, rows: list[dict[str, Any]], step: int) -> None:
        """A table of sample completions: one row per completion, its columns the rows' keys in
        order of first appearance (step, prompt, completion, reward, then each reward function's)."""
        if not self.backends or not rows:
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[_cell(row.get(key)) for key in columns] for row in rows]
        for backend in self.backends.values():
            backend.log_table(columns, data, step)

    def close(self) -> None:
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
