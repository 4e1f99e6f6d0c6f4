"""Fault injection for the resume tests: SIGKILL this process at a named point.

    GRPO_KILL_AT=save:3     killed the 3rd time the trainer reaches the point "save"

The points (`reached(name)` calls) are where a crash is hardest to recover from:
"step" (mid-step, after generation), "logged" (a step's metrics written, its
checkpoint not yet), "save" (a checkpoint's files half written), "manifest"
(its manifest written, not yet renamed into place); generating ahead of
training, "ahead" (a batch being generated ahead) and "push" (the server given
the weights of a step while the next one runs, the trainer not yet told).
Unset, `reached` costs a dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_counts: Counter = Counter()


def reached(point: str) -> None:
    spec = os.environ.get("GRPO_KILL_AT")
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _counts[point] += 1
    if _counts[point] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
