"""Process-wide counts of sandbox outcomes, read once per training step (`sandbox/<status>`)."""

from __future__ import annotations

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter[str] = Counter()


def record(status: str) -> None:
    with _lock:
        _counts[status] += 1


def take_counts() -> dict[str, int]:
    """The outcomes since the last call, status -> count; resets them."""
    with _lock:
        taken = dict(_counts)
        _counts.clear()
    return taken
