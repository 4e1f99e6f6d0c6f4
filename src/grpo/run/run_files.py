"""Reading a run directory's files back, for the report and `grpo doctor`: what a run wrote is read
back as untrusted input (a directory may come from anywhere: a file in it may be a link to a FIFO,
a device, a file under /proc or on a mount that hangs), bounded, and refused with a `RunFileError`
naming the file (and line).

    chunks(path, limit)        a regular file's bytes, opened without blocking, read in time
    json_lines(path, strict)   its complete lines as JSON values, streamed (a generator)
    iter_jsonl(path)           the object rows of a .jsonl, streamed
    read_metrics(run_dir)      metrics.jsonl: per step, the numbers the checks and the report read
    read_config(run_dir)       the run's config as a dict (config.resolved.yaml first)

Every file goes through one reader: it is refused unless it is a regular file (stat before the
open, so a device is never opened; fstat of the descriptor after, so what was opened is what was
checked), opened with O_NONBLOCK (a FIFO put there between the two never blocks the open), read
in chunks by a thread the caller waits on for at most MAX_WAIT_SECONDS in all (a read that never
returns, as on a hung network mount, is given up on: the thread is left to the read and ends
with the process), and refused past its byte limit as it is read (a file under /proc says 0
bytes and reads more). Lines are split as the bytes arrive, so memory holds one read's lines
(CHUNK_BYTES of text) and at most one longer line (MAX_LINE_BYTES), never the file; numbers are
range-checked as they are parsed (MAX_INTEGER, MAX_MAGNITUDE).
"""

from __future__ import annotations

import json
import math
import os
import queue
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

MAX_LOG_BYTES = 256 * 2**20
"""The largest log file read back: a step's metrics row is a few KB, so a quarter of a GiB is
a hundred thousand steps and more; a larger file is refused as soon as that much is read."""

MAX_LINE_BYTES = 4 * 2**20
"""The longest line read back: a metrics row with 4,000 reward functions' mean and std is
0.2 MiB; what a line's JSON becomes in memory while it is parsed is bounded by this."""

MAX_WAIT_SECONDS = 60.0
"""How long a reader waits, in all, for a file's bytes (the time spent parsing them not counted)."""

MAX_INTEGER = 2**63 - 1
"""The largest whole number read (a step, a count: grpo writes 64-bit ones); a longer one is not
a number a run writes, and would overflow a float where the checks compute with it."""

MAX_MAGNITUDE = 1e300
"""The largest magnitude a fractional number keeps: one beyond it reads as infinite (as one
beyond a float's range, 1.8e308, does anyway), so that sums over a run's steps (the report's
times, the checks' counts) and the plots' axes stay finite; the checks and plots pass over
infinite values as they pass over NaN."""

CHUNK_BYTES = 2**16
"""What each read asks for: a read's lines are split at once, so this bounds what they hold
(3M rows of `{}` read with 1 MiB reads grew the process by 57 MB, with 64 KiB by 4 MB)."""

KEPT_TIMES = frozenset({"time/step", "time/generate", "time/wait_for_rollout"})
"""The phase times the report and the health checks' replay read (the other time/* and health/*
are passed over when kept)."""


class RunFileError(ValueError):
    """A run directory's file that cannot be read back; the message names it and what to do."""


class _NotANumber(ValueError):
    """A number in a line outside what a run writes (raised by the JSON parser's hooks)."""


# ------------------------------------------------------------------ bytes


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


def _not_regular(path: Path, mode: int) -> RunFileError:
    return RunFileError(
        f"{path} is not a regular file ({_kind(mode)}); a run writes its logs and config as "
        "files: pass a run's own output_dir, or put the file itself where the link is"
    )


def _read_chunk(fd: int) -> bytes:
    return os.read(fd, CHUNK_BYTES)


def _producer(path: Path, limit: int, chunks: queue.Queue, stop: threading.Event) -> None:
    """The reading thread: stat, open without blocking, fstat, read; every outcome goes to
    `chunks` as ("data", bytes), ("end", None) or ("error", exception)."""

    def put(item: tuple[str, Any]) -> None:
        while not stop.is_set():
            try:
                chunks.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    try:
        if not stat.S_ISREG(mode := os.stat(path).st_mode):  # a device is refused unopened
            put(("error", _not_regular(path, mode)))
            return
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        put(("error", error))
        return
    try:
        info = os.fstat(fd)  # what was opened, whatever the path names now
        if not stat.S_ISREG(info.st_mode):
            put(("error", _not_regular(path, info.st_mode)))
            return
        if info.st_size > limit:
            put(("error", _too_large(path, info.st_size, limit)))
            return
        total = 0
        while not stop.is_set():
            chunk = _read_chunk(fd)
            if not chunk:
                put(("end", None))
                return
            total += len(chunk)
            if total > limit:  # a file under /proc says 0 bytes
                put(("error", _too_large(path, total, limit, as_read=True)))
                return
            put(("data", chunk))
    except OSError as error:
        put(("error", error))
    finally:
        os.close(fd)


def _too_large(path: Path, size: int, limit: int, as_read: bool = False) -> RunFileError:
    said = "more than" if as_read else f"{size:,} bytes, more than"
    return RunFileError(
        f"{path}: {said} the {limit:,} read back; it is not a file grpo wrote at this size "
        "(pass a run's own output_dir)"
    )


def _oserror(path: Path, error: OSError) -> RunFileError:
    if isinstance(error, FileNotFoundError):
        if os.path.islink(path):
            return RunFileError(f"{path} is a link to {os.readlink(path)}, which does not exist")
        return RunFileError(f"{path} does not exist")
    return RunFileError(
        f"{path} cannot be read ({error.strerror or error}); copy the run's logs to a readable "
        "regular file, or pass a run's own output_dir"
    )


def chunks(path: str | Path, limit: int | None = None) -> Iterator[bytes]:
    """A regular file's bytes in chunks, as the module says: RunFileError when it does not exist,
    is not a regular file, cannot be read, is larger than `limit`, or keeps the reader waiting
    MAX_WAIT_SECONDS in all; `limit`: MAX_LOG_BYTES unless given."""
    path, limit = Path(path), MAX_LOG_BYTES if limit is None else limit
    items: queue.Queue = queue.Queue(maxsize=4)
    stop = threading.Event()
    thread = threading.Thread(
        target=_producer,
        args=(path, limit, items, stop),
        name=f"grpo read {path.name}",
        daemon=True,
    )
    thread.start()
    waited = 0.0
    try:
        while True:
            started = time.monotonic()
            try:
                kind, value = items.get(timeout=max(0.0, MAX_WAIT_SECONDS - waited))
            except queue.Empty:
                raise RunFileError(
                    f"{path}: its bytes did not come within {MAX_WAIT_SECONDS:g} s (a hung network "
                    "mount?); copy the run's logs to a local disk"
                ) from None
            waited += time.monotonic() - started
            if kind == "end":
                return
            if kind == "error":
                raise value if isinstance(value, RunFileError) else _oserror(path, value)
            yield value
    finally:
        stop.set()  # the thread stops at its next chunk (or is left in a read that never returns)


def file_bytes(path: str | Path, limit: int) -> bytes:
    """A small regular file's bytes, read as `chunks` reads them."""
    return b"".join(chunks(path, limit))


def exists(path: Path) -> bool:
    """Whether `path` names anything, a dangling link included (what a reader then refuses
    says why: an optional file that is there is read, never passed over as absent)."""
    return os.path.lexists(path)


# ------------------------------------------------------------------ lines and JSON


def _whole(text: str) -> int:
    digits = len(text) - (text[0] == "-")
    if digits > len(str(MAX_INTEGER)) or abs(value := int(text)) > MAX_INTEGER:
        raise _NotANumber(
            f"an integer of {digits:,} digits, beyond the {MAX_INTEGER:,} a run writes"
        )
    return value


def _real(text: str) -> float:
    value = float(text)
    return value if abs(value) <= MAX_MAGNITUDE else math.copysign(math.inf, value)


# NaN and ±Infinity are what Python's JSON writes for a metric that is missing or not finite:
# read as floats, which the checks and the plots pass over.
_DECODER = json.JSONDecoder(parse_int=_whole, parse_float=_real)


_SCAN = _DECODER.scan_once
_BLANK = object()


def _line_blocks(path: Path, limit: int | None) -> Iterator[list[str | None]]:
    """The newline-terminated lines each read completes, as text (bytes that are not UTF-8
    replaced), a list per read; None for a line longer than MAX_LINE_BYTES (its bytes are
    dropped as they come). A last line without its newline (a running run's, being written) is
    not a line yet. Decoding and splitting a read's lines at once keeps a line's cost in C."""
    pending, too_long = bytearray(), False
    for chunk in chunks(path, limit):
        cut = chunk.rfind(b"\n")
        if cut == -1:  # the line goes on
            if not too_long:
                pending += chunk
                if len(pending) > MAX_LINE_BYTES:
                    pending, too_long = bytearray(), True
            continue
        if too_long:
            first = chunk.find(b"\n")
            rest = (
                chunk[first + 1 : cut].decode("utf-8", "replace").split("\n") if first < cut else []
            )
            lines: list[str | None] = [None, *rest]
        else:
            pending += chunk[:cut]  # the first line's length is checked as each line's is
            lines = pending.decode("utf-8", "replace").split("\n")
        pending, too_long = bytearray(chunk[cut + 1 :]), False
        yield lines


def _value(line: str) -> Any:
    """A line's JSON value (_BLANK for a blank line): the C scanner on the line as it is, the
    full decoder (surrounding whitespace, the error's words) only when that does not take it all."""
    try:
        value, end = _SCAN(line, 0)
        if end == len(line):
            return value
    except StopIteration:
        pass
    if not line.strip():
        return _BLANK
    return _DECODER.decode(line)


def json_lines(
    path: str | Path, strict: bool = True, limit: int | None = None
) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of each non-blank complete line, streamed. `strict`: a line that
    is not JSON, is longer than MAX_LINE_BYTES or holds a number out of range is a RunFileError
    naming the file and line; otherwise such a line is passed over."""
    path, number = Path(path), 0
    for lines in _line_blocks(path, limit):
        for line in lines:
            number += 1
            if line is None or len(line) > MAX_LINE_BYTES:
                if strict:
                    raise RunFileError(
                        f"{path}:{number}: a line longer than the {MAX_LINE_BYTES:,} bytes read "
                        "back; it is not a log grpo wrote"
                    )
                continue
            try:
                value = _value(line)
            except _NotANumber as e:
                if strict:
                    raise RunFileError(
                        f"{path}:{number}: {e}; it is not a log grpo wrote"
                    ) from None
                continue
            except (ValueError, RecursionError) as e:
                if strict:
                    why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
                    raise RunFileError(f"{path}:{number}: not valid JSON ({why})") from None
                continue
            if value is not _BLANK:
                yield number, value


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) of each JSON object line of a .jsonl (other JSON values passed over),
    strictly: a line that is not JSON is a RunFileError naming it."""
    for number, value in json_lines(path):
        if isinstance(value, dict):
            yield number, value


# ------------------------------------------------------------------ metrics.jsonl


def _step(value: Any) -> bool:
    return type(value) is int and value >= 0


def kept_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """What is kept of a metrics row: its numbers and nulls (a bool, text, list or object is
    passed over), less health/* (the replay computes them again) and the phase times but
    KEPT_TIMES. Names are interned: a run's rows share one copy of each."""
    kept = {}
    for key, value in row.items():
        if value is None or type(value) in (int, float):
            if key.startswith("health/") or (key.startswith("time/") and key not in KEPT_TIMES):
                continue
            kept[sys.intern(key)] = value
    return kept


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Per-step metrics sorted by step, streamed from metrics.jsonl keeping only `kept_metrics`
    of each row; a step logged twice (a resumed run) keeps its last record; a row without a step
    (grpo writes one in every row) is passed over."""
    path = Path(run_dir) / "metrics.jsonl"
    if not exists(path):
        raise RunFileError(
            f"{path} does not exist: the run has logged no step yet (metrics.jsonl is what `grpo train` "
            "writes into its output_dir); pass the run directory (output_dir), not a checkpoint or config path"
        )
    by_step: dict[int, dict[str, Any]] = {}
    rows = 0
    for number, row in iter_jsonl(path):
        rows += 1
        if "step" not in row:
            continue
        step = row["step"]
        if not _step(step):
            raise RunFileError(
                f"{path}: row {number}'s step is {json.dumps(step)[:40]}, not a step number; "
                "it is not a metrics.jsonl grpo wrote"
            )
        by_step.pop(step, None)  # the last record of a step, in file order
        by_step[step] = kept_metrics(row)
    if not by_step and rows:
        raise RunFileError(
            f"{path}: none of its {rows:,} rows has a step (grpo writes one in every row); it is "
            "not a metrics.jsonl grpo wrote"
        )
    if not by_step:
        raise RunFileError(
            f"{path} is empty: no training step has been logged yet; run `grpo train` first"
        )
    return [by_step[s] for s in sorted(by_step)]


# ------------------------------------------------------------------ the config


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's config as written (config.resolved.yaml: the run's own, beside a config.yaml of
    the user's, grpo.run.runlog), read as every run file is (RunFileError when it is there but
    cannot be read) and parsed by the bounded YAML parser; {} when absent, or when it is not
    YAML or not a mapping (the checks then take their defaults)."""
    from grpo.config import safe_yaml
    from grpo.config.errors import ConfigError

    run_dir = Path(run_dir)
    path = run_dir / "config.resolved.yaml"
    if not exists(path):
        path = run_dir / "config.yaml"
    if not exists(path):
        return {}
    data = file_bytes(path, safe_yaml.MAX_BYTES)
    try:
        parsed = safe_yaml.parse(data.decode("utf-8", errors="replace"), str(path))
    except ConfigError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
