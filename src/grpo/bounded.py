"""Calls bounded in time: a function run in a worker process that is killed when a call overruns.

A Python call cannot be interrupted from another thread, and signal-based
timeouts (SIGALRM) work only in the main thread. So a computation that may
not return (sympy on an adversarial expression, say) runs in a worker
process: the caller waits at most `timeout` seconds for each answer, and on
overrun kills the worker and starts a new one for the next call. The worker
imports its function once and serves calls until closed; starting it (and
importing the function's module) is waited for separately, with `startup`
seconds, so a slow import does not count as a timed-out call.

    worker = BoundedWorker("grpo.equivalence:equivalent", timeout=5.0)
    status, value = worker("\\\\frac{1}{2}", "0.5")      # ("ok", True)
"""

from __future__ import annotations

import importlib
import multiprocessing
from typing import Any


def _serve(conn, target: str) -> None:
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    conn.send("ready")
    while True:
        args = conn.recv()
        if args is None:
            return
        try:
            conn.send(("ok", fn(*args)))
        except Exception as e:  # the function's own failure, reported, not fatal
            conn.send(("error", f"{type(e).__name__}: {e}"))


class BoundedWorker:
    """`worker(*args)` -> (status, value): ("ok", result), ("error", message),
    ("timeout", None) or ("crashed", None). Arguments and results must pickle."""

    def __init__(self, target: str, timeout: float, startup: float = 120.0):
        self.target, self.timeout, self.startup = target, timeout, startup
        self._context = multiprocessing.get_context("spawn")  # no copy of the caller's threads or tensors
        self._process = None
        self._conn = None

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self.target), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(self.startup) or parent.recv() != "ready":
            self.close()
            raise RuntimeError(f"the worker for {self.target} did not start within {self.startup:.0f} s")

    def __call__(self, *args: Any) -> tuple[str, Any]:
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._conn.send(args)
            if self._conn.poll(self.timeout):
                return self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.close()
            return ("crashed", None)
        self.close()  # overran: kill it; the next call starts a fresh worker
        return ("timeout", None)

    def close(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
