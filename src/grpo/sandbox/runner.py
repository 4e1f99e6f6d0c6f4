"""Run one untrusted Python program, isolated and bounded, and report what happened.

    result = run("print(input()[::-1])", stdin="abc\n", timeout=5)
    result.status, result.stdout        # ("ok", "cba\n")

The program runs as this chain of processes, each narrowing the next:

    sh        enters the run's cgroup (hard memory and process limits; grpo.sandbox.cgroups)
    prlimit   address space, CPU seconds, file size, open files, processes; no core dumps
    setpriv   an unprivileged uid of its own (as root), no capabilities, no groups
    bwrap     new user, PID, network, IPC, UTS and cgroup namespaces, and no further user
              namespaces inside them (--disable-userns: no nested root that could mount or
              make namespaces); a filesystem of /usr read-only, a fresh /proc and /dev, a
              private tmpfs /tmp (its working directory), the program bound read-only at
              /sandbox/main.py; an empty environment; a new terminal session; dies with its
              parent. The program is PID 1 of its namespace (so bwrap leaves no orphaned
              init behind to be collected late, whose count would hold against the uid's
              process limit): signals it sends itself without a handler are ignored, as for
              any init. Right before the exec, a seccomp filter (grpo.sandbox.seccomp): the
              calls of io_uring, bpf, perf events, userfaultfd, the keyring, namespaces,
              mounts, modules, ptrace and the like fail with EPERM; other ABIs are killed
    python -I the interpreter, isolated from environment variables and the user site

The chain is started by subprocess.Popen without a preexec_fn: the child forks and at once
execs sh from C (_posixsubprocess), running no Python, and so nothing of torch, in between;
a trainer that initialised CUDA may start it, as it may start any program.

The parent enforces the wall-clock timeout and the output cap, and afterwards
kills whatever is left: the PID namespace ends with its first process, the
cgroup is emptied, and (as root) every process of the run's uid is killed.

Where bubblewrap is missing, `isolation="process"` runs the same chain
without bwrap, and says once, loudly, what that does not isolate; the default
`isolation="bwrap"` refuses instead (SandboxUnavailable names the fix).
"""

from __future__ import annotations

import logging
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from grpo.sandbox import cgroups, seccomp
from grpo.sandbox.counts import record
from grpo.sandbox.limits import Limits

log = logging.getLogger(__name__)

STATUSES = ("ok", "failed", "timeout", "memory", "crashed", "output_limit")
ISOLATIONS = ("bwrap", "process")
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu, as root: apt-get install -y bubblewrap)"

UID_BASE = 1_500_000_000
"""Sandbox uids are UID_BASE + a slot per process id; none of them has an account."""
UID_SLOTS = 64

WORKDIR = "/tmp"
PROGRAM = "/sandbox/main.py"
ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
}


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's fault)."""


class SandboxUnavailable(SandboxError):
    """The requested isolation cannot be had on this machine."""


@dataclass
class SandboxResult:
    status: str
    """ok | failed | timeout | memory | crashed | output_limit"""
    exit_code: int | None
    """The program's exit status; None when it was killed (by a signal, by the parent)."""
    stdout: str
    stderr: str
    duration: float
    """Wall-clock seconds from start to exit."""
    signal: int | None = None
    """The signal that ended the program, if one did."""
    truncated: bool = False
    """Whether stdout or stderr was cut at the output limit."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------
# Tools, interpreter, uids
# --------------------------------------------------------------------------


def _tool(name: str) -> str | None:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/bin/{name}", f"/bin/{name}") if os.access(p, os.X_OK)), None
    )
    return path


def bwrap_path() -> str | None:
    return _tool("bwrap")


class _UidPool:
    """Each concurrent run gets its own uid, so that RLIMIT_NPROC (counted per uid) is per run."""

    def __init__(self):
        self._lock = threading.Condition()
        self._free = list(range(UID_SLOTS))
        self.base = UID_BASE + (os.getpid() % 100_000) * UID_SLOTS

    def take(self) -> int:
        with self._lock:
            while not self._free:
                self._lock.wait()
            return self.base + self._free.pop()

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid - self.base)
            self._lock.notify()


_uids = _UidPool()
_warned: set[str] = set()
_interpreters: dict[tuple, str] = {}
_interpreter_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _as_root() -> bool:
    return os.geteuid() == 0


def _interpreter_prefix(python: str) -> str | None:
    """The installation directory to make visible in the sandbox, when not under /usr."""
    real = os.path.realpath(python)
    if real.startswith("/usr/"):
        return None
    return str(Path(real).parent.parent)


def interpreter(isolation: str = "bwrap", python: str | None = None) -> str:
    """The Python the sandboxed program runs with: `python` when given, else the first
    of this interpreter, /usr/bin/python3 and /usr/local/bin/python3 that actually runs
    in the sandbox (an unprivileged uid cannot enter a 0700 home directory, where a
    virtual environment may live). Probed once per setting."""
    key = (isolation, python)
    with _interpreter_lock:
        if key in _interpreters:
            return _interpreters[key]
        base = getattr(sys, "_base_executable", None) or sys.executable
        candidates = (
            [python]
            if python
            else [os.path.realpath(base), "/usr/bin/python3", "/usr/local/bin/python3"]
        )
        tried = []
        for candidate in dict.fromkeys(c for c in candidates if c):
            if not os.access(candidate, os.X_OK):
                tried.append(f"{candidate}: not an executable")
                continue
            try:
                result = _run(
                    "print(6 * 7)", None, Limits(timeout=30), isolation, candidate, count=False
                )
            except SandboxError as e:
                tried.append(f"{candidate}: {e}")
                continue
            if result.status == "ok" and result.stdout.strip() == "42":
                _interpreters[key] = candidate
                return candidate
            tried.append(f"{candidate}: {result.status} {result.stderr.strip()[-300:]!r}")
        raise SandboxUnavailable(
            "no Python interpreter runs inside the sandbox (tried "
            + "; ".join(tried)
            + "); set sandbox.python to "
            "an interpreter outside any 0700 directory, e.g. /usr/bin/python3 (apt-get install -y python3)"
        )


# --------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------


def _enter_cgroup(paths: list[str]) -> list[str]:
    # The shell writes its own pid into each cgroup, then becomes the next command,
    # so nothing of the run executes outside the cgroup.
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", str(len(paths)), *paths]


def _rlimits(limits: Limits, processes: int) -> list[str]:
    return [
        _tool("prlimit") or "prlimit",
        f"--as={limits.memory}",
        f"--cpu={limits.cpu_limit}",
        f"--fsize={limits.file_size}",
        f"--nofile={limits.open_files}",
        f"--nproc={processes}",
        "--core=0",
        "--",
    ]


def _drop_privileges(uid: int) -> list[str]:
    return [
        _tool("setpriv") or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


_userns_bans: dict[str, bool] = {}


def _userns_ban(bwrap: str) -> bool:
    """Whether this bwrap can ban further user namespaces in the sandbox (--disable-userns:
    bubblewrap 0.8.0 on, and not setuid). Probed once per bwrap."""
    if bwrap not in _userns_bans:
        try:
            setuid = bool(os.stat(bwrap).st_mode & stat.S_ISUID)
            usage = subprocess.run(
                [bwrap, "--help"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            setuid, usage = False, ""
        _userns_bans[bwrap] = "--disable-userns" in usage and not setuid
        if not _userns_bans[bwrap]:
            why = "it is setuid" if setuid else "it is older than 0.8.0"
            if seccomp.program() is not None:
                rest = "the seccomp filter alone denies creating them (unshare, setns, clone with new namespaces)"
            else:
                rest = "nor is there a seccomp filter: programs can create user namespaces and be root in them"
            _warn_once(
                "userns",
                f"sandbox: {bwrap} cannot ban user namespaces in the sandbox ({why}); {rest}",
            )
    return _userns_bans[bwrap]


def _seccomp_filter() -> bytes | None:
    """The seccomp program for bwrap's --seccomp, or None (and a warning, once) where there is none."""
    program = seccomp.program()
    if program is None:
        _warn_once(
            "seccomp",
            f"sandbox: no seccomp filter for this machine ({os.uname().machine}): "
            "sandboxed programs can use io_uring, bpf, perf events, the keyring and other kernel surface",
        )
    return program


def _bwrap(
    limits: Limits, python: str, program_fd: int, status_fd: int, seccomp_fd: int | None
) -> list[str]:
    bwrap = bwrap_path()
    cmd = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    if _userns_ban(bwrap):
        # --unshare-all only tries the user namespace; the ban needs it for certain
        cmd += ["--unshare-user", "--disable-userns"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    for key, value in ENVIRONMENT.items():
        cmd += ["--setenv", key, value]
    cmd += ["--ro-bind", "/usr", "/usr"]  # the root itself is an empty tmpfs, made read-only below
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / top
        if path.is_symlink():
            cmd += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            cmd += ["--ro-bind", str(path), str(path)]
    prefix = _interpreter_prefix(python)
    if prefix:
        cmd += ["--ro-bind", prefix, prefix]
    cmd += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.disk),
        "--tmpfs",
        WORKDIR,
        "--ro-bind-data",
        str(program_fd),
        PROGRAM,
        "--remount-ro",
        "/",
        "--chdir",
        WORKDIR,
        "--cap-drop",
        "ALL",
        "--as-pid-1",
        "--json-status-fd",
        str(status_fd),
        "--",
        python,
        "-I",
        PROGRAM,
    ]
    return cmd


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


def run(
    code: str,
    *,
    stdin: str | None = None,
    isolation: str = "bwrap",
    python: str | None = None,
    limits: Limits | None = None,
    count: bool = True,
    **limit_overrides,
) -> SandboxResult:
    """Run the Python program `code` in the sandbox and report its outcome.

    `stdin` is its standard input (closed when None). Limits come from `limits`
    (grpo.sandbox.Limits) with keyword overrides, e.g. `timeout=2, memory=256 << 20`.
    Raises SandboxUnavailable when the isolation cannot be had, SandboxError when the
    sandbox itself fails; whatever the program does is reported, never raised. `count`: add
    the outcome to the counts of grpo.sandbox.take_counts (the step's `sandbox/<status>`)."""
    limits = (limits or Limits()).with_overrides(**limit_overrides)
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "bwrap" and bwrap_path() is None:
        raise SandboxUnavailable(
            f"the sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL_HINT}, "
            "or set rewards.sandbox.isolation: process for a weaker sandbox without namespaces"
        )
    if isolation == "process":
        _warn_once(
            "process",
            "rewards.sandbox.isolation=process: model-written programs run WITHOUT filesystem, network or "
            "PID isolation (they can read files this user can read, reach the network, and see other "
            "processes; with no seccomp filter, they can create user namespaces and use io_uring, bpf "
            "and the rest of the kernel's surface); only resource limits, a separate uid (as root) and a "
            "scrubbed environment hold. "
            f"For real isolation, {INSTALL_HINT}.",
        )
    return _run(code, stdin, limits, isolation, interpreter(isolation, python), count)


def _run(
    code: str, stdin: str | None, limits: Limits, isolation: str, python: str, count: bool = True
) -> SandboxResult:
    root = _as_root()
    uid = _uids.take() if root else None
    run_cgroup = None
    parents = cgroups.available() if root else None
    if root and parents is None:
        _warn_once(
            "cgroups",
            "sandbox: cgroups are not writable here; memory and process counts are bounded per "
            "process by rlimits only",
        )
    workdir = None
    fds: dict[
        str, int
    ] = {}  # closed exactly once: a second close could hit another thread's reused fd
    stdin_file = None
    try:
        # RLIMIT_NPROC counts the uid's processes and threads: bwrap's monitor, plus the program's.
        processes = limits.processes + 1 if root else _user_processes() + limits.processes + 1
        cmd: list[str] = []
        if parents is not None:
            run_cgroup = cgroups.RunCgroup(
                parents, limits.memory + limits.disk, limits.processes + 1
            )
            cmd += _enter_cgroup(run_cgroup.enter_paths)
        cmd += _rlimits(limits, processes)
        if root:
            cmd += _drop_privileges(uid)
        pass_fds: tuple[int, ...] = ()
        if isolation == "bwrap":
            fds["program"] = os.memfd_create("grpo-sandbox-program")
            os.write(fds["program"], code.encode("utf-8", "surrogatepass"))
            os.lseek(fds["program"], 0, os.SEEK_SET)
            fds["status_r"], fds["status_w"] = os.pipe()
            program = _seccomp_filter()
            if program is not None:
                fds["seccomp"] = os.memfd_create("grpo-sandbox-seccomp")
                os.write(fds["seccomp"], program)
                os.lseek(fds["seccomp"], 0, os.SEEK_SET)
            cmd += _bwrap(limits, python, fds["program"], fds["status_w"], fds.get("seccomp"))
            pass_fds = tuple(
                fds[name] for name in ("program", "status_w", "seccomp") if name in fds
            )
            cwd, env = "/", dict(ENVIRONMENT)
        else:
            workdir = tempfile.mkdtemp(prefix="grpo-sandbox-", dir="/tmp")
            Path(workdir, "main.py").write_text(code, encoding="utf-8", errors="surrogatepass")
            if root:
                os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o755)
            cmd += [python, "-I", str(Path(workdir, "main.py"))]
            cwd, env = workdir, {**ENVIRONMENT, "HOME": workdir}
        if stdin is not None:
            stdin_file = tempfile.TemporaryFile()
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
        result = _supervise(cmd, cwd, env, pass_fds, stdin_file, limits, fds, run_cgroup, isolation)
    finally:
        for fd in fds.values():
            os.close(fd)
        if stdin_file is not None:
            stdin_file.close()
        if run_cgroup is not None:
            run_cgroup.close()
        if uid is not None:
            _kill_uid(uid)
            _uids.give(uid)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if count:
        record(result.status)
    return result


def _supervise(
    cmd, cwd, env, pass_fds, stdin_file, limits, fds, run_cgroup, isolation
) -> SandboxResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            pass_fds=pass_fds,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as e:
        raise SandboxError(f"cannot start the sandbox ({cmd[0]}): {e}") from e
    # our copies: the status pipe ends when bwrap's copy closes
    for name in ("program", "seccomp", "status_w"):
        if name in fds:
            os.close(fds.pop(name))
    status_r = fds.get("status_r")
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    status_text = bytearray()
    deadline = start + limits.timeout
    stopped = None  # why the parent killed it: "timeout" | "output_limit"
    selector = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        selector.register(stream.fileno(), selectors.EVENT_READ)
    if status_r is not None:
        os.set_blocking(status_r, False)
        selector.register(status_r, selectors.EVENT_READ)
    exited_at = None
    try:
        while selector.get_map():
            now = time.monotonic()
            if stopped is None and now > deadline:
                stopped = "timeout"
                _kill(proc)
            if proc.poll() is not None:
                exited_at = exited_at or now
                if (
                    now - exited_at > 0.5
                ):  # a leftover holds a pipe open: it is being killed; stop reading
                    break
            for key, _ in selector.select(timeout=0.05):
                fd = key.fd
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(fd)
                    continue
                if fd == status_r:
                    status_text += chunk
                    continue
                buffer = buffers[fd]
                room = limits.output - len(buffer)
                buffer += chunk[: max(room, 0)]
                if len(chunk) > room and stopped is None:
                    stopped = "output_limit"
                    _kill(proc)
        if stopped is None and proc.poll() is None and time.monotonic() > deadline:
            stopped = "timeout"
        remaining = max(deadline - time.monotonic(), 0) + 1
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            stopped = stopped or "timeout"
            _kill(proc)
            proc.wait()
    finally:
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    duration = time.monotonic() - start
    stdout, stderr = buffers[out_fd], buffers[err_fd]
    code = _program_exit_code(proc.returncode, status_text, isolation, stderr)
    oom = run_cgroup is not None and run_cgroup.oom_killed()
    status, exit_code, sig = _classify(code, stopped, oom, stderr)
    return SandboxResult(
        status,
        exit_code,
        stdout.decode("utf-8", "replace"),
        stderr.decode("utf-8", "replace"),
        duration,
        sig,
        truncated=stopped == "output_limit",
    )


_EXIT = re.compile(rb'"exit-code"\s*:\s*(-?\d+)')


def _program_exit_code(returncode: int, status_text: bytes, isolation: str, stderr: bytes) -> int:
    """The program's exit status in the shell's convention (128 + signal when signalled)."""
    if isolation == "bwrap":
        found = _EXIT.findall(bytes(status_text))
        if found:
            return int(found[-1])
        if (
            returncode is not None and returncode < 0
        ):  # bwrap itself killed (by the parent, or the kernel)
            return 128 - returncode
        # bwrap exited on its own without the program's exit status: it failed to set up
        raise SandboxError(
            f"the sandbox failed before the program started (exit status {returncode}): "
            f"{stderr.decode('utf-8', 'replace').strip()[-500:]}"
        )
    if returncode == 125:
        raise SandboxError("the sandbox could not enter its cgroup (exit status 125)")
    return 128 - returncode if returncode < 0 else returncode


def _classify(
    code: int, stopped: str | None, oom: bool, stderr: bytes
) -> tuple[str, int | None, int | None]:
    sig = code - 128 if code > 128 else None
    exit_code = None if sig is not None else code
    last_line = stderr.rstrip().rsplit(b"\n", 1)[-1]
    if stopped is not None:
        return stopped, None, signal.SIGKILL
    if oom or last_line.startswith(b"MemoryError"):
        return "memory", exit_code, sig
    if sig in (
        signal.SIGXCPU,
        signal.SIGKILL,
    ):  # the CPU limit: SIGXCPU at the soft, SIGKILL at the hard limit
        return "timeout", None, sig
    if (
        sig == signal.SIGXFSZ
        or b"No space left on device" in last_line
        or b"File too large" in last_line
    ):
        return "output_limit", exit_code, sig
    if sig is not None:
        return "crashed", None, sig
    return ("ok" if code == 0 else "failed"), code, None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def _kill_uid(uid: int) -> None:
    """Kill every process of the run's uid (none should be left; this is the last line of
    defence). Zombies are skipped: they have exited already, and wait to be collected."""
    for _ in range(3):
        killed = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if (
                    entry.stat().st_uid != uid
                ):  # /proc/<pid> belongs to the process's uid: a cheap first look
                    continue
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get(
                "State", ""
            ).strip().startswith("Z"):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    pass
        if not killed:
            return
        time.sleep(0.01)


def _user_processes() -> int:
    uid = str(os.getuid())
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "status").read_text().split("Uid:")[1].split()[0] == uid:
                    count += 1
            except (OSError, IndexError):
                pass
    return count
