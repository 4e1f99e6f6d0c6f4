"""Calls bounded in time: a function run in a worker process that is killed when a call overruns.

A Python call cannot be interrupted from another thread, and signal-based
timeouts (SIGALRM) work only in the main thread. So a computation that may
not return (sympy on an adversarial expression, say) runs in a worker
process: the caller waits at most `timeout` seconds for each answer, and on
overrun kills the worker and starts a new one for the next call. The worker
imports its function once and serves calls until closed; starting it (and
importing the function's module) is waited for separately, with `startup`
seconds, so a slow import does not count as a timed-out call.

The worker is a program of its own (grpo.rewards.worker.Worker), not a
multiprocessing child: it never imports the caller's main script, so a
script that trains at its top level (no `if __name__ == "__main__":`) is not
run again by it. It leads a session of its own (a Ctrl-C at the terminal is
the caller's), and ends itself when its caller goes away. Being a fresh
interpreter, as with multiprocessing's spawn, it holds none of the caller's CUDA
state and is safe to start after the caller initialised CUDA.

    worker = BoundedWorker("grpo.rewards.equivalence:equivalent", timeout=5.0)
    status, value = worker("\\\\frac{1}{2}", "0.5")      # ("ok", True)
"""

from __future__ import annotations

import importlib
from typing import Any

from grpo.rewards.worker import Worker


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
        self._process: Worker | None = None
        self._conn = None

    def _start(self) -> None:
        self._process = Worker("grpo.rewards.bounded:_serve", {"target": self.target})
        self._conn = self._process.conn
        try:
            ready = self._conn.poll(self.startup) and self._conn.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = self._process.kill()
            self._process = self._conn = None
            raise RuntimeError(
                f"the worker for {self.target} did not start within {self.startup:.0f} s (exit code {code})"
            )

    def __call__(self, *args: Any) -> tuple[str, Any]:
        if self._process is not None and not self._process.alive():
            self.close()  # died between calls
        if self._process is None:
            self._start()
        try:
            self._conn.send(args)
            if self._conn.poll(self.timeout):
                return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            return ("crashed", None)
        self.close()  # overran: kill it; the next call starts a fresh worker
        return ("timeout", None)

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
        self._process = self._conn = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
