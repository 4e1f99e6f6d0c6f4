"""What tools and environments start ends with them: a process-isolated tool call's processes
(a double-forked daemon in a session of its own included) when the call returns or times out,
an environment's when training ends; what the test process started before training is left
alone (grpo.rollout.tools, grpo.rollout.environments.Leftovers)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from grpo.rewards.worker import kill_tree, process_start
from grpo.rollout import tool_memory
from grpo.rollout.tools import Tool, ToolCall, ToolRunner

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="subreapers and /proc are Linux's"
)


def daemonize(pid_dir) -> int:
    """Double-forks a daemon in a session of its own (fork, setsid, fork, the middle one exits)
    that records its pid in `pid_dir` and sleeps 60 s; its pid."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            os.setsid()
            if os.fork() == 0:
                pid = os.getpid()
                open(os.path.join(pid_dir, str(pid)), "w").close()
                os.write(write, f"{pid}\n".encode())
                os.close(write)
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    with os.fdopen(read) as f:
        return int(f.readline())


def daemons(pid_dir) -> list[int]:
    return sorted(int(n) for n in os.listdir(pid_dir) if n.isdigit())


def alive(pid: int) -> bool:
    return process_start(pid) is not None  # a zombie is dead


def kill_all(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_kill_tree_reaches_a_session_member_that_left_the_tree(tmp_path):
    """What a session leader orphaned (init's now, no longer its descendant) is found by the
    session's id while the leader is unreaped: the session id is read from /proc's stat."""
    read, write = os.pipe()
    leader = os.fork()
    if leader == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                os.write(write, f"{os.getpid()}\n".encode())
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        member = int(f.readline())
    try:
        os.waitid(os.P_PID, leader, os.WEXITED | os.WNOWAIT)  # ended, not reaped
        assert alive(member)
        kill_tree(leader, session=leader)
        deadline = time.monotonic() + 5
        while alive(member) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(member)
    finally:
        os.waitpid(leader, 0)
        kill_all([member])


def tool_runner(function, timeout=10.0) -> ToolRunner:
    return ToolRunner({"start": Tool("start", function, {})}, timeout, 1000, "process")


def test_a_forked_tools_daemon_and_child_end_when_its_call_returns(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def start() -> str:
        # a child left running, and a daemon of its own session: neither outlives the call
        sleeper = subprocess.Popen(["sleep", "60"])
        (pid_dir / f"{sleeper.pid}").write_text("")
        daemonize(pid_dir)
        return "started"

    try:
        (result,) = tool_runner(start).run([ToolCall("start", {})])
        pids = daemons(pid_dir)
        assert len(pids) == 2
        assert [pid for pid in pids if alive(pid)] == []
        # and the call returned at once: no daemon held its result's pipe open to the timeout
        assert (result.content, result.failed) == ("started", False)
    finally:
        kill_all(daemons(pid_dir))


def test_a_forked_tools_daemon_ends_when_its_call_times_out(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def start() -> str:
        daemonize(pid_dir)
        time.sleep(60)  # hangs: killed at the timeout
        return "never"

    try:
        (result,) = tool_runner(start, timeout=1.5).run([ToolCall("start", {})])
        assert result.timed_out
        (pid,) = daemons(pid_dir)
        assert not alive(pid)
    finally:
        kill_all(daemons(pid_dir))


def test_a_daemon_of_a_forked_call_that_dies_without_a_result_ends_with_its_cgroup(tmp_path):
    """A daemon in a session of its own, left by a tool whose process then exits at once
    (os._exit): neither the call's process nor the trainer can reach it by its tree or session
    any more (it is init's), but it is in the call's cgroup, which is emptied when the call
    ends (here at the timeout: the daemon holds the result's pipe open)."""
    if not tool_memory.cgroups_usable():
        if os.environ.get("GRPO_REQUIRE_SANDBOX"):
            pytest.fail("a forked call gets no cgroup here (GRPO_REQUIRE_SANDBOX is set)")
        pytest.skip("a forked call gets a cgroup as root with a writable cgroup hierarchy only")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def start() -> str:
        daemonize(pid_dir)
        os._exit(0)

    try:
        (result,) = tool_runner(start, timeout=1.5).run([ToolCall("start", {})])
        assert result.timed_out
        (pid,) = daemons(pid_dir)
        deadline = time.monotonic() + 5  # killed; init reaps it
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(pid)
    finally:
        kill_all(daemons(pid_dir))


class DaemonEnvironment:
    """Each reset starts a double-forked daemon and leaves a child running (pids in `pid_dir`)."""

    pid_dir = None

    def reset(self, **row):
        daemonize(DaemonEnvironment.pid_dir)
        sleeper = subprocess.Popen(["sleep", "60"])
        open(os.path.join(DaemonEnvironment.pid_dir, str(sleeper.pid)), "w").close()
        return None


TOY = [
    "data.chat_template=auto",
    "rollout.num_generations=2",
    "rollout.max_completion_length=4",
    "training.per_device_train_batch_size=4",
    "training.max_steps=1",
    "eval.before=false",
    "eval.after=false",
]


def test_an_environments_daemons_end_when_training_ends_and_earlier_processes_stay(
    tool_tokenizer, make_trainer, tmp_path
):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    DaemonEnvironment.pid_dir = str(pid_dir)
    # what this process started before training: never the environment's
    before = subprocess.Popen(["sleep", "60"])
    try:
        trainer = make_trainer(
            tool_tokenizer, tmp_path, TOY, hidden=32, environment_factory=DaemonEnvironment
        )
        first = daemonize(pid_dir)  # a daemon of this test's, not of the environment's
        started_before = set(daemons(pid_dir))
        trainer.train()
        made = set(daemons(pid_dir)) - started_before
        assert len(made) == 8  # a daemon and a child per completion's reset
        assert [pid for pid in made if alive(pid)] == []
        assert alive(before.pid) and alive(first)
    finally:
        before.kill()
        before.wait()
        kill_all(daemons(pid_dir))
