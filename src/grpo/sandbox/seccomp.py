"""The seccomp filter of sandboxed programs: a classic BPF program built here (no libseccomp).

    program()          # bytes for bwrap's --seccomp FD, or None where the architecture is unknown

bwrap loads it into the program's process right before the exec, after its own set-up, so
it binds the program and everything the program starts, and nothing of bwrap. The filter

  - kills the process on a system call of any ABI but the machine's own (on x86_64 also
    the x32 ABI: 32-bit calls from a 64-bit process are a classic way round a filter);
  - fails with EPERM the calls in DENIED: io_uring, bpf, perf events, userfaultfd, the
    kernel keyring, namespaces and mounts, modules and kexec, other processes' memory,
    and the like -- the kernel's usual exploit surface, which a test program never needs;
  - fails with EPERM a clone() that asks for any new namespace, and with ENOSYS every
    clone3(), whose flags sit in memory a filter cannot read: glibc then falls back to
    clone(), which is checked (Docker and systemd do the same);
  - allows the rest.

A denied call is an ordinary failed call to the program (PermissionError in Python),
not a crash.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
import sys

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}: what bwrap reads from its --seccomp fd
INSTRUCTION = struct.Struct("<HBBI")

# classic BPF opcodes (linux/bpf_common.h)
# BPF_LD | BPF_W | BPF_ABS: A = 32-bit word at offset k of seccomp_data
LD_W_ABS = 0x00 | 0x00 | 0x20
JEQ = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
JGE = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K (unsigned)
JSET = 0x05 | 0x40 | 0x00  # BPF_JMP | BPF_JSET | BPF_K: jump if A & k
RET = 0x06 | 0x00  # BPF_RET | BPF_K

# struct seccomp_data {int nr; u32 arch; u64 instruction_pointer; u64 args[6]} (little-endian machines)
OFFSET_NR = 0
OFFSET_ARCH = 4
OFFSET_ARG0_LOW = 16

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

CLONE_NEW_NAMESPACES = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)

DENIED = (
    # asynchronous I/O that bypasses the per-call checks, and a long line of kernel bugs
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # kernel-side programs, performance counters, page-fault handling in user space
    "bpf",
    "perf_event_open",
    "userfaultfd",
    # the kernel keyring
    "keyctl",
    "add_key",
    "request_key",
    # namespaces (the sandbox's own are set up before the filter applies)
    "unshare",
    "setns",
    # mounts, old and new API
    "mount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "mount_setattr",
    # file handles reach files by inode, round the mount namespace
    "open_by_handle_at",
    "name_to_handle_at",
    # the kernel itself: modules, kexec, reboot, swap, accounting, quotas, its log
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "syslog",
    "fanotify_init",
    # other processes' memory and files
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    # execution domains (can turn off address-space randomisation)
    "personality",
    # x86 port I/O and segment descriptors
    "iopl",
    "ioperm",
    "modify_ldt",
    "uselib",
)

# Syscall numbers: x86_64 from asm/unistd_64.h, aarch64 from asm-generic/unistd.h. Calls from
# io_uring_setup on carry the same number on every architecture. A name missing from an
# architecture's table does not exist there.
_COMMON = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "open_tree_attr": 467,
}
SYSCALLS = {
    "x86_64": {
        **_COMMON,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "unshare": 272,
        "setns": 308,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "open_by_handle_at": 304,
        "name_to_handle_at": 303,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "acct": 163,
        "quotactl": 179,
        "lookup_dcookie": 212,
        "syslog": 103,
        "fanotify_init": 300,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "personality": 135,
        "iopl": 172,
        "ioperm": 173,
        "modify_ldt": 154,
        "uselib": 134,
        "clone": 56,
    },
    "aarch64": {
        **_COMMON,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "unshare": 97,
        "setns": 268,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "open_by_handle_at": 265,
        "name_to_handle_at": 264,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "reboot": 142,
        "swapon": 224,
        "swapoff": 225,
        "acct": 89,
        "quotactl": 60,
        "lookup_dcookie": 18,
        "syslog": 116,
        "fanotify_init": 262,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "personality": 92,
        "clone": 220,
    },
}


def machine() -> str | None:
    """The running kernel's architecture, as a key of AUDIT_ARCH; None when unknown here."""
    name = {"amd64": "x86_64", "arm64": "aarch64"}.get(os.uname().machine, os.uname().machine)
    # the offsets above read seccomp_data as little-endian
    return name if name in AUDIT_ARCH and sys.byteorder == "little" else None


def emit_arch_check(emit, arch: str) -> None:
    """A filter's first instructions: a call from another ABI than `arch`'s kills the process,
    on x86_64 x32's calls too; then the call's number is loaded for the rules after it."""
    emit(LD_W_ABS, OFFSET_ARCH)
    emit(JEQ, AUDIT_ARCH[arch], jt=1)
    emit(RET, RET_KILL_PROCESS)
    emit(LD_W_ABS, OFFSET_NR)
    if arch == "x86_64":
        # nr -1 is no call at all (the kernel answers ENOSYS); anything else from the bit up is x32
        emit(JGE, X32_SYSCALL_BIT, jf=2)
        emit(JEQ, 0xFFFFFFFF, jt=1)
        emit(RET, RET_KILL_PROCESS)


def build(arch: str) -> bytes:
    """The filter for `arch` (a key of AUDIT_ARCH), as bwrap's --seccomp expects it."""
    numbers = SYSCALLS[arch]
    code: list[
        tuple[int, object, object, int]
    ] = []  # (opcode, jt, jf, k); jumps name a label or count

    def emit(op, k=0, jt=0, jf=0):
        code.append((op, jt, jf, k))

    emit_arch_check(emit, arch)
    for name in DENIED:
        if name in numbers:
            emit(JEQ, numbers[name], jt="deny")
    emit(JEQ, numbers["clone3"], jt="nosys")
    emit(JEQ, numbers["clone"], jf="allow")
    emit(LD_W_ABS, OFFSET_ARG0_LOW)  # clone's flags (the first argument on both architectures)
    emit(JSET, CLONE_NEW_NAMESPACES, jt="deny")
    labels = {"allow": len(code), "deny": len(code) + 1, "nosys": len(code) + 2}
    emit(RET, RET_ALLOW)
    emit(RET, RET_ERRNO | errno.EPERM)
    emit(RET, RET_ERRNO | errno.ENOSYS)

    out = bytearray()
    for i, (op, jt, jf, k) in enumerate(code):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        if not (0 <= jt <= 255 and 0 <= jf <= 255):
            raise ValueError(f"seccomp filter: jump out of range at instruction {i}")
        out += INSTRUCTION.pack(op, jt, jf, k)
    return bytes(out)


@functools.lru_cache(maxsize=None)
def program() -> bytes | None:
    """This machine's filter (built once per process), or None where the architecture is unknown."""
    arch = machine()
    return build(arch) if arch else None
