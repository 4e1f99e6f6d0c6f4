"""The child side of tests/run/conftest.py's harness: `grpo argv` in a process forked from a
forkserver, a fresh interpreter that imported this module (and with it torch, transformers and
grpo's command line) once and never initialised CUDA, so a child works whatever the test
process did with CUDA, and starts in milliseconds.

A forkserver child inherits none of the test process's state, so what the test process set
up is given or redone here: its stdout and stderr, its environment (monkeypatch.setenv,
GRPO_KILL_AT), torch's thread count, and the `quick` fixture's patches (no plots, and no tqdm
monitor thread, whose lock a fork from the run, a tool call's, could copy held). Not collected
as tests: its name does not start with test_."""

import contextlib
import json
import os
import sys

import torch
import tqdm

import grpo.training.trainer  # noqa: F401 (imported by the server, once, for every child)
from grpo.cli import main
from grpo.run import runlog

# tqdm's lock (a multiprocessing RLock) made once, here in the server: a child that made its own
# would leave its semaphores to the resource tracker when it is SIGKILLed
tqdm.tqdm.get_lock()

IMPORTED_BY = os.getpid()
"""The process that imported this module: the forkserver, for a child that forked from it."""

FACTS = "GRPO_HARNESS_FACTS"
"""An environment variable naming a file: the child writes what it is there, as JSON, before the
run (tests/run/test_harness.py)."""


def inherited_fd(dup) -> int:
    """A file descriptor the test process handed over when it started the child (conftest's
    `_Fd`), as this process's own."""
    return dup.detach()


def child(argv, environ, threads, stdout, stderr, err_path=None):
    """`grpo argv`; stdout and stderr: the test process's (pytest's capture, while a test runs),
    as a forked child had them."""
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)
    runlog.RunLog.report = lambda self: None
    tqdm.tqdm.monitor_interval = 0
    if os.environ.get(FACTS):
        with open(os.environ[FACTS], "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "threads": torch.get_num_threads(),
                    "kill_at": os.environ.get("GRPO_KILL_AT"),
                    "cwd": os.getcwd(),
                    "quick": tqdm.tqdm.monitor_interval == 0,
                    "imported_by": IMPORTED_BY,
                },
                f,
            )
    if err_path is None:
        code = main(argv)
    else:
        with open(err_path, "w") as err, contextlib.redirect_stderr(err):
            code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
