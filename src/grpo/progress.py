"""Console progress: one line per logged step with the headline metrics and an ETA."""

from __future__ import annotations

import sys
import time


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ConsoleProgress:
    def __init__(self, total_steps: int, every: int = 1, stream=None, width: int = 20):
        self.total, self.every, self.width = total_steps, max(1, every), width
        self.stream = stream or sys.stdout
        self.start = time.perf_counter()
        self.first_step: int | None = None

    def line(self, step: int, metrics: dict) -> str:
        if self.first_step is None:
            self.first_step = step - 1
        elapsed = time.perf_counter() - self.start
        done = step - self.first_step
        eta = elapsed / max(done, 1) * (self.total - step)
        filled = int(self.width * step / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        parts = [f"[{bar}] {step}/{self.total}", f"reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f}"]
        for key, value in metrics.items():
            if key.startswith("rewards/") and key.endswith("/mean"):
                parts.append(f"{key[len('rewards/'):-len('/mean')]} {value:.2f}")
        parts.append(f"len {metrics['completions/mean_length']:.1f}")
        if "kl" in metrics:
            parts.append(f"kl {metrics['kl']:.4f}")
        parts.append(f"{metrics['time/step']:.1f}s/step")
        parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: dict) -> None:
        if step % self.every == 0 or step == self.total or step == 1:
            print(self.line(step, metrics), file=self.stream, flush=True)

    def sample(self, completion: str, reward: float) -> None:
        text = completion.strip().replace("\n", "\n    ")
        print(f"  sample (reward {reward:.2f}):\n    {text}", file=self.stream, flush=True)
