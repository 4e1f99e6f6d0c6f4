"""What a sandboxed program may use. Every limit has a default that suits a test-case run."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    timeout: float = 10.0
    """Wall-clock seconds, enforced by the parent (the program is killed, status `timeout`)."""
    cpu_seconds: int | None = None
    """CPU seconds (RLIMIT_CPU); None = the wall-clock timeout rounded up, plus one."""
    memory: int = 512 * MiB
    """Bytes: the address-space limit of each process, and the cgroup's hard limit for all of them."""
    processes: int = 32
    """Processes and threads the program may have at once (RLIMIT_NPROC per sandbox uid; the pids cgroup)."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    file_size: int = 16 * MiB
    """The largest file the program may write (RLIMIT_FSIZE)."""
    disk: int = 64 * MiB
    """Size of the private writable /tmp (its working directory), a tmpfs; counted as memory too."""
    output: int = 1 * MiB
    """Bytes of stdout and of stderr kept; a program that writes more is stopped (status `output_limit`)."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "cpu_seconds":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(
                    f"sandbox limit {f.name} must be a finite number > 0, got {value!r}"
                )

    @property
    def cpu_limit(self) -> int:
        return self.cpu_seconds if self.cpu_seconds is not None else math.ceil(self.timeout) + 1

    def with_overrides(self, **overrides) -> "Limits":
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(
                f"unknown sandbox limit(s) {sorted(unknown)}; known: {[f.name for f in fields(self)]}"
            )
        return replace(self, **overrides)
