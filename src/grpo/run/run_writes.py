"""Every file a run writes in its run directory: the names, and the one way they are written.

    RUN_NAMES, is_run_name      the names a run writes in output_dir (besides checkpoint-N/), one
                                list: the writers below take only these, and the claim check
                                (grpo.run.run_lock) keeps a user's files under them from being replaced
    replace_file(dir, name, data)   a whole file: written to a new temporary file beside it, fsynced,
                                and renamed over `name` (os.replace renames over a link, never into
                                what it points to)
    open_append(dir, name)      a log, opened with O_APPEND | O_NOFOLLOW: a regular file or nothing
    make_directory(dir, name)   a directory of the run's own (plots/), created or found as one
    read_own(dir, name)         the bytes of the run's own regular file, or None when it is absent
    remove(dir, name)           a file of the run's own, unlinked (a link there is never followed)
    check_run_names(dir)        at start-up, before anything is written: a link, or a thing of the
                                wrong kind, under a name a run writes is refused

`name` is relative to the run directory ("plots/reward.png"). The run directory itself is opened
as the user named it (output_dir may be a link); every name below it is opened relative to the
directory before it with O_NOFOLLOW, so no link under the run directory is ever followed, and what
a link points to is never written, truncated or created. A link found where the run writes is
refused with `UnsafeRunPath`, a ConfigError naming the path and the fix, except config.yaml: a
link there is the user's config (grpo.run.runlog.resolved_config_path), left as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable, Iterator, TextIO

from grpo.config.errors import ConfigError

CONFIG, RESOLVED_CONFIG = "config.yaml", "config.resolved.yaml"
METRICS, SAMPLES, EVAL = "metrics.jsonl", "samples.jsonl", "eval.jsonl"
REPORT, PLOTS = "report.md", "plots"
LOCK = ".grpo.lock"
FINAL = "final"
TENSORBOARD = "tensorboard"
EVAL_TABLE = "eval_table.md"

FILE, DIRECTORY = "file", "directory"
RUN_NAMES: dict[str, str] = {
    CONFIG: FILE,  # or, beside a config.yaml of the user's, RESOLVED_CONFIG
    RESOLVED_CONFIG: FILE,
    METRICS: FILE,
    SAMPLES: FILE,
    EVAL: FILE,
    REPORT: FILE,
    PLOTS: DIRECTORY,  # <name>.png, .rendering, render.log (grpo.run.report)
    LOCK: FILE,  # grpo.run.run_lock
    FINAL: DIRECTORY,  # grpo.run.checkpoint, as checkpoint-N/ (CHECKPOINT)
    TENSORBOARD: DIRECTORY,  # with logging.report_to: [tensorboard]
    EVAL_TABLE: FILE,  # grpo eval's, beside its eval.jsonl
}
"""Each name a run writes in output_dir, and what it is there."""
CHECKPOINT = re.compile(r"checkpoint-\d+")
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")
"""replace_file's temporary files: .NAME.tmp-PID-RANDOM beside NAME."""


def kind_of(name: str) -> str | None:
    """FILE or DIRECTORY for a name a run writes in output_dir; None for any other name."""
    return DIRECTORY if CHECKPOINT.fullmatch(name) else RUN_NAMES.get(name)


def is_run_name(name: str) -> bool:
    return kind_of(name) is not None


class UnsafeRunPath(ConfigError):
    """A name the run writes is taken by a link, or by a thing of another kind; the message names
    the path and the fix."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def _refusal(path: Path, mode: int, link_target: str | None, want: str) -> UnsafeRunPath | None:
    """Why `path` (mode as lstat gives it) is not the run's own `want`; None when it is."""
    if stat.S_ISLNK(mode):
        return UnsafeRunPath(
            f"{path} is a symbolic link (to {link_target}) where the run writes its own {want}; a run "
            "never writes through a link, so that nothing outside its directory is written over: remove "
            f"the link (`rm {path}` removes the link, not what it points to) and run again"
        )
    wanted = stat.S_ISDIR if want == DIRECTORY else stat.S_ISREG
    if wanted(mode):
        return None
    what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return UnsafeRunPath(
        f"{path} is {what} where the run writes its own {want}; move it out of the run directory "
        "and run again"
    )


def _check(dir_fd: int, name: str, path: Path, want: str) -> bool:
    """Raises UnsafeRunPath unless `name` in `dir_fd` is absent or the run's own `want`, seen
    without following it; whether it exists."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    target = None
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
    refusal = _refusal(path, mode, target, want)
    if refusal is not None:
        raise refusal
    return True


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _parts(name: str) -> tuple[str, ...]:
    parts = PurePosixPath(name).parts
    if not parts or any(p in ("/", ".", "..") for p in parts) or not is_run_name(parts[0]):
        # a writer's name missing from RUN_NAMES would escape the claim check: a bug, found here
        raise ValueError(
            f"{name!r} is not a name a run writes: add it to grpo.run.run_writes.RUN_NAMES"
        )
    return parts


@contextlib.contextmanager
def _directory_of(run_dir: Path, name: str, create: bool) -> Iterator[tuple[int, str]]:
    """(a descriptor of the directory that holds run_dir/name, name's last part): each directory
    on the way opened relative to the one before it, none through a link; created when `create`."""
    parts = _parts(name)
    fd = os.open(run_dir, _DIRECTORY_FLAGS)
    try:
        for depth, part in enumerate(parts[:-1], 1):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            _check(fd, part, run_dir.joinpath(*parts[:depth]), DIRECTORY)
            inner = os.open(part, _DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd, parts[-1]
    finally:
        os.close(fd)


def replace_file(
    run_dir: str | Path, name: str, data: bytes | str | Callable[[BinaryIO], None]
) -> Path:
    """run_dir/name replaced whole by `data` (or what `data(file)` writes): a reader sees the old
    file or the new one, never a part; a link there is refused (UnsafeRunPath), never followed."""
    run_dir = Path(run_dir)
    with _directory_of(run_dir, name, create=True) as (fd, last):
        _check(fd, last, run_dir / name, FILE)
        tmp = f".{last}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(tmp, flags, 0o666, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
            # over the name itself: a link put there since the check is replaced, not followed
            os.replace(tmp, last, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        os.fsync(fd)  # the rename survives a power cut
    return run_dir / name


def open_append(run_dir: str | Path, name: str) -> TextIO:
    """run_dir/name opened to append text (created if absent): a regular file of the run's own,
    never a link's target (O_NOFOLLOW) nor a pipe waited on (O_NONBLOCK)."""
    run_dir = Path(run_dir)
    with _directory_of(run_dir, name, create=True) as (fd, last):
        flags = (
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
        try:
            out = os.open(last, flags, 0o666, dir_fd=fd)
        except OSError:
            _check(fd, last, run_dir / name, FILE)  # a link, a directory, a pipe: said so
            raise
        try:
            _check_regular(out, run_dir / name)
            os.set_blocking(out, True)
        except BaseException:
            os.close(out)
            raise
        return os.fdopen(out, "a", encoding="utf-8")


def _check_regular(fd: int, path: Path) -> None:
    refusal = _refusal(path, os.fstat(fd).st_mode, None, FILE)
    if refusal is not None:
        raise refusal


def read_own(run_dir: str | Path, name: str, limit: int | None = None) -> bytes | None:
    """The bytes of run_dir/name (its first `limit`), a regular file of the run's own; None when
    it is absent. A link or another kind of file there is refused (UnsafeRunPath)."""
    run_dir = Path(run_dir)
    try:
        with _directory_of(run_dir, name, create=False) as (fd, last):
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                source = os.open(last, flags, dir_fd=fd)
            except OSError as error:
                if isinstance(error, FileNotFoundError):
                    return None
                _check(fd, last, run_dir / name, FILE)
                raise
    except FileNotFoundError:  # a directory on the way is absent
        return None
    with os.fdopen(source, "rb") as f:
        _check_regular(f.fileno(), run_dir / name)
        return f.read() if limit is None else f.read(limit)


def make_directory(run_dir: str | Path, name: str) -> Path:
    """run_dir/name as a directory of the run's own: created if absent; a link there refused."""
    run_dir = Path(run_dir)
    with _directory_of(run_dir, name, create=True) as (fd, last):
        with contextlib.suppress(FileExistsError):
            os.mkdir(last, dir_fd=fd)
        _check(fd, last, run_dir / name, DIRECTORY)
    return run_dir / name


def remove(run_dir: str | Path, name: str) -> None:
    """run_dir/name unlinked if it is there (a link there is removed itself, never its target)."""
    run_dir = Path(run_dir)
    try:
        with _directory_of(run_dir, name, create=False) as (fd, last):
            os.unlink(last, dir_fd=fd)
    except FileNotFoundError:
        pass


def check_run_names(run_dir: str | Path, names: tuple[str, ...] | None = None) -> None:
    """Refuses (UnsafeRunPath) a link, or a thing of the wrong kind, under any name a run writes in
    `run_dir` (or under `names`), before anything is written there. config.yaml is passed over:
    one that is not grpo's regular file is the user's config, which a run leaves alone."""
    run_dir = Path(run_dir)
    with os.scandir(run_dir) as entries:
        found = [e.name for e in entries if e.name != CONFIG and is_run_name(e.name)]
    fd = os.open(run_dir, _DIRECTORY_FLAGS)
    try:
        for name in sorted(found):
            if names is None or name in names:
                _check(fd, name, run_dir / name, kind_of(name))
    finally:
        os.close(fd)


def remove_temporaries(run_dir: str | Path) -> None:
    """replace_file's temporary files in run_dir that a killed process left behind (those of a
    process still running are its own)."""
    run_dir = Path(run_dir)
    with os.scandir(run_dir) as entries:
        names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        if match and is_run_name(match["name"]) and not _running(int(match["pid"])):
            with contextlib.suppress(OSError):
                os.unlink(run_dir / name)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        return True
    return True
