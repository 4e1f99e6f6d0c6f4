"""Calling a batch's reward functions: at the same time, each call bounded in time, every failure contained.

Where a function runs:

- in a worker process (a user's function, under `rewards.isolation: process`,
  the default): a call that overruns `rewards.timeout` seconds, or calls
  os._exit, or crashes the interpreter, costs its worker, which is killed
  (with everything it started) and replaced; the trainer goes on.
- in a thread of the trainer process: the built-in rewards and any reward
  object with `runs_in_process = True` (they bound their own work and hold
  state, a model or a sandbox's counts, that must stay in the trainer);
  every function under `rewards.isolation: thread`; and, with a warning, a
  callable a worker cannot load (a lambda, a closure, a bound method of a
  local object, a function of a main script that trains without an
  `if __name__ == "__main__":` guard). A reward with `bounds_itself = True`
  (the code rewards, whose every program the sandbox bounds) is waited for to
  the end. Any other thread cannot be stopped: past the timeout
  its call is abandoned (reported as a timeout, and the function is not
  called again until that call returns), and an os._exit there ends the run.

The workers are `rewards.workers` processes (0: one per core, at most 8),
started with the trainer (`start()`, where a function they cannot load
fails as a ConfigError) or at the first batch, and kept: each loads every
worker-run function once, at start-up, which does not count against the
timeout. A worker is a program of its own (grpo.rewards.worker), not a
multiprocessing child: it never imports the trainer's main script, and it
imports the user's modules through the trainer's sys.path. Being a fresh
interpreter (fork and exec, never a fork that goes on running the trainer's
code), it is safe beside a trainer that initialised CUDA, as spawn is. A function
defined in the main script itself is loaded in the worker by running the
script as `__mp_main__` when the script guards its training with
`if __name__ == "__main__":` (as multiprocessing's spawn did); a script
without the guard would train again in every worker, so its functions run in
threads of the trainer, with a warning. A function may start processes of
its own; `close()`, which the trainer calls at the end of training and which
also runs at interpreter exit, ends them, and a worker whose trainer dies
ends itself.

Each worker is kept apart from the trainer (grpo.rewards.worker says how):
its own session and process group, its descendants (double-forked daemons
included) killed with it, its memory limited to `rewards.worker_memory_mb`
MiB (an allocation past it is an error of the call that made it), its
parent a keeper process rather than the trainer. What the workers print
goes to pipes the trainer reads, never to the console directly: at most
OUTPUT_LIMIT bytes of a batch are kept, shown once in a warning after the
batch with control characters escaped, and the rest is counted as dropped.

A batch's call of a worker-run function is split into contiguous chunks
(workers / functions of them, at least one), each a call with the matching
slice of every argument, so the functions and the chunks run side by side
and a function that fails on some completions loses only their chunks. A
function in a thread gets the whole batch in one call.

State: a worker-run function keeps its module's or its object's state
between calls, but per worker: each worker holds its own copy, a chunk goes
to whichever worker is free, and a replaced worker starts afresh. A
function that needs one state for the whole run belongs in the trainer
(`runs_in_process = True`, and then bounds itself).

Seeds: a batch scored with a seed (grpo.training.state.reward_seed: training.seed, the step,
the prompt order's position, the rank) makes each call draw reproducibly from Python's `random`
and NumPy's global stream. A worker seeds both before each call from the batch's seed, the
function's index and its chunk's first completion (grpo.rewards.worker.call_seed), so which
worker gets a chunk does not matter; the chunks themselves follow `rewards.workers` (0: the
cores), so the same draws need the same number of workers. The functions in threads share the
trainer's streams: they are seeded once per batch before the threads start, so one such function
that draws from them draws the same numbers in every run, while several that draw at the same
time interleave their draws as the threads are scheduled (a function that owns a
`random.Random(seed)`, or runs in a worker, is reproducible whatever runs beside it).

Each call's outcome is a `Call`: "ok" with its rewards, "error" (it raised,
called sys.exit, ran out of its memory, returned anything but one real
number or None per completion, or could not be loaded in the worker),
"crashed" (its worker died under it) or "timeout"; the message of a failure
is its formatted traceback, sent back by the worker.
"""

from __future__ import annotations

import ast
import atexit
import functools
import inspect
import io
import logging
import math
import os
import pickle
import select
import sys
import threading
import time
import traceback
import types
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable

from grpo.config.errors import ConfigError
from grpo.config.safe_yaml import escaped
from grpo.rewards import worker as reward_worker
from grpo.rewards.worker import call_reward_logged

log = logging.getLogger(__name__)

STARTUP_SECONDS = 120.0
"""How long a worker may take to start and load its functions (a module that imports torch takes seconds)."""

OUTPUT_LIMIT = 64 * 1024
"""Bytes of the workers' stdout and stderr shown for a batch, all workers together; the rest is dropped."""


@dataclass
class Call:
    """The outcome of one call, on completions [start, stop)."""

    start: int
    stop: int
    status: str
    """ok, error, crashed or timeout."""
    values: list[float] | None = None
    message: str = ""
    logs: dict | None = None
    """What the call logged (grpo.rewards.worker.RewardLogs.as_dict), when it succeeded."""


IN_PROCESS_INPUTS = ("environments",)
"""Inputs that stay in the trainer's process: the rollouts' environment objects (a function
that names them in its signature runs there)."""


def _names_parameter(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def default_workers() -> int:
    return min(os.cpu_count() or 1, 8)


class RewardExecutor:
    """`executor(inputs, n)` -> per function, the `Call`s that cover its n completions.

    `inputs` are the keyword arguments of a call (prompts, completions,
    completion_ids and the dataset's columns), each a list of n.
    """

    def __init__(
        self,
        names: list[str],
        funcs: list[Callable],
        timeout: float = 60.0,
        workers: int = 0,
        isolation: str = "process",
        memory_mb: int = 4096,
    ):
        self.names, self.funcs, self.timeout = list(names), list(funcs), timeout
        self.size, self.memory_mb = workers or default_workers(), memory_mb
        self._pickled: dict[int, bytes] = {}
        self._module_files: dict[str, str] = {}
        self._main: tuple[str, str | None] | None = None
        for k, (name, fn) in enumerate(zip(self.names, self.funcs)):
            if isolation != "process" or getattr(fn, "runs_in_process", False):
                continue
            if _names_parameter(fn, "environments"):  # the environments live in this process
                continue
            pickled = _pickled_for_worker(fn)
            if pickled is None:
                log.warning(
                    "reward function %r cannot be re-imported by a worker process (a lambda, a closure or a local "
                    "object?), so it runs in a thread of the trainer: a call past rewards.timeout is abandoned, not "
                    "stopped, and an os._exit in it ends the run. Define it at the top level of a module to isolate it.",
                    name,
                )
                continue
            blob, uses_main = pickled
            if uses_main:
                script = _main_script()
                if not _guarded(script[0]):
                    _warn_unguarded(name, script[0])
                    continue
                self._main = script
            self._pickled[k] = blob
            module = sys.modules.get(getattr(fn, "__module__", None) or "")
            if getattr(module, "__file__", None) and module.__name__ != "__main__":
                self._module_files[module.__name__] = module.__file__
        self._workers: list[_Worker] = []
        self._output = _Output()
        self._start_failure = ""
        self._in_call: set[int] = set()
        _open.add(self)

    def in_worker(self, k: int) -> bool:
        return k in self._pickled

    def start(self) -> None:
        """Starts the workers and waits until each has loaded its functions, so that what cannot
        work fails at start-up (ConfigError): a worker that cannot start, a function it cannot load."""
        if not self._pickled:
            return
        while len(self._workers) < min(self.size, len(self._pickled) * self._pieces(self.size)):
            self._workers.append(self._spawn())
        for w in self._workers:
            problem = w.wait_ready()
            if problem:
                self.close()  # what the worker printed (its traceback) is shown
                raise ConfigError(
                    f"the reward worker processes (rewards.isolation=process) did not start: {problem}; see its "
                    "output logged above, or set rewards.isolation=thread"
                )
            for k, message in w.load_failures.items():
                self.close()
                raise ConfigError(
                    f"reward function {self.names[k]!r} {message.rstrip()}\nDefine it at the top level of an "
                    "importable module, or set rewards.isolation=thread"
                )
        self._output.flush()

    def __call__(
        self, inputs: dict[str, list], n: int, seed: int | None = None
    ) -> list[list[Call]]:
        """`seed` (None: none): the batch's seed; each call draws from Python's and NumPy's global
        streams seeded from it (module docstring: Seeds)."""
        in_threads = [k for k in range(len(self.funcs)) if k not in self._pickled]
        if (
            seed is not None and in_threads
        ):  # once, before any of them starts: they share the streams
            reward_worker.seed_streams(reward_worker.call_seed(seed, -1, 0))
        threads = {k: self._start_thread(k, inputs, n) for k in in_threads}
        calls = self._run_in_workers(inputs, n, seed)
        for k, finish in threads.items():
            calls[k] = [finish()]
        self._output.flush()  # what the batch's calls printed, once
        return [calls[k] for k in range(len(self.funcs))]

    # ------------------------------------------------------------------ threads

    def _start_thread(self, k: int, inputs: dict[str, list], n: int) -> Callable[[], Call]:
        """Starts the call; returns the wait for its outcome, bounded by the timeout from now."""
        if k in self._in_call:
            skipped = Call(
                0,
                n,
                "timeout",
                message=(
                    f"its call of an earlier batch overran {self.timeout:g} s and has not returned; not called again until it has"
                ),
            )
            return lambda: skipped
        fn = self.funcs[k]
        # A reward that bounds each of its items (the code rewards: each program by the sandbox's
        # timeout) always returns; a batch-wide limit would only throw its finished work away.
        deadline = (
            math.inf if getattr(fn, "bounds_itself", False) else time.monotonic() + self.timeout
        )
        # functions running side by side share no list (trainer_state, one object, is not a list)
        inputs = {
            key: list(values) if isinstance(values, list) else values
            for key, values in inputs.items()
        }
        outcome: list[Call] = []
        done = threading.Event()

        def run():
            try:
                values, logs = call_reward_logged(fn, inputs, n)
                outcome.append(Call(0, n, "ok", values, logs=logs))
            except (
                BaseException
            ):  # SystemExit too: sys.exit() in a thread is the function's failure
                outcome.append(Call(0, n, "error", message=traceback.format_exc()))
            finally:
                self._in_call.discard(k)
                done.set()

        self._in_call.add(k)
        threading.Thread(target=run, daemon=True, name=f"reward {self.names[k]}").start()

        def finish() -> Call:
            if done.wait(None if deadline == math.inf else max(0.0, deadline - time.monotonic())):
                return outcome[0]
            return Call(
                0,
                n,
                "timeout",
                message=(
                    f"no result within rewards.timeout={self.timeout:g} s; the call goes on in its thread, abandoned"
                ),
            )

        return finish

    # ------------------------------------------------------------------ worker processes

    def _run_in_workers(
        self, inputs: dict[str, list], n: int, seed: int | None = None
    ) -> dict[int, list[Call]]:
        ks = list(self._pickled)
        calls: dict[int, list[Call]] = {k: [] for k in ks}
        if not ks or n == 0:
            return calls
        pieces = self._pieces(n)
        bounds = [(n * i // pieces, n * (i + 1) // pieces) for i in range(pieces)]
        pending = deque((k, a, b) for a, b in bounds for k in ks)
        while len(self._workers) < min(self.size, len(pending)):
            self._workers.append(self._spawn())
        while pending or any(w.task for w in self._workers):
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    self._send(w, pending, inputs, seed)
            waiting = [w for w in self._workers if w.task or not w.ready]
            if not waiting:  # every worker failed to start
                for k, a, b in pending:
                    calls[k].append(Call(a, b, "error", message=self._start_failure))
                break
            wait(
                [w.conn for w in waiting],
                max(0.0, min(w.deadline for w in waiting) - time.monotonic()),
            )
            for w in waiting:
                self._collect(w, calls)
        return calls

    def _pieces(self, n: int) -> int:
        """Chunks a function's batch of n is split into: the workers shared between the functions."""
        return max(1, min(n, self.size // len(self._pickled)))

    def _spawn(self) -> "_Worker":
        return _Worker(self._pickled, self._module_files, self._main, self.memory_mb, self._output)

    def _send(
        self, w: "_Worker", pending: deque, inputs: dict[str, list], seed: int | None = None
    ) -> None:
        k, a, b = task = pending.popleft()
        try:
            w.conn.send(
                (
                    k,
                    {
                        key: values[a:b] if isinstance(values, list) else values
                        for key, values in inputs.items()
                        if key not in IN_PROCESS_INPUTS
                    },
                    b - a,
                    None if seed is None else reward_worker.call_seed(seed, k, a),
                )
            )
        except OSError:  # it died while idle (killed from outside): not this chunk's fault
            pending.appendleft(task)
            self._replace(w)
            return
        w.task, w.deadline = task, time.monotonic() + self.timeout

    def _collect(self, w: "_Worker", calls: dict[int, list[Call]]) -> None:
        if w.conn.poll():
            try:
                status, value = w.conn.recv()
            except (EOFError, OSError):
                self._lost(w, calls, "crashed", "the worker process died")
                return
            if status == "ready":
                # a function that failed to load fails each call
                w.ready, w.load_failures = True, value
                return
            k, a, b = w.task
            calls[k].append(
                Call(a, b, "ok", value[0], logs=value[1])
                if status == "ok"
                else Call(a, b, "error", message=value)
            )
            w.task = None
        elif time.monotonic() >= w.deadline:
            if w.task:
                self._lost(
                    w, calls, "timeout", f"no result within rewards.timeout={self.timeout:g} s"
                )
            else:
                self._lost(w, calls, "error", f"not ready within {STARTUP_SECONDS:g} s")

    def _lost(self, w: "_Worker", calls: dict[int, list[Call]], status: str, reason: str) -> None:
        """Kills `w`; the chunk it was computing gets `status`. A worker lost at start-up is not replaced
        (it would most likely fail again); the next batch tries anew."""
        code = w.kill()
        if status == "crashed":
            reason += f" (exit code {code})"
        if w.task:
            k, a, b = w.task
            calls[k].append(
                Call(
                    a,
                    b,
                    status,
                    message=f"{reason} on completions {a}..{b - 1}; its worker was killed and replaced",
                )
            )
            self._replace(w, kill=False)
        else:
            self._workers.remove(w)
            self._start_failure = f"the reward worker process did not start: {reason}"

    def _replace(self, w: "_Worker", kill: bool = True) -> None:
        if kill:
            w.kill()
        self._workers[self._workers.index(w)] = self._spawn()

    def close(self) -> None:
        """Ends the workers; a later call starts new ones."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.ask_to_stop()
        deadline = time.monotonic() + 1.0  # all of them end at once, within a second
        for w in workers:
            w.kill(max(0.0, deadline - time.monotonic()))
        self._output.flush()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Worker:
    """One worker process and its end of the connection; `task` is the chunk it is computing."""

    def __init__(
        self,
        functions: dict[int, bytes],
        module_files: dict[str, str],
        main_script: tuple[str, str | None] | None,
        memory_mb: int,
        output: "_Output",
    ):
        self.process = reward_worker.Worker(
            "grpo.rewards.worker:serve",
            {"functions": functions, "module_files": module_files, "main_script": main_script},
            keeper=True,
            memory_mb=memory_mb,
            capture=True,
        )
        self.conn = self.process.conn
        output.add(self.process.output, f"reward worker process {self.process.pid}")
        self.ready, self.task = False, None
        self.load_failures: dict[int, str] = {}
        self.deadline = time.monotonic() + STARTUP_SECONDS

    def wait_ready(self) -> str:
        """Waits until the worker has started; "" then, else what went wrong."""
        if not self.ready:
            try:
                if not self.conn.poll(max(0.0, self.deadline - time.monotonic())):
                    return f"not ready within {STARTUP_SECONDS:g} s"
                _, self.load_failures = self.conn.recv()
            except (EOFError, OSError):
                return f"a worker process died (exit code {self.kill()})"
            self.ready = True
        return ""

    def kill(self, grace: float = 0.0) -> int | None:
        """Kills the worker and what it started (after `grace` seconds to end by itself); its exit code."""
        return self.process.kill(grace)

    def ask_to_stop(self) -> None:
        if self.ready and self.task is None:
            self.process.ask_to_stop()


class _Output:
    """The workers' stdout and stderr: each pipe read as it fills (a worker never blocks on a full pipe),
    at most `limit` bytes kept until `flush` shows them, escaped, the rest counted as dropped."""

    def __init__(self, limit: int = OUTPUT_LIMIT):
        self.limit = limit
        self._lock = threading.Lock()
        self._pipes: dict[int, tuple[object, str]] = {}
        self._kept: dict[str, bytearray] = {}
        self._dropped: Counter = Counter()
        self._size = 0

    def add(self, pipe, label: str) -> None:
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        with self._lock:
            self._pipes[fd] = (pipe, label)
        threading.Thread(
            target=self._follow, args=(fd, pipe), daemon=True, name=f"output of {label}"
        ).start()

    def _follow(self, fd: int, pipe) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            try:
                poller.poll()
            except InterruptedError:
                continue
            with self._lock:
                if not self._read(
                    fd, 1
                ):  # every writer has closed it: the worker and all it started are gone
                    del self._pipes[fd]
                    pipe.close()  # only here, so no other thread reads a reused descriptor number
                    return

    def _read(self, fd: int, chunks: int) -> bool:
        """Takes what the pipe holds now, at most `chunks` reads of it (the lock is held: a writer that
        never stops must not keep it); False at its end."""
        label = self._pipes[fd][1]
        for _ in range(chunks):
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            room = max(0, self.limit - self._size)
            if room:
                self._kept.setdefault(label, bytearray()).extend(data[:room])
                self._size += min(room, len(data))
            if len(data) > room:
                self._dropped[label] += len(data) - room
        return True

    def flush(self) -> None:
        """Logs what the workers printed since the last flush, once; a call's output is in its pipe
        before its result is sent, so a batch's output is all here at the batch's end."""
        with self._lock:
            for fd in list(self._pipes):
                self._read(fd, 16)  # a pipe holds 64 KiB unless a writer enlarged it
            kept, dropped = self._kept, self._dropped
            self._kept, self._dropped, self._size = {}, Counter(), 0
        if not kept and not dropped:
            return
        parts = []
        for label in dict.fromkeys([*kept, *dropped]):
            text = escaped(bytes(kept.get(label, b"")).decode("utf-8", "backslashreplace")).rstrip(
                "\n"
            )
            more = f"\n(... {dropped[label]} bytes more dropped)" if dropped[label] else ""
            parts.append(f"--- {label} ---\n{text}{more}")
        log.warning(
            "reward functions printed (control characters escaped; at most %d KiB of a batch shown):\n%s",
            self.limit // 1024,
            "\n".join(parts),
        )


def _pickled_for_worker(fn: Callable) -> tuple[bytes, bool] | None:
    """`fn` as a worker can load it, and whether that needs the main script; None where it cannot."""
    if getattr(fn, "__module__", None) == "__main__" and not getattr(
        sys.modules["__main__"], "__file__", None
    ):
        return None  # defined interactively: no file a worker could load it from
    buffer = io.BytesIO()
    pickler = _MainNoting(buffer)
    try:
        pickler.dump(fn)
    except Exception:  # pickle's errors for lambdas and local objects vary (PicklingError, AttributeError, TypeError)
        return None
    return buffer.getvalue(), pickler.uses_main


class _MainNoting(pickle.Pickler):
    """A pickler that notes whether what it pickles refers to a function or class of `__main__`."""

    uses_main = False

    def reducer_override(self, obj):
        if (
            isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) == "__main__"
        ):
            self.uses_main = True
        return NotImplemented


def _main_script() -> tuple[str, str | None]:
    """The main script's path, and its module name when it was started as `python -m name`."""
    main = sys.modules["__main__"]
    return os.path.abspath(main.__file__), getattr(getattr(main, "__spec__", None), "name", None)


@functools.lru_cache(maxsize=None)
def _guarded(path: str) -> bool:
    """Whether the script at `path` has a top-level `if __name__ == "__main__":` (read, not run)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            sides = [test.left, test.comparators[0]]
            if any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
                isinstance(s, ast.Constant) and s.value == "__main__" for s in sides
            ):
                return True
    return False


_warned_unguarded: set[tuple[str, str]] = set()


def _warn_unguarded(name: str, path: str) -> None:
    if (name, path) in _warned_unguarded:
        return
    _warned_unguarded.add((name, path))
    log.warning(
        'reward function %r is defined in the main script %s, which has no `if __name__ == "__main__":`: '
        "a worker process could load it only by running the whole script again, training included, so it "
        "runs in a thread of the trainer (a call past rewards.timeout is abandoned, not stopped, and an "
        'os._exit in it ends the run). Put the script\'s training under `if __name__ == "__main__":`, or '
        "the function in a module of its own, to run it in a worker process.",
        name,
        path,
    )


_open: "weakref.WeakSet[RewardExecutor]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for executor in list(_open):
        executor.close()
