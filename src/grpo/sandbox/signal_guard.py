"""A seccomp filter that keeps a process, and every process it starts, from signalling or
tracing the processes that existed before it: grpo.rollout.tools installs it in each
process-isolated tool call, so that a tool cannot stop the run that called it.

    guard = SignalGuard.prepare()   # in the trainer, right before the fork
    guard.install()                 # in the forked child, before the tool runs: whether it holds

Protected: every process that exists when `prepare` looks (read from /proc), with its threads,
its process group and its session: the trainer, what started it (a shell, torchrun's agent,
the other ranks), what it started (reward workers, an engine's processes), and init. Where
more than MAX_PROTECTED ids exist, only the trainer's own are: itself and its ancestors, its
descendants, the members of its session. Not protected: what starts after `prepare` looked,
which includes a thread a protected process starts then (kill with a thread's id signals its
whole process; grpo.rollout.tools looks right before it forks, and the trainer starts no
thread of its own while its forked calls run).

What the filter refuses (EPERM), to the process and everything it starts:

  - a signal to a protected process: kill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo; or to a
    protected process group: kill with a negative id (kill(-1), every process, included: pid
    1 is protected). kill(0), its own group, and its own processes stay allowed;
  - tkill and pidfd_send_signal, whatever their target: a thread id or a file descriptor (one
    opened on /proc/PID is a pidfd) cannot be matched to a process by a filter;
  - ptrace, process_vm_writev and pidfd_getfd (attaching stops the traced process; the others
    write to its memory or take its files);
  - prlimit64 on a protected process (a CPU limit of one second ends it);
  - fcntl's F_SETOWN, F_SETOWN_EX and F_SETSIG, and ioctl's FIOSETOWN and SIOCSPGRP, which
    make the kernel signal a chosen process on I/O;
  - clone with CLONE_PARENT, whose child would be the trainer's, and signal the trainer when
    it exits with a signal of the caller's choosing; clone3 fails with ENOSYS (its flags sit
    in memory the filter cannot read) and glibc falls back to clone, as in grpo.sandbox.seccomp.

As grpo.sandbox.seccomp's filter does, it kills the process on a system call of another ABI
(on x86_64, the x32 ABI and 32-bit calls), which would go round it. It needs Linux with
seccomp on x86_64 or aarch64; elsewhere `prepare` gives a guard whose `install` returns False.

What it does not stop: a process running as the trainer's user can still write to the
trainer's files, and, where the kernel lets it trace the trainer (same user, no Yama
restriction, or root), write to /proc/PID/mem; root can also kill through cgroup files.
PR_SET_NO_NEW_PRIVS, which an unprivileged filter needs, means a program the tool executes
gains no privileges from a setuid bit (sudo does not work there).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from dataclasses import dataclass

from grpo.sandbox import seccomp
from grpo.sandbox.seccomp import (
    INSTRUCTION,
    JEQ,
    JSET,
    LD_W_ABS,
    OFFSET_ARG0_LOW,
    RET,
    RET_ALLOW,
    RET_ERRNO,
)

JA = 0x05 | 0x00  # BPF_JMP | BPF_JA: pc += k
NEG = 0x04 | 0x80  # BPF_ALU | BPF_NEG: A = -A
OFFSET_ARG1_LOW = OFFSET_ARG0_LOW + 8

MAX_PROTECTED = 3_800
"""Process, group and session ids one filter holds (one instruction each; the kernel takes
filters of at most 4,096 instructions)."""

_BLOCK = 250
"""Ids compared before a jump to a refusal: a classic BPF conditional jump reaches 255 ahead."""

CLONE_PARENT = 0x00008000
SIGN_BIT = 0x80000000
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902

# The calls the filter looks at, besides those grpo.sandbox.seccomp names (x86_64 from
# asm/unistd_64.h, aarch64 from asm-generic/unistd.h; pidfd_send_signal has one number on both).
SYSCALLS = {
    "x86_64": {
        "kill": 62,
        "tkill": 200,
        "tgkill": 234,
        "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297,
        "pidfd_send_signal": 424,
        "prlimit64": 302,
        "fcntl": 72,
        "ioctl": 16,
    },
    "aarch64": {
        "kill": 129,
        "tkill": 130,
        "tgkill": 131,
        "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240,
        "pidfd_send_signal": 424,
        "prlimit64": 261,
        "fcntl": 25,
        "ioctl": 29,
    },
}

REFUSED = ("tkill", "pidfd_send_signal", "ptrace", "process_vm_writev", "pidfd_getfd")
"""Refused whatever their arguments."""

TARGETED = ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64")
"""Refused when their first argument, a process id, is protected."""


def build(arch: str, protected) -> bytes:
    """The filter for `arch` (a key of AUDIT_ARCH) protecting the ids `protected` (positive
    process, group and session ids), as prctl(PR_SET_SECCOMP) takes it."""
    numbers = {**seccomp.SYSCALLS[arch], **SYSCALLS[arch]}
    ids = sorted({int(i) for i in protected if 0 < int(i) < SIGN_BIT})
    code: list[
        tuple[int, object, object, int]
    ] = []  # (opcode, jt, jf, k): jt and jf labels or counts

    def emit(op, k=0, jt=0, jf=0):
        code.append((op, jt, jf, k))

    deny = RET_ERRNO | errno.EPERM
    seccomp.emit_arch_check(emit, arch)
    for name in REFUSED:
        emit(JEQ, numbers[name], jt="deny")
    emit(JEQ, numbers["clone3"], jt="nosys")
    emit(JEQ, numbers["clone"], jt="clone")
    emit(JEQ, numbers["fcntl"], jt="fcntl")
    emit(JEQ, numbers["ioctl"], jt="ioctl")
    emit(JEQ, numbers["kill"], jt="kill")
    for name in TARGETED:
        emit(JEQ, numbers[name], jt="target")
    labels: dict[str, int] = {}
    emit(RET, RET_ALLOW)
    labels["deny"] = len(code)
    emit(RET, deny)
    labels["nosys"] = len(code)
    emit(RET, RET_ERRNO | errno.ENOSYS)
    labels["clone"] = len(code)
    emit(LD_W_ABS, OFFSET_ARG0_LOW)  # clone's flags (the first argument on both architectures)
    emit(JSET, CLONE_PARENT, jf=1)
    emit(RET, deny)
    emit(RET, RET_ALLOW)
    for call, commands in (
        ("fcntl", (F_SETOWN, F_SETSIG, F_SETOWN_EX)),
        ("ioctl", (FIOSETOWN, SIOCSPGRP)),
    ):
        labels[call] = len(code)
        emit(LD_W_ABS, OFFSET_ARG1_LOW)  # the command
        for i, command in enumerate(commands):
            emit(JEQ, command, jt=len(commands) - i)
        emit(RET, RET_ALLOW)
        emit(RET, deny)
    labels["kill"] = len(code)
    emit(LD_W_ABS, OFFSET_ARG0_LOW)
    emit(JSET, SIGN_BIT, jf=1)  # a negative id names a process group (-1: every process)
    emit(NEG)
    emit(JA, 1)  # over target's load: the id is in A
    labels["target"] = len(code)
    emit(LD_W_ABS, OFFSET_ARG0_LOW)
    for start in range(0, len(ids), _BLOCK):
        block = ids[start : start + _BLOCK]
        for i, pid in enumerate(block):
            emit(JEQ, pid, jt=len(block) - i)  # to the refusal after the block
        emit(JA, 1)
        emit(RET, deny)
    emit(RET, RET_ALLOW)

    out = bytearray()
    for i, (op, jt, jf, k) in enumerate(code):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise ValueError(f"signal filter: jump out of range at instruction {i}")
        out += INSTRUCTION.pack(op, jt, jf, k)
    if len(code) > 4096:
        raise ValueError(f"signal filter: {len(code)} instructions, more than the kernel's 4,096")
    return bytes(out)


@dataclass(frozen=True)
class _Process:
    parent: int
    group: int
    session: int
    threads: tuple[int, ...]
    """Its threads' ids but its own: kill(TID) signals the thread's whole process."""

    def ids(self, pid: int) -> tuple[int, ...]:
        return (pid, self.group, self.session, *self.threads)


def _processes() -> dict[int, _Process]:
    """Every process in /proc (none without it) by pid."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            threads = tuple(int(t) for t in os.listdir(f"/proc/{name}/task") if t != name)
        except (OSError, ValueError):
            continue  # ended meanwhile
        # the command name may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        try:
            table[int(name)] = _Process(int(fields[1]), int(fields[2]), int(fields[3]), threads)
        except (IndexError, ValueError):
            continue
    return table


def protected_ids(limit: int = MAX_PROTECTED) -> set[int]:
    """The ids a filter made now protects (the module docstring): every process's, its threads',
    its group's and its session's, and 1; past `limit` ids, those of this process's own only:
    itself and its ancestors first, then its descendants, then the members of its session."""
    table = _processes()
    me = os.getpid()
    every = {1, me}
    for pid, process in table.items():
        every.update(process.ids(pid))
    every.discard(0)
    if len(every) <= limit:
        return every
    own = [me]
    pid = me
    while pid in table and table[pid].parent > 1 and table[pid].parent not in own:
        pid = table[pid].parent  # the ancestors
        own.append(pid)
    children: dict[int, list[int]] = {}
    for pid, process in table.items():
        children.setdefault(process.parent, []).append(pid)
    stack, seen = [me], {me}
    while stack:  # the descendants
        for child in children.get(stack.pop(), ()):
            if child not in seen:
                seen.add(child)
                own.append(child)
                stack.append(child)
    if me in table:
        own += sorted(pid for pid, p in table.items() if p.session == table[me].session)
    kept = {1: None}  # then in that order, each once, each process's other ids after it
    for pid in own:
        for i in table[pid].ids(pid) if pid in table else (pid,):
            if i > 0 and len(kept) < limit:
                kept[i] = None
    return set(kept)


class _Program(ctypes.Structure):
    """struct sock_fprog: what prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ...) reads."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_PR_SET_SECCOMP = 22
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_MODE_FILTER = 2


@functools.lru_cache(maxsize=None)
def _prctl():
    """The C library's prctl (Linux), or None; looked up in the trainer, never in a fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


@dataclass
class SignalGuard:
    """A filter built in the trainer and held in memory a fork inherits, so that the child
    installs it with two prctl calls and nothing else (no lookup, no import, no allocation of
    note). `reason`: why there is none (None when there is)."""

    program: _Program | None
    buffer: object
    reason: str | None

    @classmethod
    def prepare(cls, limit: int = MAX_PROTECTED) -> "SignalGuard":
        arch, prctl = seccomp.machine(), _prctl()
        if arch is None or prctl is None:
            return cls(None, None, f"no seccomp filter for {sys.platform} on {os.uname().machine}")
        code = build(arch, protected_ids(limit))
        buffer = ctypes.create_string_buffer(code, len(code))
        program = _Program(len(code) // INSTRUCTION.size, ctypes.addressof(buffer))
        return cls(program, buffer, None)

    def install(self) -> bool:
        """Binds this process and every process it starts from now on; whether it took effect
        (False: `reason` says why). Once installed it cannot be removed."""
        if self.program is None:
            return False
        prctl, zero = _prctl(), ctypes.c_ulong(0)
        if prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero) != 0:
            self.reason = f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
            return False
        if (
            prctl(
                _PR_SET_SECCOMP,
                ctypes.c_ulong(_SECCOMP_MODE_FILTER),
                ctypes.byref(self.program),
                zero,
                zero,
            )
            != 0
        ):
            self.reason = f"prctl(PR_SET_SECCOMP) failed: {os.strerror(ctypes.get_errno())}"
            return False
        return True
