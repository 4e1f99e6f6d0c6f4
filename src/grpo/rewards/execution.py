"""Calling a batch's reward functions: at the same time, each call bounded in time, every failure contained.

Where a function runs:

- in a worker process (a user's function, under `rewards.isolation: process`,
  the default): a call that overruns `rewards.timeout` seconds, or calls
  os._exit, or crashes the interpreter, costs its worker, which is killed
  (with its process group, so the function's own subprocesses go too) and
  replaced; the trainer goes on.
- in a thread of the trainer process: the built-in rewards and any reward
  object with `runs_in_process = True` (they bound their own work and hold
  state, a model or a sandbox's counts, that must stay in the trainer);
  every function under `rewards.isolation: thread`; and, with a warning, a
  callable a spawned worker cannot re-import (a lambda, a closure, a bound
  method of a local object). A reward with `bounds_itself = True` (the code
  rewards, whose every program the sandbox bounds) is waited for to the end.
  Any other thread cannot be stopped: past the timeout
  its call is abandoned (reported as a timeout, and the function is not
  called again until that call returns), and an os._exit there ends the run.

The workers are `rewards.workers` spawned processes (0: one per core, at most
8), started with the trainer (`start()`, where a function they cannot load
fails as a ConfigError) or at the first batch, and kept: each loads every
worker-run function once, at start-up, which does not count against the
timeout. Being spawned, a worker imports the main script: a script that
trains must do so under `if __name__ == "__main__":`. They are not daemonic,
so a function may start processes of its own; `close()`, which the trainer
calls at the end of training and which also runs at interpreter exit, ends
them, and a worker whose trainer dies ends itself.

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

Each call's outcome is a `Call`: "ok" with its rewards, "error" (it raised,
called sys.exit, returned the wrong shape, or could not be loaded in the
worker), "crashed" (its worker died under it) or "timeout"; the message of a
failure is its formatted traceback, sent back by the worker.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401 (its exit handler, which joins child processes, must run after ours)
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable

from grpo import reward_worker
from grpo.config import ConfigError
from grpo.reward_worker import call_reward

log = logging.getLogger(__name__)

STARTUP_SECONDS = 120.0
"""How long a worker may take to start and load its functions (a module that imports torch takes seconds)."""


@dataclass
class Call:
    """The outcome of one call, on completions [start, stop)."""

    start: int
    stop: int
    status: str
    """ok, error, crashed or timeout."""
    values: list[float] | None = None
    message: str = ""


def default_workers() -> int:
    return min(os.cpu_count() or 1, 8)


class RewardExecutor:
    """`executor(inputs, n)` -> per function, the `Call`s that cover its n completions.

    `inputs` are the keyword arguments of a call (prompts, completions,
    completion_ids and the dataset's columns), each a list of n.
    """

    def __init__(self, names: list[str], funcs: list[Callable], timeout: float = 60.0, workers: int = 0,
                 isolation: str = "process"):
        self.names, self.funcs, self.timeout = list(names), list(funcs), timeout
        self.size = workers or default_workers()
        self._pickled: dict[int, bytes] = {}
        self._module_files: dict[str, str] = {}
        for k, (name, fn) in enumerate(zip(self.names, self.funcs)):
            if isolation != "process" or getattr(fn, "runs_in_process", False):
                continue
            blob = _pickled_for_worker(fn)
            if blob is None:
                log.warning(
                    "reward function %r cannot be re-imported by a worker process (a lambda, a closure or a local "
                    "object?), so it runs in a thread of the trainer: a call past rewards.timeout is abandoned, not "
                    "stopped, and an os._exit in it ends the run. Define it at the top level of a module to isolate it.",
                    name,
                )
                continue
            self._pickled[k] = blob
            module = sys.modules.get(getattr(fn, "__module__", None) or "")
            if getattr(module, "__file__", None) and module.__name__ != "__main__":
                self._module_files[module.__name__] = module.__file__
        self._context = multiprocessing.get_context("spawn")  # no copy of the trainer's threads, tensors or locks
        self._workers: list[_Worker] = []
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
                self.close()
                raise ConfigError(
                    f"the reward worker processes (rewards.isolation=process) did not start: {problem}. A script "
                    "that starts training must do so under `if __name__ == \"__main__\":`, since a spawned worker "
                    "imports the script; or set rewards.isolation=thread"
                )
            for k, message in w.load_failures.items():
                self.close()
                raise ConfigError(
                    f"reward function {self.names[k]!r} {message.rstrip()}\nDefine it at the top level of an "
                    "importable module, or set rewards.isolation=thread"
                )

    def __call__(self, inputs: dict[str, list], n: int) -> list[list[Call]]:
        threads = {k: self._start_thread(k, inputs, n) for k in range(len(self.funcs)) if k not in self._pickled}
        calls = self._run_in_workers(inputs, n)
        for k, finish in threads.items():
            calls[k] = [finish()]
        return [calls[k] for k in range(len(self.funcs))]

    # ------------------------------------------------------------------ threads

    def _start_thread(self, k: int, inputs: dict[str, list], n: int) -> Callable[[], Call]:
        """Starts the call; returns the wait for its outcome, bounded by the timeout from now."""
        if k in self._in_call:
            skipped = Call(0, n, "timeout", message=(
                f"its call of an earlier batch overran {self.timeout:g} s and has not returned; not called again until it has"
            ))
            return lambda: skipped
        fn = self.funcs[k]
        # A reward that bounds each of its items (the code rewards: each program by the sandbox's
        # timeout) always returns; a batch-wide limit would only throw its finished work away.
        deadline = math.inf if getattr(fn, "bounds_itself", False) else time.monotonic() + self.timeout
        # functions running side by side share no list (trainer_state, one object, is not a list)
        inputs = {key: list(values) if isinstance(values, list) else values for key, values in inputs.items()}
        outcome: list[Call] = []
        done = threading.Event()

        def run():
            try:
                outcome.append(Call(0, n, "ok", call_reward(fn, inputs, n)))
            except BaseException:  # SystemExit too: sys.exit() in a thread is the function's failure
                outcome.append(Call(0, n, "error", message=traceback.format_exc()))
            finally:
                self._in_call.discard(k)
                done.set()

        self._in_call.add(k)
        threading.Thread(target=run, daemon=True, name=f"reward {self.names[k]}").start()

        def finish() -> Call:
            if done.wait(None if deadline == math.inf else max(0.0, deadline - time.monotonic())):
                return outcome[0]
            return Call(0, n, "timeout", message=(
                f"no result within rewards.timeout={self.timeout:g} s; the call goes on in its thread, abandoned"
            ))

        return finish

    # ------------------------------------------------------------------ worker processes

    def _run_in_workers(self, inputs: dict[str, list], n: int) -> dict[int, list[Call]]:
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
                    self._send(w, pending, inputs)
            waiting = [w for w in self._workers if w.task or not w.ready]
            if not waiting:  # every worker failed to start
                for k, a, b in pending:
                    calls[k].append(Call(a, b, "error", message=self._start_failure))
                break
            wait([w.conn for w in waiting], max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
            for w in waiting:
                self._collect(w, calls)
        return calls

    def _pieces(self, n: int) -> int:
        """Chunks a function's batch of n is split into: the workers shared between the functions."""
        return max(1, min(n, self.size // len(self._pickled)))

    def _spawn(self) -> "_Worker":
        return _Worker(self._context, self._pickled, self._module_files)

    def _send(self, w: "_Worker", pending: deque, inputs: dict[str, list]) -> None:
        k, a, b = task = pending.popleft()
        try:
            w.conn.send((k, {key: values[a:b] if isinstance(values, list) else values for key, values in inputs.items()}, b - a))
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
                w.ready, w.load_failures = True, value  # a function that failed to load fails each call
                return
            k, a, b = w.task
            calls[k].append(Call(a, b, "ok", value) if status == "ok" else Call(a, b, "error", message=value))
            w.task = None
        elif time.monotonic() >= w.deadline:
            if w.task:
                self._lost(w, calls, "timeout", f"no result within rewards.timeout={self.timeout:g} s")
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
            calls[k].append(Call(a, b, status, message=f"{reason} on completions {a}..{b - 1}; its worker was killed and replaced"))
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
        for w in self._workers:
            w.stop()
        self._workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Worker:
    """One worker process and its end of the pipe; `task` is the chunk it is computing."""

    def __init__(self, context, functions: dict[int, bytes], module_files: dict[str, str]):
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=reward_worker.serve, args=(child, functions, module_files), name="grpo reward worker", daemon=False
        )
        self.process.start()
        child.close()
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

    def kill(self) -> int | None:
        """Kills the worker and what it started; its exit code."""
        if self.ready and hasattr(os, "killpg"):  # only once ready is it surely the leader of its own group
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
        self.process.kill()
        self.process.join(5)
        self.conn.close()
        return self.process.exitcode

    def stop(self) -> None:
        if self.ready and self.task is None:
            try:
                self.conn.send(None)
                self.process.join(1)
            except OSError:
                pass
        self.kill()


def _pickled_for_worker(fn: Callable) -> bytes | None:
    """`fn` as a spawned worker can load it, or None where it cannot."""
    if getattr(fn, "__module__", None) == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        return None  # defined interactively: a spawned worker has no such __main__
    try:
        return pickle.dumps(fn)
    except Exception:  # pickle's errors for lambdas and local objects vary (PicklingError, AttributeError, TypeError)
        return None


_open: "weakref.WeakSet[RewardExecutor]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for executor in list(_open):
        executor.close()
