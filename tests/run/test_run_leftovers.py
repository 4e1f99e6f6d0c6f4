"""`grpo train` leaves nothing behind: after a run whose environment's reset and process-isolated
tool double-fork daemons and run a sandboxed program, no process descended from the run is
alive (this process is a subreaper meanwhile, so the run's orphans stay its descendants) and
no cgroup the run made remains (the cgroup part only where cgroups can be written, as the
sandbox's tests)."""

import os
import signal
import sys

import pytest

from grpo.rewards.worker import children, descendants, process_start, set_child_subreaper
from grpo.sandbox import cgroups

pytestmark = [
    pytest.mark.usefixtures("quick"),
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="subreapers and /proc are Linux's"
    ),
]

ENVIRONMENT = '''
import os
import time

from grpo import sandbox
from grpo.rollout.tools import Tool, ToolCall, ToolRunner

PIDS = os.environ["GRPO_TEST_PIDS"]


def daemonize():
    """Fork, setsid, fork, the middle one exits: a daemon that records its pid and sleeps 60 s."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read)
            os.setsid()
            if os.fork() == 0:
                open(os.path.join(PIDS, str(os.getpid())), "w").close()
                os.write(write, b"up")
                os.close(write)
                time.sleep(60)
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(middle, 0)
    with os.fdopen(read, "rb") as f:
        f.read(2)


def start_daemon() -> str:
    daemonize()
    return "started"


class DaemonEnvironment:
    first = True

    def reset(self, **row):
        daemonize()
        if DaemonEnvironment.first:
            DaemonEnvironment.first = False
            # a tiny random model writes no tool call: the call one would make, as the run's
            # multi-turn engine runs it (process isolation, forked from the run)
            runner = ToolRunner({"start_daemon": Tool("start_daemon", start_daemon, {})}, 3.0, 100)
            runner.run([ToolCall("start_daemon", {})])
            # a sandboxed program, as a code reward runs one: its cgroup, where cgroups work
            isolation = "bwrap" if sandbox.bwrap_path() else "process"
            assert sandbox.run("print(1)", isolation=isolation).stdout == "1\\n"
        return None
'''


def _adopted(before: set[int]) -> list[int]:
    """This process's living descendants but those in `before`; zombies among its new children reaped."""
    for pid in children(os.getpid()) - before:
        if process_start(pid) is None:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return sorted(set(descendants(os.getpid())) - before)


def test_a_run_whose_tool_and_environment_start_daemons_leaves_no_process_or_cgroup(
    tmp_path, monkeypatch, write_config, start_grpo
):
    (tmp_path / "daemon_environment.py").write_text(ENVIRONMENT)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("GRPO_TEST_PIDS", str(pids))
    parents = cgroups.available()  # probed here, before the run (the probe removes its own)
    if parents is None and os.environ.get("GRPO_REQUIRE_SANDBOX"):
        pytest.fail("cgroups are not writable here (GRPO_REQUIRE_SANDBOX is set)")
    config = write_config(
        tmp_path,
        "run",
        [
            f"rollout.environment={tmp_path / 'daemon_environment.py'}:DaemonEnvironment",
            "rollout.num_generations=2",
            "rollout.tool_timeout=30",  # reset's time limit: the tool call's own is 3 s
            "training.per_device_train_batch_size=4",
            "training.max_steps=1",
            "training.save_steps=0",
            "eval.every=0",
            "eval.after=false",
            "logging.sample_every=0",
        ],
    )
    # this process a subreaper for the test: what the run orphans becomes this process's, not
    # init's, so that every process descended from the run is among this process's descendants
    assert set_child_subreaper(True)
    before = set(descendants(os.getpid()))  # the forkserver and its own
    process = start_grpo(["train", str(config)])
    try:
        process.join(120)
        assert process.exitcode == 0
        started = sorted(int(n) for n in os.listdir(pids))
        assert len(started) == 5  # one per completion's reset, one by the tool call
        assert _adopted(before | {process.pid}) == []  # not those, nor any other of the run's
        if parents is not None:
            for parent in parents:
                # the run's own cgroups are gone, and the parent with them unless another run's
                # cgroup is in it (a parent at the hierarchy's root is every process's: others'
                # runs may be using it)
                assert not list(parent.glob(f"run-{process.pid}-*"))
                if parent.parent not in (
                    cgroups.ROOT,
                    cgroups.ROOT / "memory",
                    cgroups.ROOT / "pids",
                ):
                    assert not parent.exists() or any(parent.glob("run-*")), parent
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        for pid in _adopted(before):
            os.kill(pid, signal.SIGKILL)
        set_child_subreaper(False)
        _adopted(before)  # the killed ones reaped
