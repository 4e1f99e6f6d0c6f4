"""Reward worker processes kept apart from the trainer (grpo.rewards.worker): what a function
starts dies with its worker, what it prints is captured, capped and escaped, its memory is
limited, and `os.kill(os.getppid(), 9)` costs a worker, not the trainer."""

import logging
import os
import signal
import time

import pytest

from grpo.rewards.execution import OUTPUT_LIMIT, RewardExecutor, escaped
from grpo.rewards.reward_set import resolve
from grpo.rewards.worker import descendants, kill_tree

REWARDS = r'''
import os, signal, sys, time

def daemon(completions, pidfile, **kw):
    """Leaves a double-forked daemon in a session of its own (its pid in `pidfile`), then returns
    or, on "hang", hangs."""
    if os.fork() == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                with open(pidfile[0] + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(pidfile[0] + ".tmp", pidfile[0])
                time.sleep(1000)
        finally:
            os._exit(0)
    os.wait()
    while not os.path.exists(pidfile[0]):
        time.sleep(0.01)
    if "hang" in completions:
        time.sleep(1000)
    return [1.0] * len(completions)

def noisy(completions, **kw):
    if "loud" in completions:
        sys.stdout.write("\x1b[2Jcleared \u202eevil\n" + "x" * (1 << 20))
        sys.stderr.write("to stderr\n")
    return [0.0] * len(completions)

def greedy(completions, mib, **kw):
    if mib[0]:
        block = bytearray(mib[0] << 20)
    return [float(os.getpid())] * len(completions)

def kills_parent(completions, **kw):
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(10)
    return [0.0] * len(completions)

def where(completions, **kw):
    return [float(os.getpid()), float(os.getppid()), float(os.getsid(0)), float(os.getpgid(0))]
'''


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "worker_rewards.py"
    path.write_text(REWARDS)
    return lambda *names: [resolve(f"{path}:{name}")[1] for name in names]


def _inputs(completions, **columns):
    n = len(completions)
    return {
        "prompts": ["p"] * n,
        "completions": list(completions),
        "completion_ids": [[1]] * n,
        **columns,
    }


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] in "ZX"
    except OSError:
        return True


def test_a_daemon_a_function_leaves_dies_with_its_worker(fns, tmp_path):
    """A double-forked daemon in a session of its own stays under the worker's keeper (a child
    subreaper): killed when the worker is closed, and when its worker is killed after a timeout."""
    executor = RewardExecutor(["daemon"], fns("daemon"), timeout=1.0, workers=1)
    try:
        ((call,),) = executor(_inputs(["a"], pidfile=[str(tmp_path / "closed")]), 1)
        assert call.status == "ok"
        closed = int((tmp_path / "closed").read_text())
        assert not _dead(closed) and os.getsid(closed) != os.getsid(0)
        ((call,),) = executor(_inputs(["hang"], pidfile=[str(tmp_path / "hung")]), 1)
        assert call.status == "timeout"
        hung = int((tmp_path / "hung").read_text())
        assert _dead(hung)  # killed with its worker, which was replaced
    finally:
        executor.close()
    assert _dead(closed)


def test_output_is_captured_capped_escaped_and_shown_once(fns, caplog, capfd):
    executor = RewardExecutor(["noisy"], fns("noisy"), workers=1)
    try:
        with caplog.at_level(logging.WARNING, logger="grpo.rewards.execution"):
            executor(_inputs(["loud"]), 1)
            executor(_inputs(["quiet"]), 1)  # nothing printed: nothing shown again
    finally:
        executor.close()
    (shown,) = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert "\\x1b[2Jcleared \\u202eevil" in shown and "\x1b" not in shown and "\u202e" not in shown
    printed = len("\x1b[2Jcleared \u202eevil\n".encode()) + (1 << 20) + len("to stderr\n")
    assert f"(... {printed - OUTPUT_LIMIT} bytes more dropped)" in shown
    assert shown.count("x") <= OUTPUT_LIMIT and len(shown) < OUTPUT_LIMIT + 1000
    out, err = capfd.readouterr()
    assert "cleared" not in out + err and "to stderr" not in out + err  # never raw on the console


def test_escaped():
    assert escaped("a\tb\nc\x1b[0m\r\x00\u202e\u00e9") == "a\tb\nc\\x1b[0m\\r\\x00\\u202e\u00e9"


def test_memory_past_the_limit_fails_the_call_not_the_worker(fns):
    executor = RewardExecutor(["greedy"], fns("greedy"), workers=1, memory_mb=200)
    try:
        ((small,),) = executor(_inputs(["a"], mib=[50]), 1)
        ((big,),) = executor(_inputs(["a"], mib=[400]), 1)  # twice the limit
        ((after,),) = executor(_inputs(["a"], mib=[0]), 1)
    finally:
        executor.close()
    assert small.status == "ok"
    assert (
        big.status == "error"
        and "MemoryError" in big.message
        and "limited to 200 MiB" in big.message
    )
    assert after.status == "ok" and after.values == small.values  # the same worker goes on


def test_a_worker_cannot_kill_the_trainer_through_getppid(fns):
    """The worker's parent is its keeper: killing it costs the worker (a crashed call, replaced);
    the worker leads no group of the trainer's and is in another session."""
    executor = RewardExecutor(
        ["kills_parent", "where"], fns("kills_parent", "where"), timeout=10, workers=2
    )
    try:
        kill, here = executor(_inputs(["a", "b", "c", "d"]), 4)
        (again,) = executor(_inputs(["a", "b", "c", "d"]), 4)[1]
    finally:
        executor.close()
    assert [c.status for c in kill] == ["crashed"] and "died" in kill[0].message
    pid, ppid, sid, pgid = (int(v) for v in here[0].values)
    assert ppid != os.getpid() and sid != os.getsid(0) and pgid != os.getpgid(0) and pgid == sid
    assert again.status == "ok"


def test_kill_tree_kills_the_descendants_not_the_root():
    root = os.fork()
    if root == 0:
        try:
            if os.fork() == 0:
                time.sleep(30)
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while not descendants(root) and time.monotonic() < deadline:
            time.sleep(0.01)
        (grandchild,) = descendants(root)
        assert os.getpid() not in descendants(os.getppid())  # never the caller itself
        kill_tree(root)
        assert _dead(grandchild) and not _dead(root)
    finally:
        os.kill(root, signal.SIGKILL)
        os.waitpid(root, 0)
