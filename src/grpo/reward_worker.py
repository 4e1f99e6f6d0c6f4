"""The worker process side of grpo.rewards.execution, and the one way a reward function is called.

This module lives outside the grpo.rewards package and imports nothing heavy
because a spawned worker imports it first: a worker then starts in a tenth
of a second and without torch's few hundred megabytes (a reward function's
own module still imports what it needs).

A worker loads every function it may be asked for once, at start-up (the
functions come pickled, by reference for a module's function; a module
loaded from a file is loaded again from that file), says "ready" with the
tracebacks of those that failed to load, and then answers one call at a
time until it is told to stop or its parent goes away.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import pickle
import sys
import threading
import traceback
from typing import Any, Callable


FLOAT32_MAX = 3.4028234663852886e38
"""Largest float32 (rewards are held as float32): torch.finfo(torch.float32).max, without torch."""


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
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
        raise TypeError(f"expected a list of {n} floats or None, got {got}")
    rewards = []
    for v in values:
        if v is None:
            rewards.append(math.nan)
        else:
            try:
                r = float(v)
            except (TypeError, ValueError, OverflowError):
                raise TypeError(f"expected float or None, got {v!r}") from None
            # NaN is a missing reward, like None; inf, or a value float32 rounds to inf, is a broken
            # function (a failure of this call), never an infinite advantage
            if math.isinf(r) or abs(r) > FLOAT32_MAX:
                raise ValueError(f"reward {v!r} is not a finite float32 number; return a finite float, or None when it does not apply")
            rewards.append(r)
    return rewards


def serve(conn, functions: dict[int, bytes], module_files: dict[str, str]) -> None:
    """The worker's main loop: messages (k, inputs, n) -> ("ok", rewards) | ("error", traceback)."""
    _exit_with_parent()
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # killing the group takes the function's own subprocesses too; Ctrl-C is the trainer's alone
    module_errors = ""
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
            failed[k] = f"cannot be loaded in a worker process:\n{module_errors}{traceback.format_exc()}"
    conn.send(("ready", failed))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        k, inputs, n = message
        if k in failed:
            reply = ("error", failed[k])
        else:
            try:
                reply = ("ok", call_reward(loaded[k], inputs, n))
            except BaseException:  # SystemExit too: a function's sys.exit() is its failure, not the worker's end
                reply = ("error", traceback.format_exc())
        conn.send(reply)


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


def _exit_with_parent() -> None:
    """A worker busy in a call that never returns must not outlive a trainer that died."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit with parent").start()
