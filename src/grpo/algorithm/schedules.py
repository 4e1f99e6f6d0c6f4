"""Learning-rate schedules."""

from __future__ import annotations

import math


def lr_multiplier(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """Learning-rate factor at optimizer step `step` (0-based): linear warm-up
    over `warmup_steps`, then "constant", "linear" decay to 0 (TRL's default)
    or "cosine" decay to 0 at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(max((step - warmup_steps) / max(1, total_steps - warmup_steps), 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr schedule must be constant, linear or cosine, got {schedule!r}")
