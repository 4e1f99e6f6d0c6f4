"""One run per output_dir: the directory is created, checked writable and locked at start-up.

    output_dir/.grpo.lock   flock(LOCK_EX) held by the training process (rank 0 under
                            torchrun: the other ranks write nothing) from start-up to the
                            end of the run; it holds that process's PID and host, for the
                            message another run gets

A second `grpo train` on the directory (a fresh run, a `--resume`, an
`overwrite_output_dir=true`) is refused while the lock is held, before it reads or
changes anything there, naming the process that holds it (`--resume` alone is refused
before it chooses a checkpoint: `check_not_in_use`). The operating system drops
the lock when its process ends, however it ends: a SIGKILLed run leaves the file, never
a stale lock, and its directory resumes as it is. The file itself is never deleted while
a run may hold it (a run that locked a deleted file and one that locked its replacement
would both go on); only a failed start removes the directory it created, lock file
included, and a start that finds its locked file gone takes the new one instead.

The lock file is opened with O_NOFOLLOW: a link planted in its place is refused, naming it,
never followed (its target would be truncated). Before the claim, `check_claimable` refuses a
link under any name a run writes (grpo.run.run_writes).

Within one process the trainers of one directory share its lock (a GRPOTrainer replaces
its trainer by one that resumes); a forked child does not share its parent's claim: a
claim there is refused while the parent holds the directory.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from grpo.config.errors import ConfigError
from grpo.run import run_writes

LOCK = run_writes.LOCK


@dataclass
class _Held:
    fd: int
    pid: int
    """The process that took it: a forked child holds nothing of its parent's."""
    created: list[Path] = field(default_factory=list)
    """Directories this claim created (the output_dir first), removed again by a failed start."""
    users: int = 0


_held: dict[Path, _Held] = {}


class RunLock:
    """This process's claim on a run directory; `release` (or garbage collection) gives it up,
    `abandon` also removes what a failed start created (the directory, when nothing else is in it)."""

    def __init__(self, directory: Path, key: Path):
        self.directory, self._key = directory, key
        _held[key].users += 1
        self._finalizer = weakref.finalize(self, _let_go, key, False)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()

    def abandon(self) -> None:
        """After a failed start: released, and the directories the claim created removed if they
        hold nothing but the lock file (a start that failed leaves nothing behind)."""
        if self._finalizer.detach() is not None:
            _let_go(self._key, True)


def _let_go(key: Path, abandoned: bool) -> None:
    held = _held.get(key)
    if held is None or held.pid != os.getpid():
        return
    held.users -= 1
    if held.users > 0:
        return
    del _held[key]
    if abandoned and held.created:
        # unlinked while still locked: a run that opened the old file is refused, one that comes
        # after creates a new file (and takes it: see `claim`'s check that the file is still there)
        try:
            if not [p for p in held.created[0].iterdir() if p.name != LOCK]:
                (held.created[0] / LOCK).unlink(missing_ok=True)
                for directory in held.created:
                    directory.rmdir()
        except OSError:
            pass  # something else is in it now: it stays
    os.close(held.fd)


_KEPT_FOR_RUNS = frozenset(run_writes.RUN_NAMES) - {run_writes.CONFIG, LOCK}
"""The names a run writes in output_dir (grpo.run.run_writes, the list its writers take their
names from), less the two a user's folder may hold: config.yaml (left alone when grpo did not
write it: grpo.run.runlog.resolved_config_path) and the lock (which makes the folder a run)."""
_CHECKPOINT = run_writes.CHECKPOINT
_SHOWN = 5
"""Entries of a directory named in a refusal (then how many more)."""


def is_a_run(directory: Path) -> bool:
    """Whether `directory` holds a grpo run: its lock file (every run writes it at start-up and no
    run removes it) or a checkpoint (a manifest in checkpoint-N/ or final/)."""
    if (directory / LOCK).exists() or (directory / "final" / "manifest.json").is_file():
        return True
    with os.scandir(directory) as entries:
        return any(
            _CHECKPOINT.fullmatch(e.name) and (directory / e.name / "manifest.json").is_file()
            for e in entries
        )


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_claimable(output_dir: str | Path, overwrite: bool) -> None:
    """Refuses an output_dir that holds something other than a grpo run, before anything is
    written there: absent, empty and a run are fine; anything else (a home directory, a folder of
    the user's files, the folder of the config itself) only with `overwrite`, and then only when
    none of the names a run writes is taken, so that no file grpo did not write is replaced. In
    any directory, a link under a name a run writes is refused (run_writes.check_run_names)."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return
    if not is_a_run(directory):
        _check_not_a_run(directory, overwrite)
    run_writes.check_run_names(directory)


def _check_not_a_run(directory: Path, overwrite: bool) -> None:
    with os.scandir(directory) as entries:
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in entries)
    if not names:
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir: {directory} is not empty and holds no grpo run ({_listed(names)}); choose a "
            "new or empty directory, or set overwrite_output_dir=true to write the run's files beside "
            "these (none of them is changed)"
        )
    taken = [
        n for n in names if n.rstrip("/") in _KEPT_FOR_RUNS or _CHECKPOINT.fullmatch(n.rstrip("/"))
    ]
    if taken:
        raise ConfigError(
            f"output_dir: {directory} holds {_listed(taken)}, which grpo did not write, under names a run "
            "writes: overwrite_output_dir replaces only a grpo run's own files; move them, or choose "
            "another output_dir"
        )


def claim(output_dir: str | Path) -> RunLock:
    """`output_dir` created if missing, checked writable and locked for this process; a
    ConfigError naming the fix when it cannot be written, or naming the process holding it."""
    directory = Path(output_dir)  # as RunLog and the checkpoints use it
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            f"output_dir: {directory} is a file, not a directory; set output_dir to a directory path"
        )
    for _ in range(5):  # again only when a failed start removed the file just locked
        created = _make_directory(directory)
        key = directory.resolve()
        held = _held.get(key)
        if held is not None and held.pid == os.getpid():
            return RunLock(directory, key)
        _check_writable(directory)
        path = directory / LOCK
        try:
            fd = _open_lock(directory)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise _unwritable(directory, e) from e
        try:
            _lock(fd, fcntl.LOCK_EX)
        except OSError as e:
            os.close(fd)
            if e.errno not in _HELD:
                raise _unwritable(directory, e) from e
            raise ConfigError(_in_use(directory, path)) from None
        try:
            if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                raise FileNotFoundError(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        _held[key] = _Held(fd, os.getpid(), created)
        return RunLock(directory, key)
    raise ConfigError(
        f"output_dir: {directory} keeps disappearing while this run starts; choose another output_dir"
    )


_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


def _open_lock(directory: Path) -> int:
    """The lock file, opened (created if absent) for reading and writing as a regular file of the
    run's own: a link there is refused, never followed (its target would be truncated)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(directory / LOCK, flags, 0o644)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            run_writes.check_run_names(directory, (LOCK,))  # says what is there
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        run_writes.check_run_names(directory, (LOCK,))
        raise OSError(errno.EINVAL, "not a regular file", str(directory / LOCK))
    os.set_blocking(fd, True)
    return fd


def _lock(fd: int, kind: int) -> None:
    """flock without waiting for a run to end, but past another start's `check_not_in_use`, which
    holds a shared lock for an instant: a run's lock is still held when a few tries have failed."""
    for wait in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, None):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in _HELD or wait is None:
                raise
            time.sleep(wait)


def check_not_in_use(directory: str | Path) -> None:
    """A ConfigError naming the process when another process's run holds `directory`; reads and
    changes nothing there (for choosing the checkpoint to resume from before the run starts)."""
    directory = Path(directory)
    held = _held.get(directory.resolve()) if directory.exists() else None
    if held is not None and held.pid == os.getpid():
        return
    path = directory / LOCK
    try:  # never through a link, nor waiting on a pipe
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or none to read): no run has claimed it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _HELD:
            raise ConfigError(_in_use(directory, path)) from None
    finally:
        os.close(fd)  # and with it the shared lock


def _make_directory(directory: Path) -> list[Path]:
    """Creates `directory` and its missing parents; those it created, the deepest first."""
    missing = []
    path = directory
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(directory, e) from e
    return missing


def _check_writable(directory: Path) -> None:
    """Writing a file there, now, is the only sure test (permissions, a read-only mount, quotas)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".grpo-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise _unwritable(directory, e) from e


def _unwritable(directory: Path, error: OSError) -> ConfigError:
    return ConfigError(
        f"output_dir: cannot write to {directory} ({error.strerror or error}); set output_dir to a directory "
        "this user can create and write, e.g. output_dir=runs/NAME"
    )


def _in_use(directory: Path, path: Path) -> str:
    try:  # the lock file of a run that holds it: one short line, read without following a link
        text = (run_writes.read_own(directory, LOCK, 300) or b"").decode("utf-8", "replace")
        pid, _, host = text.strip().partition(" ")
    except (OSError, run_writes.UnsafeRunPath):
        pid, host = "", ""
    who = f"process {pid}" if pid else "another process"
    if host and host != socket.gethostname():
        who += f" on {host}"
    stop = (
        f" (`kill {pid}` stops it with a checkpoint)"
        if pid and not (host and host != socket.gethostname())
        else ""
    )
    return (
        f"output_dir: {directory} is in use by another grpo run, {who}, which holds {path}; two runs in one "
        f"directory would overwrite each other's checkpoints and logs: wait for it to end{stop} and then "
        "resume with --resume, or choose another output_dir"
    )
