"""The filter of process-isolated tool calls (grpo.sandbox.signal_guard): what it protects, each
way round it that it closes, and what it leaves a process to do to its own processes."""

import ctypes
import errno
import fcntl
import json
import logging
import os
import resource
import signal
import socket
import struct
import subprocess
import sys

import pytest

from grpo.rollout import tools
from grpo.rollout.tools import ToolCall, ToolRunner, as_tool
from grpo.sandbox import seccomp
from grpo.sandbox.seccomp import AUDIT_ARCH
from grpo.sandbox.signal_guard import (
    CLONE_PARENT,
    F_SETSIG,
    FIOSETOWN,
    MAX_PROTECTED,
    SYSCALLS,
    SignalGuard,
    build,
)

pytestmark = pytest.mark.skipif(
    seccomp.machine() is None or not sys.platform.startswith("linux"),
    reason="seccomp filters are Linux's, built for x86_64 and aarch64",
)


@pytest.mark.parametrize("arch", sorted(AUDIT_ARCH))
def test_the_most_ids_fit_one_filter_and_more_are_refused(arch):
    assert len(build(arch, range(1, MAX_PROTECTED + 1))) // 8 <= 4096
    with pytest.raises(ValueError, match="more than the kernel's 4,096"):
        build(arch, range(1, MAX_PROTECTED + 400))


PAST_THE_LIMIT = r"""
import json, os, subprocess, sys, time
from grpo.sandbox import signal_guard
from grpo.sandbox.signal_guard import protected_ids


def orphan(new_session):
    # fork, fork, the middle one exits: a process that is not this one's descendant, in this
    # session or (new_session) in one of its own; its pid. It sleeps 30 s.
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            if new_session:
                os.setsid()
            if os.fork() == 0:
                os.write(write, f"{os.getpid()}\n".encode())
                time.sleep(30)
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    with os.fdopen(read) as f:
        return int(f.readline())


# this process leads a session of its own. Started first, so that its pid sorts before the
# child's among the session's members (pids wrap only past pid_max): a member of the session
# that is not a descendant; then a child (a descendant, and in the session too), and a daemon
# (neither)
member = orphan(new_session=False)
child = subprocess.Popen(["sleep", "30"])
daemon = orphan(new_session=True)
try:
    table = signal_guard._processes()
    # one reading of /proc for every call below, so that they cut the same list of ids
    signal_guard._processes = lambda: table
    every = protected_ids()

    def admitted(pid):
        # the least limit under len(every) whose ids hold `pid` (None: none): the ids past the
        # limit are a prefix of one order, so this is the pid's place in it
        low, high = 1, len(every) - 1
        if pid not in protected_ids(high):
            return None
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if pid in protected_ids(middle) else (middle + 1, high)
        return low

    mine = len(os.listdir(f"/proc/{os.getpid()}/task"))
    few = protected_ids(limit=mine + 40)
    print(json.dumps({
        "every": len(every),
        "in_every": all(
            p in every for p in (1, os.getpid(), os.getppid(), member, child.pid, daemon)
        ),
        "few": len(few),
        "limit_few": mine + 40,
        "few_hold_own": all(
            p in few for p in (1, os.getpid(), os.getppid(), os.getpgid(0), os.getsid(0))
        ),
        "daemon_in_few": daemon in few,
        "places": {name: admitted(pid) for name, pid in (
            ("itself", os.getpid()), ("parent", os.getppid()), ("child", child.pid),
            ("member", member), ("daemon", daemon),
        )},
    }))
finally:
    child.kill()
    child.wait()
    for pid in (member, daemon):
        os.kill(pid, 9)
"""


def test_past_the_limit_only_the_process_its_ancestors_descendants_and_session_are_protected():
    """Past the limit the ids kept are, in order: the process's own and its ancestors', its
    descendants', then its session's members'; never another session's process that is not its
    descendant. Seen from a fresh process that leads a session of its own (this test process
    may have descendants and session members of earlier tests), with a child, a member of its
    session that is not its descendant, started before the child (so that its pid sorts first
    among the session's members: only the descendants coming first puts the child before it),
    and a daemon in a session of its own."""
    done = subprocess.run(
        [sys.executable, "-c", PAST_THE_LIMIT],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["in_every"]
    assert seen["few"] <= seen["limit_few"] and seen["few_hold_own"]
    assert not seen["daemon_in_few"]
    places = seen["places"]
    assert places["daemon"] is None  # no limit under all of them takes it
    assert places["itself"] < places["parent"] < places["child"] < places["member"], places


def _in_guarded_fork(guard: SignalGuard, attempts) -> dict:
    """What `attempts()` (a dict) gives in a fork of this process under `guard`'s filter."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = {}
        try:
            os.close(read)
            outcome = {"installed": guard.install(), **attempts()}
        except BaseException as error:
            outcome = {"error": repr(error)}
        finally:
            try:
                os.write(write, json.dumps(outcome).encode())
            finally:
                os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def _errno(action) -> str:
    try:
        action()
    except OSError as error:
        return errno.errorcode[error.errno]
    return "allowed"


def test_each_way_to_signal_or_trace_a_protected_process_is_refused():
    arch = seccomp.machine()
    numbers = {**seccomp.SYSCALLS[arch], **SYSCALLS[arch]}
    libc = ctypes.CDLL(None, use_errno=True)
    bystander = subprocess.Popen(["sleep", "30"])

    def syscall(name, *args):
        def call():
            got = libc.syscall(numbers[name], *(ctypes.c_long(a) for a in args))
            if got == 0 and name == "clone":  # a child was made: the filter let it through
                os._exit(0)
            if got < 0:
                raise OSError(ctypes.get_errno(), name)
            if name == "clone":
                os.waitpid(got, 0)

        return call

    def attempts():
        trainer, here = os.getppid(), socket.socket()
        pidfd = os.pidfd_open(trainer)
        child = subprocess.Popen(["sleep", "30"])
        # a siginfo_t whose si_code is SI_QUEUE (-1), as sigqueue(3) sends it
        info = ctypes.create_string_buffer(struct.pack("iii", 0, 0, -1), 128)
        outcome = {
            "tkill": _errno(syscall("tkill", trainer, 0)),
            "tgkill": _errno(syscall("tgkill", trainer, trainer, 0)),
            "rt_sigqueueinfo": _errno(
                syscall("rt_sigqueueinfo", trainer, 0, ctypes.addressof(info))
            ),
            "pidfd_send_signal": _errno(lambda: signal.pidfd_send_signal(pidfd, 0)),
            "ptrace": _errno(syscall("ptrace", 0x4206, bystander.pid, 0, 0)),  # PTRACE_SEIZE
            "F_SETSIG": _errno(lambda: fcntl.fcntl(here.fileno(), F_SETSIG, signal.SIGTERM)),
            "FIOSETOWN": _errno(
                lambda: fcntl.ioctl(here.fileno(), FIOSETOWN, struct.pack("i", trainer))
            ),
            "clone with CLONE_PARENT": _errno(
                syscall("clone", CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)
            ),
            # a process's own: allowed
            "kill itself": _errno(lambda: os.kill(os.getpid(), 0)),
            "its own limits": _errno(lambda: resource.prlimit(os.getpid(), resource.RLIMIT_CPU)),
            "its child's limits": _errno(lambda: resource.prlimit(child.pid, resource.RLIMIT_CPU)),
            "kill its child": _errno(child.kill),
            "clone": _errno(syscall("clone", signal.SIGCHLD, 0, 0, 0, 0)),
        }
        child.wait()
        return outcome

    try:
        outcome = _in_guarded_fork(SignalGuard.prepare(), attempts)
    finally:
        bystander.kill()
        bystander.wait()
    assert outcome == {
        "installed": True,
        "tkill": "EPERM",
        "tgkill": "EPERM",
        "rt_sigqueueinfo": "EPERM",
        "pidfd_send_signal": "EPERM",
        "ptrace": "EPERM",
        "F_SETSIG": "EPERM",
        "FIOSETOWN": "EPERM",
        "clone with CLONE_PARENT": "EPERM",
        "kill itself": "allowed",
        "its own limits": "allowed",
        "its child's limits": "allowed",
        "kill its child": "allowed",
        "clone": "allowed",
    }


def quiet(x: int) -> str:
    """Returns its argument as text.

    Args:
        x: Anything.
    """
    return str(x)


def test_without_a_filter_calls_still_run_and_a_warning_says_so_once(monkeypatch, caplog):
    unusable = SignalGuard(None, None, "no seccomp filter here")
    monkeypatch.setattr(SignalGuard, "prepare", classmethod(lambda cls: unusable))
    monkeypatch.setattr(tools, "_unguarded_warned", False)
    runner = ToolRunner({"quiet": as_tool(quiet)}, 20.0, 100, "process")
    with caplog.at_level(logging.WARNING, logger="grpo.rollout.tools"):
        results = runner.run([ToolCall("quiet", {"x": 1}), ToolCall("quiet", {"x": 2})])
    assert [(r.content, r.failed) for r in results] == [("1", False), ("2", False)]
    warnings = [r.getMessage() for r in caplog.records if "without the filter" in r.getMessage()]
    assert len(warnings) == 1 and "no seccomp filter here" in warnings[0]
