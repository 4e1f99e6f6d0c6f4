"""Optional experiment trackers: TensorBoard, Weights & Biases, Trackio.

metrics.jsonl in the run directory is always written by the trainer; these
are extra views of the same numbers. A backend is imported only when it is
listed in `logging.report_to`, so an empty list costs nothing:

    trackers = Trackers.from_config(cfg)
    trackers.log({"reward": 0.5, "kl": 0.01}, step=1)
    trackers.close()
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from grpo.config import Config, ConfigError

BACKENDS = ("tensorboard", "wandb", "trackio")
PIP_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "grpo"


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

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.module.log(metrics, step=step)

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

    def close(self) -> None:
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
