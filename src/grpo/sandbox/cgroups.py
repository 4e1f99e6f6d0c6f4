"""Hard memory and process-count limits for one sandboxed run, through cgroups (and the
memory limit of a process-isolated tool call: grpo.rollout.tool_memory, without a count).

Resource limits (rlimits) bound each process; a cgroup bounds all the
processes of a run together, whatever they do (a hundred processes of
100 MiB each, memory in a tmpfs). One cgroup per run is made under the
trainer's own cgroup (so a container's own limits still hold above it), the
run's first process enters it before it executes anything, and afterwards
every process still in it is killed and the cgroup removed.

The run cgroups sit in a `grpo-sandbox` cgroup of their own, which every
process in the same cgroup shares (runs of several trainers side by side).
It is made with the first run cgroup in it and removed with the last: a run
that closes its cgroup removes the parent too when it is empty (the kernel
refuses while another run's cgroup is in it), and one that finds the parent
gone between making it and making its own cgroup in it (another's removal)
makes it again. So no cgroup of grpo's is left once no sandboxed program runs.

cgroup v1 (separate `memory` and `pids` hierarchies) and v2 (one unified
hierarchy) are both handled. Where neither is writable (not root, a
read-only /sys/fs/cgroup), `available()` is False and the sandbox relies on
its rlimits and PID namespace alone.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_serial = itertools.count()


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` ("" for v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") or (controller == "" and controllers == ""):
            return path
    return None


def _parents() -> list[Path] | None:
    """The directories under which this process may create run cgroups: [memory, pids]
    for v1, [unified] for v2; None when cgroups cannot be used."""
    if (ROOT / "memory").is_dir() and (ROOT / "pids").is_dir():
        parents = []
        for controller in ("memory", "pids"):
            own = _own_path(controller)
            if own is None:
                return None
            parents.append(ROOT / controller / own.lstrip("/") / "grpo-sandbox")
        return parents
    if (ROOT / "cgroup.controllers").is_file():
        own = _own_path("")
        if own is None:
            return None
        # v2 lets a cgroup that holds processes give its children no controllers;
        # then the probe in available() fails and the sandbox runs without cgroups.
        return [ROOT / own.lstrip("/") / "grpo-sandbox"]
    return None


class RunCgroup:
    """The cgroup(s) of one run: made with limits, entered by the run's first process
    (`enter_paths`: write its pid to each), checked for an OOM kill, then emptied and removed.
    `processes` None: no process-count limit (a forked tool call's: grpo.rollout.tool_memory)."""

    def __init__(self, parents: list[Path], memory: int, processes: int | None):
        name = f"run-{os.getpid()}-{next(_serial)}"
        self.dirs = [p / name for p in parents]
        self.v2 = len(parents) == 1
        made = []
        try:
            for d in self.dirs:
                _make(d)
                made.append(d)
            self._limit(memory, processes)
        except BaseException:
            for d in made:
                _remove(d, parent_too=True)
            raise

    def _limit(self, memory: int, processes: int | None) -> None:
        if self.v2:
            (self.dirs[0] / "memory.max").write_text(str(memory))
            _try_write(self.dirs[0] / "memory.swap.max", "0")
        else:
            (self.dirs[0] / "memory.limit_in_bytes").write_text(str(memory))
            # no escape into swap
            _try_write(self.dirs[0] / "memory.memsw.limit_in_bytes", str(memory))
        if processes is not None:  # a new cgroup's pids.max is "max"
            (self.dirs[-1] / "pids.max").write_text(str(processes))

    @property
    def enter_paths(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this run for exceeding the memory limit."""
        memory_dir = self.dirs[0]
        text = _try_read(memory_dir / ("memory.events" if self.v2 else "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                return True
        return False

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.enter_paths:
            found.update(int(p) for p in _try_read(Path(path)).split())
        return sorted(found)

    def close(self, wait: float = 2.0) -> list[int]:
        """Kill whatever is left in the cgroup and remove it; returns the pids that had to be killed."""
        killed: list[int] = []
        deadline = time.monotonic() + wait
        while True:
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        for d in self.dirs:
            _remove(d, parent_too=True)
        return sorted(set(killed))


def _make(directory: Path, tries: int = 100) -> None:
    """Makes a run's cgroup and, when missing, its parent; again if another run removed the parent
    (its last cgroup closed) between the two, or was removing it as this one made it (mkdir says
    it exists, and by the time Path.mkdir looks it is gone: FileExistsError)."""
    for _ in range(tries):
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(exist_ok=False)
            return
        except (FileNotFoundError, FileExistsError) as error:
            if isinstance(error, FileExistsError) and Path(error.filename) == directory:
                raise  # the run's own name: never another run's
            continue
    directory.mkdir(exist_ok=False)  # raises what it raises


def _remove(directory: Path, parent_too: bool) -> None:
    """Removes an emptied run cgroup, then its `grpo-sandbox` parent if no other run's cgroup is
    in it (rmdir refuses a cgroup with children: another run keeps it)."""
    for _ in range(100):  # rmdir fails while the last killed task is still exiting
        try:
            directory.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.01)
    if parent_too:
        try:
            directory.parent.rmdir()
        except OSError:
            pass  # another run's cgroup is in it (or it is gone already)


_checked: list[Path] | None | bool = False


def available() -> list[Path] | None:
    """The parent directories for run cgroups when this process can create them (checked once)."""
    global _checked
    if _checked is False:
        parents = _parents()
        if parents is not None:
            try:
                probe = RunCgroup(parents, memory=64 << 20, processes=4)
                probe.close()
            except OSError:
                parents = None
        _checked = parents
    return _checked


def _try_write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass  # the controller file is absent on this kernel (e.g. no swap accounting)


def _try_read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
