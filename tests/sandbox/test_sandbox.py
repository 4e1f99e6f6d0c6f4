"""grpo.sandbox.run against hostile programs: each is bounded, reported with the right
status, really started, and leaves nothing behind; benign programs run normally."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

import grpo.sandbox.runner as run_module
from grpo import sandbox
from grpo.sandbox import Limits, SandboxUnavailable, run, seccomp

if sandbox.bwrap_path() is None and not os.environ.get("GRPO_REQUIRE_SANDBOX"):
    pytest.skip("bubblewrap is not installed (make test installs it)", allow_module_level=True)

STARTED = 'print("started", flush=True)\n'


def sandbox_processes() -> list[str]:
    """Processes of this process's sandbox uids, or hostile programs' markers, still alive. Zombies
    are not counted: they have exited, and the namespace's init, orphaned when its
    namespace ends, waits for the machine's init to collect it."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            status = Path(entry.path, "status").read_text()
            cmdline = (
                Path(entry.path, "cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        uid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))
        if "\nState:\tZ" in status:
            continue
        # this process's own sandbox uids (another process on the machine has other ones)
        if (
            run_module._uids.base <= uid < run_module._uids.base + run_module.UID_SLOTS
            or "grpo-hostile" in cmdline
        ):
            found.append(f"{entry.name} uid={uid} {cmdline[:120]}")
    return found


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    fds = open_fds()
    yield
    time.sleep(0.2)
    assert sandbox_processes() == []
    assert open_fds() == fds, "the sandbox leaked file descriptors into the test process"


# --------------------------------------------------------------------------
# Benign programs
# --------------------------------------------------------------------------


def test_benign_program_runs_and_prints():
    r = run('import sys\nprint("hello")\nprint("warn", file=sys.stderr)\n')
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "hello\n", "warn\n")
    assert 0 < r.duration < 5


def test_stdin_is_given_or_closed():
    assert run("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"
    r = run(STARTED + "input()")
    assert r.status == "failed" and "EOFError" in r.stderr and "started" in r.stdout


def test_program_can_use_its_working_directory_and_the_stdlib():
    r = run(
        "import json, math, collections, os\n"
        "open('data.txt', 'w').write('x' * 1000)\n"
        "print(os.getcwd(), len(open('data.txt').read()), math.factorial(5), json.dumps([1]))\n"
    )
    assert r.status == "ok" and r.stdout == "/tmp 1000 120 [1]\n"


def test_exit_status_is_reported():
    r = run(STARTED + "import sys; sys.exit(3)")
    assert (r.status, r.exit_code) == ("failed", 3) and "started" in r.stdout
    r = run("raise ValueError('boom')")
    assert r.status == "failed" and r.exit_code == 1 and "ValueError: boom" in r.stderr


def test_many_runs_in_a_row_all_run():
    # each run's processes must be gone when it ends, or they would count against the
    # process limit of the next run that gets the same uid
    results = [run("print('x')") for _ in range(3 * run_module.UID_SLOTS // 2)]
    assert [r.stdout for r in results] == ["x\n"] * len(results)


def test_concurrent_runs_stay_separate():
    results = [None] * 6

    def go(i):
        results[i] = run(f"import time; time.sleep(0.2); print({i})")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]


# --------------------------------------------------------------------------
# Hostile programs
# --------------------------------------------------------------------------


def test_infinite_loop_times_out():
    r = run(STARTED + "while True:\n    pass\n", timeout=1.5)
    assert r.status == "timeout" and "started" in r.stdout
    assert r.duration < 4


def test_cpu_limit_stops_a_busy_program_before_the_wall_clock():
    r = run(STARTED + "while True:\n    pass\n", timeout=30, cpu_seconds=1)
    assert r.status == "timeout" and r.duration < 10


def test_ignoring_sigterm_does_not_help():
    r = run(
        STARTED + "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True:\n    time.sleep(0.1)\n",
        timeout=1.5,
    )
    assert r.status == "timeout" and "started" in r.stdout and r.duration < 4


def test_fork_bomb_is_bounded():
    r = run(
        STARTED
        + "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        timeout=2,
        processes=16,
    )
    assert r.status == "timeout" and "started" in r.stdout and r.duration < 6


def test_fork_limit_is_felt_by_the_program():
    r = run(
        "import os, sys\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            import time; time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError as e:\n"
        "    print('refused after', n, type(e).__name__)\n    sys.exit(0)\n",
        timeout=5,
        processes=8,
    )
    assert r.status == "ok" and r.stdout.startswith("refused after")
    assert int(r.stdout.split()[2]) < 8


def test_thread_bomb_is_bounded():
    r = run(
        STARTED + "import threading, time\nwhile True:\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
        timeout=5,
        processes=16,
    )
    assert r.status == "failed" and "started" in r.stdout and "can't start new thread" in r.stderr


def test_memory_bomb_is_stopped():
    r = run(STARTED + "x = bytearray(4 << 30)\n", memory=256 << 20)
    assert r.status == "memory" and "started" in r.stdout
    r = run(
        STARTED + "chunks = []\nwhile True:\n    chunks.append(bytearray(8 << 20))\n",
        memory=256 << 20,
    )
    assert r.status == "memory" and "started" in r.stdout


def test_memory_spread_over_processes_hits_the_cgroup_limit():
    if sandbox.cgroups.available() is None:
        pytest.skip("cgroups are not writable here")
    # each process stays under the address-space limit; together they exceed the cgroup's
    r = run(
        STARTED + "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        break\n"
        "x = bytearray(150 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\ntime.sleep(3)\n",
        memory=256 << 20,
        timeout=8,
    )
    assert r.status == "memory" and "started" in r.stdout


def test_no_cgroup_is_left_once_the_last_run_in_its_parent_ends():
    """A run's cgroup goes when it closes, and the grpo-sandbox cgroup that holds run cgroups goes
    with the last of them; while another run's is in it, it stays (runs side by side)."""
    parents = sandbox.cgroups.available()
    if parents is None:
        pytest.skip("cgroups are not writable here")
    # a parent of this test's own beside the real one, so that other runs on the machine (which
    # share the real one) cannot keep it
    mine = [p.with_name(f"grpo-sandbox-test-{secrets.token_hex(4)}") for p in parents]
    first = sandbox.cgroups.RunCgroup(mine, 64 << 20, 4)
    second = sandbox.cgroups.RunCgroup(mine, 64 << 20, 4)
    try:
        assert all(d.is_dir() for d in first.dirs + second.dirs)
        first.close()
        assert not any(d.exists() for d in first.dirs)
        assert all(p.is_dir() for p in mine)  # the second run's cgroup is in it
        second.close()
        assert not any(p.exists() for p in mine)
        # a run made after the parent went makes it again
        third = sandbox.cgroups.RunCgroup(mine, 64 << 20, 4)
        assert all(d.is_dir() for d in third.dirs)
        third.close()
        assert not any(p.exists() for p in mine)
    finally:
        for d in first.dirs + second.dirs + mine:
            if d.exists():
                d.rmdir()


def test_output_flood_is_cut_quickly():
    r = run(
        STARTED
        + "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(block)\n",
        timeout=30,
        output=1 << 20,
    )
    assert r.status == "output_limit" and r.truncated and r.stdout.startswith("started")
    assert len(r.stdout) == 1 << 20 and r.duration < 10


def test_disk_fill_is_bounded():
    r = run(
        STARTED
        + "block = b'x' * (1 << 20)\nwith open('fill', 'wb') as f:\n    while True:\n        f.write(block)\n",
        disk=32 << 20,
        file_size=1 << 30,
        timeout=10,
    )
    assert r.status == "output_limit" and "started" in r.stdout
    r = run(
        STARTED
        + "block = b'x' * (1 << 20)\nwith open('big', 'wb') as f:\n    while True:\n        f.write(block)\n",
        file_size=4 << 20,
        timeout=10,
    )
    assert r.status == "output_limit" and "started" in r.stdout


def test_network_is_unreachable(tmp_path):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run(
            STARTED + "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError as e:\n    print('refused', type(e).__name__)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('internet')\n"
            "except OSError as e:\n    print('no internet', type(e).__name__)\n"
        )
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert r.status == "ok" and "started" in r.stdout
    assert "refused" in r.stdout and "connected" not in r.stdout and "no internet" in r.stdout


def test_writes_outside_its_directory_fail(tmp_path):
    target = tmp_path / "escaped"
    checkout_file = Path(__file__).resolve().parent / "escaped_from_sandbox"
    paths = [
        str(target),
        str(checkout_file),
        "/usr/escaped",
        "/etc/escaped",
        "/sandbox/main.py",
        "/escaped",
    ]
    r = run(
        STARTED + f"paths = {paths!r}\n"
        "for p in paths:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('denied', p, type(e).__name__)\n"
    )
    assert r.status == "ok" and "started" in r.stdout and "WROTE" not in r.stdout
    assert r.stdout.count("denied") == len(paths)
    assert not target.exists() and not checkout_file.exists() and not Path("/usr/escaped").exists()


def test_host_files_are_not_visible():
    here = str(Path(__file__).resolve())
    r = run(
        STARTED + f"import os\nfor p in [{here!r}, '/root', '/etc/passwd', '/home', '/work']:\n"
        "    print(p, os.path.exists(p))\n"
    )
    assert r.status == "ok" and "True" not in r.stdout and r.stdout.count("False") == 5


def test_parent_environment_is_not_readable(monkeypatch):
    secret = secrets.token_hex(16)
    monkeypatch.setenv("GRPO_TEST_SECRET", secret)
    r = run(
        STARTED + "import os\nprint(dict(os.environ))\n"
        f"for pid in ['1', str(os.getppid()), 'self', '{os.getpid()}']:\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n        print(pid, type(e).__name__)\n"
    )
    assert r.status == "ok" and "started" in r.stdout
    assert secret not in r.stdout and "GRPO_TEST_SECRET" not in r.stdout


def test_killing_its_parent_leaves_the_test_process_alive():
    r = run(
        STARTED + "import os, signal\n"
        f"for pid in [os.getppid(), {os.getpid()}, {os.getppid()}, -1]:\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('sent', pid)\n"
        "    except OSError as e:\n        print('could not', pid, type(e).__name__)\n"
    )
    assert "started" in r.stdout
    # kill(-1) may take the program itself down with its siblings
    assert r.status in (
        "ok",
        "crashed",
    )
    assert run("print(1)").stdout == "1\n"  # this process, and the sandbox, carry on


def test_daemon_does_not_survive():
    marker = f"grpo-hostile-{secrets.token_hex(4)}"
    r = run(
        STARTED + "import os, sys, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        os.write(w, b'up')\n"
        f"        os.execv('/bin/sleep', ['{marker}', '60'])\n    os._exit(0)\n"
        "print('daemon', os.read(r, 2).decode(), flush=True)\n"
    )
    assert r.status == "ok" and "daemon up" in r.stdout
    time.sleep(0.1)
    assert not [p for p in sandbox_processes() if marker in p]


def test_segfault_is_a_crash():
    r = run(STARTED + "import ctypes\nctypes.string_at(0)\n")
    assert r.status == "crashed" and r.signal == 11 and "started" in r.stdout


# --------------------------------------------------------------------------
# Kernel surface: the seccomp filter and the ban on nested user namespaces
# --------------------------------------------------------------------------

ARCH = seccomp.machine()
needs_filter = pytest.mark.skipif(ARCH is None, reason="no seccomp filter for this architecture")
NR = seccomp.SYSCALLS.get(ARCH, {})

# A raw clone() with no new stack: the child goes on from the call, like fork's, and leaves at once.
NAMESPACE_PROBE = r"""
import ctypes, errno, json, os, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {nr!r}
L = ctypes.c_long

def outcome(r):
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]

def clone(flags):
    pid = libc.syscall(L(NR["clone"]), L(flags | 17), L(0), None, None, L(0))  # 17: SIGCHLD
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    return outcome(pid)

def clone3(flags):
    args = ctypes.create_string_buffer(struct.pack("<8Q", flags, 0, 0, 0, 17, 0, 0, 0))
    pid = libc.syscall(L(NR["clone3"]), args, L(64))
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    return outcome(pid)

user_ns = os.open("/proc/self/ns/user", os.O_RDONLY)
tool = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, text=True)
print(json.dumps({{
    "unshare_user": outcome(libc.unshare(0x10000000)),
    "unshare_user_mount": outcome(libc.unshare(0x10020000)),
    "unshare_net": outcome(libc.unshare(0x40000000)),
    "clone_user": clone(0x10000000),
    "clone_net": clone(0x40000000),
    "clone3_user": clone3(0x10000000),
    "setns": outcome(libc.setns(user_ns, 0)),
    "mount_tmpfs": outcome(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "unshare_tool": [tool.returncode, tool.stderr.strip()],
}}))
"""

# Arguments chosen so that, without the filter, the kernel answers something other than EPERM.
SURFACE_PROBE = r"""
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {nr!r}
L = ctypes.c_long

def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(L(NR[name]), *args)
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]

print(json.dumps({{
    "io_uring_setup": call("io_uring_setup", L(1), ctypes.create_string_buffer(120)),
    "io_uring_enter": call("io_uring_enter", L(999), L(0), L(0), L(0), None, L(0)),
    "io_uring_register": call("io_uring_register", L(999), L(0), None, L(0)),
    "bpf": call("bpf", L(1000), None, L(0)),
    "perf_event_open": call("perf_event_open", None, L(0), L(-1), L(-1), L(0)),
    "userfaultfd": call("userfaultfd", L(1)),  # UFFD_USER_MODE_ONLY: open to anyone since Linux 5.11
    "keyctl": call("keyctl", L(99999), L(0), L(0), L(0), L(0)),
    "add_key": call("add_key", None, None, None, L(0), L(0)),
    "request_key": call("request_key", None, None, None, L(0)),
    "ptrace": call("ptrace", L(2), L(999999), None, None),  # PTRACE_PEEKDATA of no such process
    "process_vm_readv": call("process_vm_readv", L(1), None, L(0), None, L(0), L(1)),  # flags must be 0
    "personality": call("personality", L(0xFFFFFFFF)),  # a query
}}))
"""


def probe(template: str) -> dict:
    r = run(template.format(nr=NR), timeout=20)
    assert r.status == "ok", (r.status, r.stderr)
    return json.loads(r.stdout)


@needs_filter
def test_programs_cannot_create_user_namespaces():
    found = probe(NAMESPACE_PROBE)
    tool_status, tool_error = found.pop("unshare_tool")
    assert found == {
        "unshare_user": "EPERM",
        "unshare_user_mount": "EPERM",
        "unshare_net": "EPERM",
        "clone_user": "EPERM",
        "clone_net": "EPERM",
        "clone3_user": "ENOSYS",
        "setns": "EPERM",
        "mount_tmpfs": "EPERM",
    }
    assert tool_status != 0 and "Operation not permitted" in tool_error


@needs_filter
def test_programs_cannot_reach_io_uring_bpf_perf_userfaultfd_or_the_keyring():
    names = (
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "keyctl",
        "add_key",
        "request_key",
        "ptrace",
        "process_vm_readv",
        "personality",
    )
    assert probe(SURFACE_PROBE) == {name: "EPERM" for name in names}
    r = run(
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0:\n"
        "    e = ctypes.get_errno()\n    raise OSError(e, os.strerror(e))\n"
    )
    assert r.status == "failed" and "PermissionError: [Errno 1] Operation not permitted" in r.stderr


@needs_filter
def test_probes_reach_the_kernel_without_the_filter(monkeypatch):
    # the control: the same calls, unfiltered, get the kernel's own answers (so the EPERMs above
    # are the filter's)
    monkeypatch.setattr(run_module, "_seccomp_filter", lambda: None)
    found = probe(SURFACE_PROBE)
    expected = {
        "io_uring_enter": "EBADF",
        "io_uring_register": "EBADF",
        "perf_event_open": "EFAULT",
        "keyctl": errno.errorcode[errno.EOPNOTSUPP],
        "add_key": "EFAULT",
        "request_key": "EFAULT",
        "ptrace": "ESRCH",
        "process_vm_readv": "EINVAL",
        "personality": "ok",
    }
    assert {name: found[name] for name in expected} == expected


@needs_filter
def test_userns_ban_holds_without_the_filter(monkeypatch):
    if not run_module._userns_ban(sandbox.bwrap_path()):
        pytest.skip("this bwrap cannot ban user namespaces (older than 0.8.0, or setuid)")
    monkeypatch.setattr(run_module, "_seccomp_filter", lambda: None)
    found = probe(NAMESPACE_PROBE)
    # the kernel's answer once the sandbox's user namespace may hold no more of them
    assert (found["unshare_user"], found["clone_user"], found["clone3_user"]) == ("ENOSPC",) * 3
    assert (
        "ok" not in [v for k, v in found.items() if k != "unshare_tool"]
        and found["unshare_tool"][0] != 0
    )


@needs_filter
def test_filter_alone_denies_user_namespaces(monkeypatch, tmp_path, caplog):
    # a bwrap older than 0.8.0 has no --disable-userns: the runner says so and relies on the filter
    old = tmp_path / "bwrap"
    old.write_text("#!/bin/sh\necho 'usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]'\n")
    old.chmod(0o755)
    run_module._warned.discard("userns")
    with caplog.at_level(logging.WARNING, logger="grpo.sandbox.runner"):
        assert run_module._userns_ban(str(old)) is False
        assert run_module._userns_ban(str(old)) is False
    assert (
        len(
            [
                r
                for r in caplog.records
                if "cannot ban user namespaces" in r.message
                and "the seccomp filter alone denies" in r.message
            ]
        )
        == 1
    )
    run_module._warned.discard("userns")
    monkeypatch.setattr(run_module, "bwrap_path", lambda: str(old))
    cmd = run_module._bwrap(Limits(), "/usr/bin/python3", 3, 4, 5)
    assert "--disable-userns" not in cmd and cmd[cmd.index("--seccomp") + 1] == "5"
    monkeypatch.undo()
    monkeypatch.setattr(run_module, "_userns_ban", lambda bwrap: False)
    found = probe(NAMESPACE_PROBE)
    assert (found["unshare_user"], found["clone_user"], found["clone3_user"], found["setns"]) == (
        "EPERM",
        "EPERM",
        "ENOSYS",
        "EPERM",
    )


@needs_filter
def test_ordinary_programs_still_work_under_the_filter():
    r = run(
        "import concurrent.futures, multiprocessing, os, subprocess, threading\n"
        "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n"
        "done = []\nt = threading.Thread(target=done.append, args=(1,))\nt.start()\nt.join()\n"
        "print('thread', done)\n"
        "print('subprocess', subprocess.run(['/usr/bin/true']).returncode,\n"
        "      subprocess.run(['/usr/bin/echo', 'hi'], capture_output=True, text=True).stdout.strip())\n"
        "pid = os.posix_spawn('/usr/bin/true', ['true'], {})\n"
        "print('posix_spawn', os.waitpid(pid, 0)[1])\n"
        "def square(x):\n    return x * x\n"
        "with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "    print('pool', pool.map(square, range(4)))\n"
        "with concurrent.futures.ThreadPoolExecutor(2) as ex:\n"
        "    print('threads', list(ex.map(square, range(3))))\n",
        timeout=20,
    )
    assert r.status == "ok", r.stderr
    assert (
        r.stdout
        == "2\nthread [1]\nsubprocess 0 hi\nposix_spawn 0\npool [0, 1, 4, 9]\nthreads [0, 1, 4]\n"
    )


@pytest.mark.skipif(ARCH != "x86_64", reason="the x32 ABI is x86_64's")
def test_other_abis_are_killed():
    r = run(
        STARTED + "import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)\nprint('survived')\n"
    )
    assert r.status == "crashed" and r.signal == signal.SIGSYS and r.stdout == "started\n"


def test_without_a_filter_the_sandbox_says_so_and_runs(monkeypatch, caplog):
    monkeypatch.setattr(seccomp, "program", lambda: None)
    run_module._warned.discard("seccomp")
    with caplog.at_level(logging.WARNING, logger="grpo.sandbox.runner"):
        results = [run("print(1)"), run("print(2)")]
    run_module._warned.discard("seccomp")
    assert [r.stdout for r in results] == ["1\n", "2\n"]
    assert (
        len([r for r in caplog.records if "no seccomp filter for this machine" in r.message]) == 1
    )
    monkeypatch.setattr(
        seccomp.os, "uname", lambda: os.uname_result(("Linux", "h", "6", "1", "riscv64"))
    )
    assert seccomp.machine() is None


# The filter without the kernel: a classic-BPF interpreter for the instructions it uses.
AUDIT = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS


def run_filter(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    data = struct.pack("<iIQ6Q", nr, arch, 0x400000, arg0, 0, 0, 0, 0, 0)
    pc, acc = 0, 0
    for _ in range(
        len(program) // 8
    ):  # no loops in classic BPF: each instruction runs at most once
        code, jt, jf, k = struct.unpack_from("<HBBI", program, 8 * pc)
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # ret k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x} at {pc}")
    raise AssertionError("ran off the end of the filter")


MUST_DENY = {
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsmount",
    "move_mount",
    "open_tree",
    "open_by_handle_at",
    "init_module",
    "finit_module",
    "kexec_load",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
}


@pytest.mark.parametrize("arch", sorted(AUDIT))
def test_seccomp_filter_encodes_the_policy(arch):
    program = seccomp.build(arch)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096
    numbers = seccomp.SYSCALLS[arch]
    assert MUST_DENY <= set(seccomp.DENIED)
    denied = {numbers[name] for name in seccomp.DENIED if name in numbers}
    assert len(denied) >= 40
    for nr in range(600):
        expected = EPERM if nr in denied else ENOSYS if nr == numbers["clone3"] else ALLOW
        assert run_filter(program, nr, AUDIT[arch]) == expected, nr
        assert run_filter(program, nr, 0x40000003) == KILL  # i386's ABI
    clone = numbers["clone"]
    thread = 0x003D0F00  # what pthread_create asks for: VM, FS, FILES, SIGHAND, THREAD, SYSVSEM, TLS, TIDs
    # fork, a thread, vfork, and a bit above the 32 that clone's flags use
    for flags in (17, thread, 0x00004100 | 17, (1 << 32) | 17):
        assert run_filter(program, clone, AUDIT[arch], flags) == ALLOW, hex(flags)
    for bit in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert run_filter(program, clone, AUDIT[arch], bit | 17) == EPERM, hex(bit)
        assert run_filter(program, clone, AUDIT[arch], bit | thread) == EPERM, hex(bit)
    if arch == "x86_64":
        assert run_filter(program, 0x40000000 | 39, AUDIT[arch]) == KILL  # x32's getpid
        assert run_filter(program, 0x40000000 | numbers["io_uring_setup"], AUDIT[arch]) == KILL
        assert run_filter(program, -1, AUDIT[arch]) == ALLOW  # no call: the kernel answers ENOSYS
    if ARCH is not None:
        # built once
        assert seccomp.program() == seccomp.build(ARCH) and seccomp.program() is seccomp.program()


def test_seccomp_syscall_numbers_match_the_c_headers():
    headers = {
        "x86_64": ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
        "aarch64": ["/usr/include/asm-generic/unistd.h"],
    }
    # every name spelt as the kernel does
    assert set(seccomp.DENIED) <= set(seccomp.SYSCALLS["x86_64"])
    checked = 0
    for arch, paths in headers.items():
        path = next((p for p in paths if os.path.exists(p)), None)
        if path is None:
            continue
        text = Path(path).read_text()
        defined = {
            m[1]: int(m[2]) for m in re.finditer(r"^#define __NR_(\w+)\s+(\d+)\s*$", text, re.M)
        }
        table = seccomp.SYSCALLS[arch]
        common = set(table) & set(defined)
        assert {name: table[name] for name in common} == {name: defined[name] for name in common}
        # only calls newer than the headers
        assert len(common) >= len(table) - 3, sorted(set(table) - common)
        checked += 1
    if not checked:
        pytest.skip("no kernel headers here (apt-get install -y linux-libc-dev)")


# --------------------------------------------------------------------------
# Set-up errors and the weaker mode
# --------------------------------------------------------------------------


def test_missing_bwrap_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(run_module, "bwrap_path", lambda: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        run("print(1)")


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeout"):
        Limits(timeout=float("nan"))
    with pytest.raises(TypeError, match="unknown sandbox limit"):
        run("print(1)", memmory=1)


def test_process_mode_warns_once_and_still_bounds(caplog):
    run_module._warned.discard("process")
    with caplog.at_level(logging.WARNING, logger="grpo.sandbox.runner"):
        ok = run("print('hi')", isolation="process")
        loop = run(STARTED + "while True:\n    pass\n", isolation="process", timeout=1)
    assert ok.status == "ok" and ok.stdout == "hi\n"
    assert loop.status == "timeout" and "started" in loop.stdout
    warnings = [
        r for r in caplog.records if "WITHOUT filesystem, network or PID isolation" in r.message
    ]
    assert len(warnings) == 1


def test_process_mode_leaves_no_daemon_behind():
    marker = f"grpo-hostile-{secrets.token_hex(4)}"
    r = run(
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['{marker}', '60'])\n    os._exit(0)\nprint('forked')\n",
        isolation="process",
    )
    assert r.status == "ok"
    time.sleep(0.1)
    assert not [p for p in sandbox_processes() if marker in p]


def test_outcomes_are_counted():
    sandbox.take_counts()
    run("print(1)")
    run("import sys; sys.exit(1)")
    assert sandbox.take_counts() == {"ok": 1, "failed": 1}
    assert sandbox.take_counts() == {}
