"""Worker processes for reward functions and bounded calls (both sides); the one way a reward is called.

A worker is started as its own program, `python -c <BOOT> FD`, over a socket
pair wrapped in multiprocessing.connection.Connection on both sides. It never
imports the trainer's main script (multiprocessing's spawn would, and a
script that trains at its top level would then train again in every worker):
its first message carries the trainer's sys.path and sys.argv, so the
user's own modules import as they do in the trainer, and names the function
that serves the connection (`serve` below for reward functions,
grpo.rewards.bounded's for bounded calls). A reward function defined in the main
script itself is loaded only from a script whose training is guarded by
`if __name__ == "__main__":` (grpo.rewards.execution decides), by running the
script under the name `__mp_main__`, as multiprocessing's spawn did.

Beside CUDA: a worker is a fresh interpreter, never a fork of the trainer.
subprocess.Popen forks and at once execs Python from C (_posixsubprocess; no
preexec_fn, so no Python runs in between), so the worker holds none of the
trainer's CUDA state, as a spawned process would not, and a reward function
may use CUDA there (in a context of its own). The keeper's fork of the worker
(below) happens in that fresh interpreter, which by then has imported only this
torch-free module.

This module imports nothing heavy, and nothing of grpo but itself, because a
worker imports it first: a worker then starts in a tenth of a second and
without torch's few hundred megabytes (a reward function's own module still
imports what it needs).

A reward worker (`keeper=True`) is two processes: a keeper, which runs no
user code, and under it the worker that calls the functions:

- the keeper leads a session and process group of its own (Ctrl-C at the
  terminal is the trainer's alone) and is a child subreaper, so whatever the
  functions start, double-forked daemons included, stays its descendant; when
  the worker ends, or the trainer goes away (its end of the socket closes),
  the keeper kills every descendant and ends too, with the worker's status;
- the worker's parent is the keeper, not the trainer, and it dies with the
  keeper (PR_SET_PDEATHSIG): `os.kill(os.getppid(), 9)` costs a worker, not
  the run;
- the worker's memory is limited to `memory_mb` MiB (RLIMIT_DATA: the
  memory it writes to, not the address space it reserves, which CUDA and
  some allocators reserve by the terabyte); an allocation past it fails in
  the call that made it (MemoryError), which is an error of that call;
- its stdout and stderr (and its descendants') go to a pipe the trainer reads
  (grpo.rewards.execution caps and escapes what is shown).

`Worker.kill` kills the keeper's descendants and its session (SIGKILL,
repeated until none is left, so a function that keeps forking is caught),
then the keeper. The same helpers (below: the subreaper, the process table,
`children`, `kill_tree`) contain a forked tool call's processes and an
environment's (grpo.rollout.tools, grpo.rollout.environments): one place for
all of grpo's process containment. A reward function runs as the trainer's user, so it can
still find the trainer's pid (in /proc) and signal it, or signal every
process of the user: reward code is trusted code, and model-written code
belongs in grpo.sandbox.

A reward worker loads every function it may be asked for once, at start-up
(the functions come pickled, by reference for a module's function; a module
loaded from a file is loaded again from that file), says "ready" with the
tracebacks of those that failed to load, and then answers one call at a
time until it is told to stop or the trainer goes away.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import pickle
import random
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any, Callable

FLOAT32_MAX = 3.4028234663852886e38
"""Largest float32 (rewards are held as float32): torch.finfo(torch.float32).max, without torch."""

BOOT = "import sys; sys.path.insert(0, sys.argv[2]); from grpo.rewards.worker import main; main(int(sys.argv[1]))"
"""A worker's program: the directory holding grpo comes first until the trainer's sys.path arrives."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


# ---------------------------------------------------------------------- calling a reward


MAX_LOGGED_METRICS = 32
"""Metric names one reward call may log with `log_metric`."""
MAX_EXTRA_COLUMNS = 8
"""Columns one reward call may add to the completions table with `log_extra`."""
MAX_EXTRA_TEXT = 1000
"""Characters kept of a text value given to `log_extra`."""


class RewardLogs:
    """TRL's `log_metric(name, value)` and `log_extra(column, values)` for one call of a reward
    function; what they were given, as plain lists (they pickle back from a worker).

    log_metric: a scalar (a finite real number) under `name`; the step's metric is the mean of
    every value logged under that name in the step. log_extra: one value per completion of the
    call (None, a bool, a real number, or text cut to MAX_EXTRA_TEXT characters), a column of
    the completions table (samples.jsonl). Anything else, or more than MAX_LOGGED_METRICS names
    or MAX_EXTRA_COLUMNS columns, raises ValueError: a failure of the call, like a bad reward."""

    def __init__(self, who: str, n: int):
        self.who, self.n = who, n
        self.metrics: dict[str, list[float]] = {}
        """name -> [sum, count] of the values logged under it: the mean is what is reported,
        so a function that logs in a loop costs no memory per value."""
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_metric's name must be a text, got {_brief(name)}"
            )
        try:
            number = None if isinstance(value, bool) else _real(value)
        except TypeError:
            number = None
        if number is None or not math.isfinite(number):
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_metric({name!r}, {_brief(value)}): the value must be a "
                "finite real number"
            )
        if name not in self.metrics and len(self.metrics) >= MAX_LOGGED_METRICS:
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_metric({name!r}): at most {MAX_LOGGED_METRICS} metric "
                "names per call; log fewer"
            )
        total = self.metrics.setdefault(name, [0.0, 0])
        total[0] += number
        total[1] += 1

    def log_extra(self, column: str, values: list) -> None:
        if not isinstance(column, str) or not column:
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_extra's column must be a text, got {_brief(column)}"
            )
        if column not in self.extra and len(self.extra) >= MAX_EXTRA_COLUMNS:
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_extra({column!r}): at most {MAX_EXTRA_COLUMNS} columns "
                "per call; log fewer"
            )
        if isinstance(values, (str, bytes, Mapping)):
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_extra({column!r}, ...): expected a list of {self.n} "
                f"values, one per completion, got {_brief(values)}"
            )
        got = []
        for v in values:
            got.append(_extra_value(v, self.who, column))
            if len(got) > self.n:
                break
        if len(got) != self.n:
            raise ValueError(
                f"grpo: reward function {self.who!r}: log_extra({column!r}, ...): expected {self.n} values, one "
                f"per completion of the call, got {'more' if len(got) > self.n else len(got)}"
            )
        self.extra[column] = got

    def as_dict(self) -> dict:
        return {"metrics": self.metrics, "extra": self.extra}


def _extra_value(v: Any, who: str, column: str):
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, str):
        return v[:MAX_EXTRA_TEXT]
    try:
        number = _real(v)
    except TypeError:
        raise ValueError(
            f"grpo: reward function {who!r}: log_extra({column!r}, ...): {_brief(v)} is not None, a bool, a "
            "number or a text"
        ) from None
    return number if math.isfinite(number) else None


def _takes_loggers(fn: Callable) -> bool:
    """Whether `fn` takes log_metric and log_extra: it names them or takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params.values()) or {
        "log_metric",
        "log_extra",
    } <= set(params)


def call_reward_logged(fn: Callable, inputs: dict[str, list], n: int) -> tuple[list[float], dict]:
    """`call_reward`, passing the function TRL's `log_metric` and `log_extra` when it takes them;
    its rewards and what it logged (RewardLogs.as_dict)."""
    logs = RewardLogs(getattr(fn, "__name__", type(fn).__name__), n)
    if _takes_loggers(fn):
        inputs = {**inputs, "log_metric": logs.log_metric, "log_extra": logs.log_extra}
    return call_reward(fn, inputs, n), logs.as_dict()


def call_reward(fn: Callable, inputs: dict[str, list], n: int) -> list[float]:
    """fn(**inputs) as n floats, NaN where the function said None; an `async def`
    function is awaited. Raises on a wrong shape, as a failure of the function."""
    values = fn(**inputs)
    if inspect.isawaitable(values):
        import asyncio

        values = asyncio.run(_awaited(values))
    return as_rewards(values, n)


async def _awaited(awaitable):
    return await awaitable


def as_rewards(values: Any, n: int) -> list[float]:
    """The n rewards a function returned, as floats (NaN for None or NaN: missing).

    Accepted: an iterable (a list, a tuple, a generator, a 1-d array or tensor) of exactly n
    items, each None or a real number: int, float, bool (1.0 or 0.0, as torch.tensor takes
    it), a numpy scalar, a 0-d array or tensor of a real dtype. Refused, as an error of the
    call: text (numeric strings included), a mapping, any other item, more or fewer items
    than completions (counted by iterating, at most n + 1 items, whatever `len` says), an
    infinite value or one float32 rounds to infinity.
    """
    if isinstance(
        values, (str, bytes, bytearray, set, frozenset, Mapping)
    ):  # text, no order, or keys
        raise TypeError(f"expected a list of {n} floats or None, got {_brief(values)}")
    try:
        items = iter(values)
    except TypeError:
        raise TypeError(f"expected a list of {n} floats or None, got {_brief(values)}") from None
    got: list = []
    for v in (
        items
    ):  # at most n + 1: a list whose __len__ lies, or an endless generator, is still counted
        got.append(v)
        if len(got) > n:
            break
    if len(got) != n:
        length = f"more than {n}" if len(got) > n else str(len(got))
        raise TypeError(
            f"expected a list of {n} floats or None, got {type(values).__name__} of length {length}"
        )
    rewards = []
    for v in got:
        r = _real(v)
        # NaN is a missing reward, like None; inf, or a value float32 rounds to inf, is a broken
        # function (a failure of this call), never an infinite advantage
        if math.isinf(r) or abs(r) > FLOAT32_MAX:
            raise ValueError(
                f"reward {_brief(v)} is not a finite float32 number; return a finite float, or None when it does not apply"
            )
        rewards.append(r)
    return rewards


def _real(v: Any) -> float:
    """One reward as a float (NaN for None); TypeError unless it is a real number."""
    if v is None:
        return math.nan
    if isinstance(
        v, numbers.Real
    ):  # int, float, bool, Fraction, numpy's integer and floating scalars
        try:
            return float(v)
        except OverflowError:
            return math.inf  # an int too large for a float: refused as not finite
    # arrays and tensors: only 0-d ones of a real dtype (their modules are loaded when such a value exists)
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if (
        numpy is not None
        and isinstance(v, (numpy.ndarray, numpy.generic))
        and v.ndim == 0
        and v.dtype.kind in "biuf"
    ):
        return float(v)  # numpy.bool_ is no numbers.Real, nor is a 0-d array
    if torch is not None and isinstance(v, torch.Tensor) and v.ndim == 0 and not v.is_complex():
        return float(v.item())
    raise TypeError(f"expected float or None, got {_brief(v)}")


def _brief(v: Any) -> str:
    shape = getattr(v, "shape", None)
    # an array's items: not shown
    text = repr(v) if not shape else f"{type(v).__name__} of shape {tuple(shape)}"
    return text if len(text) <= 200 else text[:200] + "..."


# ---------------------------------------------------------------------- seeding a call


def call_seed(batch_seed: int, function: int, start: int) -> int:
    """The seed of one reward call: the batch's seed (grpo.training.state.reward_seed), the
    function's index in the reward set and the first completion of its chunk (-1, 0: the calls in
    the trainer's threads), hashed to 32 bits, the range NumPy takes. Which worker runs the call
    does not enter it, so the same call draws the same numbers whichever worker is free."""
    key = f"{batch_seed}:{function}:{start}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")


def seed_streams(seed: int) -> None:
    """Python's `random` and NumPy's global stream seeded with `seed` (NumPy imported for it when
    installed and not yet imported: a function may import it inside its call)."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is None and importlib.util.find_spec("numpy") is not None:
        try:
            import numpy
        except Exception:  # noqa: BLE001 - e.g. beyond the worker's memory limit: left unseeded
            numpy = None
    if numpy is not None:
        numpy.random.seed(seed)


# ---------------------------------------------------------------------- the worker's side


def main(fd: int) -> None:
    """A worker's program (BOOT): the start message, then the serving function it names."""
    conn = Connection(fd)
    # what a function starts with exec never holds the trainer's connection
    os.set_inheritable(fd, False)
    start = conn.recv()
    sys.path[:] = start["sys_path"]
    sys.argv[:] = start["argv"]
    if start["keeper"]:
        _keep(fd)  # returns in the worker, under the keeper
    else:
        _exit_when_closed(fd)
    if start["memory_mb"]:
        limit_memory(start["memory_mb"] << 20)
    if start["capture"]:
        # a call's prints reach the pipe before the call ends
        sys.stdout.reconfigure(line_buffering=True)
    module, name = start["target"].split(":")
    getattr(importlib.import_module(module), name)(conn, **start["kwargs"])
    _flush_output()


def limit_memory(limit: int) -> None:
    """Limits the memory this process writes to, and each process it starts, to `limit` bytes
    (RLIMIT_DATA: private writable memory, not the address space reserved, which CUDA and some
    allocators reserve by the terabyte); an allocation past it fails in the call that made it
    (MemoryError in Python). A reward worker's limit, and a forked tool call's
    (grpo.rollout.tools)."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def serve(
    conn,
    functions: dict[int, bytes],
    module_files: dict[str, str],
    main_script: tuple[str, str | None] | None,
) -> None:
    """A reward worker's loop: messages (k, inputs, n, seed) -> ("ok", rewards) | ("error",
    traceback); with a seed, Python's and NumPy's global streams are seeded with it before the call
    (`seed_streams`).
    `main_script` (path, module name under -m) is loaded as `__mp_main__` first when a function
    comes from the trainer's main script."""
    module_errors = ""
    if main_script is not None:
        try:
            _load_main(*main_script)
        except BaseException:
            module_errors += f"running the main script {main_script[0]} as __mp_main__:\n{traceback.format_exc()}"
    for name, path in module_files.items():
        try:
            _load_module_file(name, path)
        except BaseException:
            module_errors += f"loading {path}:\n{traceback.format_exc()}"
    loaded, failed = {}, {}
    for k, blob in functions.items():
        try:
            loaded[k] = pickle.loads(blob)
        except BaseException:
            failed[k] = (
                f"cannot be loaded in a worker process:\n{module_errors}{traceback.format_exc()}"
            )
    _flush_output()
    conn.send(("ready", failed))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        k, inputs, n, seed = message
        if k in failed:
            reply = ("error", failed[k])
        else:
            try:
                if seed is not None:
                    seed_streams(seed)
                reply = ("ok", call_reward_logged(loaded[k], inputs, n))
            except (
                BaseException
            ) as e:  # SystemExit too: a sys.exit() is the function's failure, not the worker's end
                reply = ("error", traceback.format_exc() + _memory_limit_note(e))
        _flush_output()
        conn.send(reply)


def _memory_limit_note(error: BaseException) -> str:
    """For a MemoryError, the limit that most likely raised it."""
    if not isinstance(error, MemoryError):
        return ""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit == resource.RLIM_INFINITY:
        return ""
    return f"(this reward worker's memory is limited to {limit >> 20} MiB: rewards.worker_memory_mb, 0 for none)\n"


def _load_main(path: str, name: str | None) -> None:
    """The trainer's main script as `__mp_main__`, standing in for `__main__` (what multiprocessing's
    spawn does), so that functions pickled as `__main__.name` resolve; its guarded part does not run."""
    import runpy
    import types

    if (
        name and name != "__main__" and not name.endswith(".__main__")
    ):  # started as `python -m name`
        namespace = runpy.run_module(name, run_name="__mp_main__", alter_sys=True)
    else:
        namespace = runpy.run_path(path, run_name="__mp_main__")
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _load_module_file(name: str, path: str) -> None:
    """A module that the trainer loaded from a file (`path/to/file.py:function`) and that no import
    finds, loaded from that file under the same name, so the pickled references to it resolve."""
    try:
        if name in sys.modules or importlib.util.find_spec(name) is not None:
            return  # unpickling imports it
    except (ImportError, ValueError):
        pass
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _flush_output() -> None:
    """What a call printed, in the pipe before its reply: Python's buffers and C's stdio."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


def _keep(fd: int) -> None:
    """Forks the worker and returns in it; this process stays the keeper and never returns."""
    set_child_subreaper(True)
    keeper = os.getpid()
    worker = os.fork()
    if worker == 0:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != keeper:  # the keeper died before the line above
            os._exit(1)
        return
    # a signal to the group is for the worker, not its keeper
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def trainer_gone():
        _wait_closed(fd)
        kill_tree(keeper)
        reap_children(1.0)
        os._exit(0)

    threading.Thread(target=trainer_gone, daemon=True).start()
    status = None
    while status is None:
        try:
            pid, code = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == worker:
            status = code
    kill_tree(keeper)  # what the functions left behind: daemons, their own workers
    reap_children(5.0)
    _end_as(status)


def reap_children(seconds: float) -> None:
    """Waits (at most `seconds`) for every child of this process, so that none is left a zombie
    under an init that never reaps. Only for a process that owns no child another part of it
    waits for (a keeper, a forked tool call ending): it takes any child's status."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.005)
        except ChildProcessError:
            return


def _end_as(status: int | None) -> None:
    """Ends the keeper as its worker ended: the same exit code, or the same signal."""
    code = 1 if status is None else os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
            time.sleep(1)
        except (OSError, ValueError):
            pass
        os._exit(128 - code)
    os._exit(code)


def _exit_when_closed(fd: int) -> None:
    """A worker without a keeper ends itself when the trainer's end of the connection closes."""

    def watch():
        _wait_closed(fd)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit with the trainer").start()


def _wait_closed(fd: int) -> None:
    """Returns once the other end of the socket `fd` is closed; reads nothing from it."""
    poller = select.poll()
    poller.register(fd, getattr(select, "POLLRDHUP", 0))  # POLLHUP and POLLERR are always reported
    while True:
        try:
            events = poller.poll()
        except InterruptedError:
            continue
        closed = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)
        if any(e & closed for _, e in events):
            return


def _prctl(option: int, value: int) -> None:
    prctl = _libc_prctl()
    if prctl is not None:
        try:
            prctl(option, value, 0, 0, 0)
        except Exception:
            pass


_prctl_function: list = []
"""The C library's prctl, looked up once (empty until then; [None] where there is none)."""


def _libc_prctl():
    """The C library's prctl (Linux), or None. Looked up once: a process forked from a threaded
    one (a forked tool call) then calls it without dlopen, whose loader lock another thread may
    have held at the fork."""
    if not _prctl_function:
        function = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                function = ctypes.CDLL(None, use_errno=True).prctl
            except Exception:
                function = None
        _prctl_function.append(function)
    return _prctl_function[0]


def can_reap_orphans() -> bool:
    """Whether this system has child subreapers (Linux's prctl PR_SET_CHILD_SUBREAPER); looks up
    prctl now, so that a fork of this process calls it without a lookup."""
    return _libc_prctl() is not None


def set_child_subreaper(on: bool) -> bool:
    """Makes this process a child subreaper (or no longer one): the orphaned descendants of its
    descendants (a double-forked daemon) become its children rather than init's, so that they
    stay findable as its descendants. Whether it took effect; False where there is no prctl."""
    prctl = _libc_prctl()
    if prctl is None:
        return False
    try:
        return prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except Exception:
        return False


def is_child_subreaper() -> bool:
    """Whether this process is a child subreaper (prctl PR_GET_CHILD_SUBREAPER); False where unknown."""
    prctl = _libc_prctl()
    if prctl is None:
        return False
    try:
        import ctypes

        flag = ctypes.c_int(0)
        if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
            return False
        return bool(flag.value)
    except Exception:
        return False


# ---------------------------------------------------------------------- killing process trees


def _processes() -> dict[int, tuple[bytes, int, int, int]]:
    """pid -> (state, parent pid, session id, start time in clock ticks after boot) of every
    process, from /proc (empty without it)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is not None:
            table[int(name)] = stat
    return table


def _stat(pid: int) -> tuple[bytes, int, int, int] | None:
    """(state, parent pid, session id, start time) of one process from /proc/PID/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return fields[0], int(fields[1]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When a living (not zombie) process started, in clock ticks after boot: with its pid, what
    names it (a pid is reused once its process is gone); None if it is gone or a zombie."""
    stat = _stat(pid)
    if stat is None or stat[0] in (b"Z", b"X", b"x"):
        return None
    return stat[3]


def session_of(pid: int) -> int | None:
    """The session id of a process; None if it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def children(pid: int, threads: list[int] | None = None) -> set[int]:
    """The children of process `pid` (of all its threads, or of the threads `threads` only: a
    child is listed under the thread that forked it, or that adopted it), zombies included: from
    /proc/PID/task/TID/children, or a scan of every process where the kernel has no such file."""
    found: set[int] = set()
    if threads is None:
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return found
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            if os.path.exists(f"/proc/{pid}/task/{tid}"):  # no children files in this kernel
                return {p for p, (_, ppid, _, _) in _processes().items() if ppid == pid}
        except OSError:
            pass  # the thread ended while being read
    return found


def descendants(root: int, session: int | None = None) -> list[int]:
    """Living (not zombie) descendants of `root`, and members of session `session`; never this process."""
    table = _processes()
    kids: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, stack = set(), [root]
    while stack:
        for child in kids.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    if session is not None:
        found |= {pid for pid, (_, _, sid, _) in table.items() if sid == session}
    found -= {root, os.getpid()}
    return [pid for pid in found if table[pid][0] not in (b"Z", b"X", b"x")]


def kill_tree(root: int, session: int | None = None, rounds: int = 200) -> None:
    """SIGKILLs the descendants of `root` (not `root`) and the members of `session`, again until none
    is left (what forks between a look and the kill is caught the next round), at most `rounds` times."""
    for i in range(rounds):
        pids = descendants(root, session)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(min(0.001 * i, 0.02))


# ---------------------------------------------------------------------- the trainer's side


class Worker:
    """A worker process started by the trainer: `conn` to talk to it, `output` (a pipe with its
    stdout and stderr) when `capture`, `kill()` to end it and everything it started.

    `target` ("module:function") serves the connection with `kwargs`; `keeper`, `memory_mb` and
    `capture` as the module's docstring says."""

    def __init__(
        self,
        target: str,
        kwargs: dict,
        *,
        keeper: bool = False,
        memory_mb: int = 0,
        capture: bool = False,
    ):
        import subprocess

        import grpo

        if not sys.executable:
            raise RuntimeError(
                "no Python interpreter to start a worker with (sys.executable is empty)"
            )
        ours, theirs = socket.socketpair()
        # -X, -W, -O as the trainer's, as multiprocessing does
        flags = subprocess._args_from_interpreter_flags()
        grpo_parent = os.path.dirname(os.path.dirname(os.path.abspath(grpo.__file__)))
        try:
            self.process = subprocess.Popen(
                [sys.executable, *flags, "-c", BOOT, str(theirs.fileno()), grpo_parent],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if capture else None,
                stderr=subprocess.STDOUT if capture else None,
            )
        finally:
            theirs.close()
        self.pid, self.keeper = self.process.pid, keeper
        self.output = self.process.stdout
        self.conn = Connection(ours.detach())
        start = {
            "sys_path": list(sys.path),
            "argv": list(sys.argv),
            "target": target,
            "kwargs": kwargs,
            "keeper": keeper,
            "memory_mb": memory_mb,
            "capture": capture,
        }
        try:
            self.conn.send(start)
        except OSError:
            pass  # it died at once; the caller finds the connection closed

    def ask_to_stop(self) -> None:
        """Asks the worker to end once it is idle (a None message); `kill(grace)` then waits for it."""
        try:
            self.conn.send(None)
        except OSError:
            pass

    def alive(self) -> bool:
        return not self._ended(0.0)

    def _ended(self, timeout: float) -> bool:
        """Whether the process (the keeper, with one) has ended, waiting up to `timeout` seconds; an
        ended one is left unreaped, so its pid, and its session's id, stay its own until `kill`."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process.returncode is not None:
                return True
            try:
                if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                    return True
            except ChildProcessError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def kill(self, grace: float = 0.0) -> int | None:
        """Kills the worker (after `grace` seconds for it to end by itself), everything it started and
        its session; its exit code (the worker's own, through a keeper: negative for a signal)."""
        ended = self._ended(grace)
        if (
            self.process.returncode is None
        ):  # not reaped: its pid and its session's id are still its own
            if self.keeper and not ended:
                kill_tree(self.pid, session=self.pid)  # the keeper, alive, holds them
                ended = self._ended(2.0)  # the keeper reaps its worker, then ends as it ended
            if not ended:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.process.kill()
                self._ended(10.0)
            # those a killed keeper left behind keep its session
            kill_tree(self.pid, session=self.pid)
        self.process.wait()
        self.conn.close()
        return self.process.returncode
