"""Console progress: tqdm bars for training steps and for evaluation batches, and a
line of headline metrics every `logging.log_every` steps.

The training bar starts at the first training step (after any evaluation
before training), so its rate and the ETA count training steps only.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from grpo.config.safe_yaml import escaped


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _interactive(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def bar(total: int, desc: str, unit: str, stream=None, initial: int = 0) -> tqdm:
    """A tqdm bar on `stream` (stdout); redrawn at most every 10 s when that is not a terminal,
    so a log file gets a few updates rather than one per item."""
    stream = stream or sys.stdout
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        file=stream,
        dynamic_ncols=True,
        smoothing=0,
        mininterval=0.1 if _interactive(stream) else 10.0,
        leave=True,
    )


def metrics_line(step: int, total: int, metrics: dict, eta_s: float) -> str:
    parts = [f"{step}/{total}", f"reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f}"]
    for key, value in metrics.items():
        if key.startswith("rewards/") and key.endswith("/mean"):
            parts.append(f"{key[len('rewards/') : -len('/mean')]} {value:.2f}")
    parts.append(f"len {metrics['completions/mean_length']:.1f}")
    if "kl" in metrics:
        parts.append(f"kl {metrics['kl']:.4f}")
    parts.append(f"{metrics['time/step']:.1f}s/step")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class TrainProgress:
    """The training bar plus a metrics line at the first step, every `every` steps and the last."""

    def __init__(self, total_steps: int, every: int = 1, stream=None, start_step: int = 0):
        self.total, self.every, self.start_step = total_steps, max(1, every), start_step
        self.stream = stream or sys.stdout
        self.bar = bar(total_steps, "train", "step", self.stream, initial=start_step)

    def eta(self, step: int) -> float:
        """Seconds left at the average rate of the steps trained since this bar started."""
        done = step - self.start_step
        elapsed = self.bar.format_dict["elapsed"]
        return elapsed / max(done, 1) * (self.total - step)

    def update(self, step: int, metrics: dict) -> None:
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(f"reward {metrics['reward']:.3f}", refresh=False)
        if step % self.every == 0 or step == self.total or step == self.start_step + 1:
            self.write(metrics_line(step, self.total, metrics, self.eta(step)))

    def write(self, text: str) -> None:
        self.bar.write(escaped(text), file=self.stream)

    def sample(self, completion: str, reward: float | None) -> None:
        text = completion.strip().replace("\n", "\n    ")
        shown = "n/a" if reward is None else f"{reward:.2f}"
        self.write(f"  sample (reward {shown}):\n    {text}")

    def close(self) -> None:
        self.bar.close()
