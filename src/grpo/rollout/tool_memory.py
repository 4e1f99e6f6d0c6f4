"""The memory limit of a process-isolated tool call, rollout.tool_memory_mb (N below):
grpo.rollout.tools forks the call's process from the trainer, and it shares the trainer's
pages until it writes to them.

Two limits are set in the call's process before the tool runs:

- a cgroup of its own (grpo.sandbox.cgroups), made by the trainer right before the fork and
  entered by the call's process before the tool runs: its memory limit, N MiB, counts every
  page a process of the call writes from then on, whatever the trainer's heap holds: its
  allocations, the copy-on-write copies of pages it shares with the trainer, files it writes
  to a tmpfs (pages charged before it entered stay the trainer's). At the limit the kernel
  kills the process of the call that holds the most (an OOM kill in the cgroup);
  `CallMemory.finish` says so, so that the call's result names the limit, then kills whatever
  of the call is left in the cgroup and removes it. Made where grpo.sandbox.cgroups.available()
  as root, the code sandbox's own condition; swap is kept out where the kernel accounts it.
- RLIMIT_DATA (grpo.rewards.worker.limit_memory) at the data size the process shares with the
  trainer when it forks plus N MiB: an allocation that grows its data past that fails in the
  tool (MemoryError, which the tool may catch), where the cgroup's limit is not reached first.

Without a cgroup (not root, no writable hierarchy) only the second holds, and it bounds how far
the call's data size grows, not the memory it writes: what the trainer freed and its allocator
still maps (glibc's heap, Python's arenas; malloc_trim gives the pages back but keeps them
mapped) is reused by the call without growing it, so in a long-lived trainer a call may write
more than N MiB. Neither holds against a tool written to escape it: a tool that runs as root
may raise its own rlimit or write its cgroup's limit.
"""

from __future__ import annotations

import os
import resource  # imported before any fork: the call's process limits its memory with it
from dataclasses import dataclass

from grpo.rewards.worker import limit_memory
from grpo.sandbox import cgroups


def cgroups_usable() -> bool:
    """Whether a forked call's memory is limited by a cgroup here (checked once per process)."""
    return os.geteuid() == 0 and cgroups.available() is not None


@dataclass
class CallMemory:
    """The memory limit of one forked call: `prepare` in the trainer before the fork, `enter` in
    the call's process, `finish` in the trainer once that process has been reaped."""

    mb: int
    cgroup: cgroups.RunCgroup | None

    @classmethod
    def prepare(cls, mb: int) -> "CallMemory":
        """The limit of a call that may write `mb` MiB, with a cgroup where one can be made (an
        OSError where cgroups are usable and this one cannot be)."""
        cgroup = None
        if cgroups_usable():
            cgroup = cgroups.RunCgroup(cgroups.available(), memory=mb << 20, processes=None)
        return cls(mb, cgroup)

    def enter(self) -> None:
        """In the call's process, before the tool runs: into its cgroup, then its RLIMIT_DATA.
        OSError when it cannot enter the cgroup (the call must not run then)."""
        if self.cgroup is not None:
            pid = str(os.getpid()).encode()
            for path in self.cgroup.enter_paths:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)
        _limit_data(self.mb)

    def finish(self) -> bool:
        """In the trainer, once the call's process has been reaped: whether the kernel killed a
        process of the call at the limit. What is left in the cgroup is killed and it is removed."""
        if self.cgroup is None:
            return False
        try:
            return self.cgroup.oom_killed()
        finally:
            self.cgroup.close()

    def error_text(self, killed: bool, detail: str = "") -> str:
        """The call's result when it went past the limit: killed by the kernel (the cgroup), or
        an allocation refused (RLIMIT_DATA's MemoryError, `detail` its text)."""
        if killed:
            what = f"{self.mb} MiB of memory written (rollout.tool_memory_mb); the kernel ended it"
        else:
            what = f"{self.mb} MiB beyond what it shares with the trainer (rollout.tool_memory_mb)"
        return f"error: MemoryError: the call went past its memory limit, {what} {detail}".rstrip()


def _limit_data(mb: int) -> None:
    """RLIMIT_DATA at the data this process holds now, the trainer's as the fork copied it, plus
    `mb` MiB. Left as it is where /proc cannot say that size, or a lower limit is already set."""
    held = _data_bytes()
    if held is None:
        return
    limit = held + (mb << 20)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY and hard < limit:
        return
    limit_memory(limit)


def _data_bytes() -> int | None:
    """This process's data size (VmData in /proc/self/status: what RLIMIT_DATA counts), or None."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmData:"):
                    return int(line.split()[1]) << 10  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None
