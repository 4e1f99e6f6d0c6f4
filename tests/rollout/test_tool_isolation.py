"""What a process-isolated tool call cannot do to the run that calls it: signal (or limit) the
trainer, its process group or any process that existed before the call (grpo.sandbox.
signal_guard's filter), or take memory past rollout.tool_memory_mb (an error as the call's
result, the run going on)."""

import ctypes
import errno
import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import threading

import pytest

from grpo.config import loading as config
from grpo.rollout import tool_memory
from grpo.rollout.tools import ToolCall, ToolRunner, as_tool
from grpo.run import runlog

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="seccomp filters and RLIMIT_DATA are Linux's"
)


def probe(bystander: int) -> str:
    """Tries what would stop the trainer, with signal 0 (the kernel checks the right to signal
    and sends nothing), and what a tool may do to its own processes.

    Args:
        bystander: A process that existed before the call.
    """
    outcome = {}

    def attempt(name, action):
        try:
            action()
            outcome[name] = "allowed"
        except OSError as error:
            outcome[name] = errno.errorcode[error.errno]

    trainer = os.getppid()
    read, _ = os.pipe()
    attempt("kill the trainer", lambda: os.kill(trainer, 0))
    attempt("kill the trainer's group", lambda: os.killpg(os.getpgid(trainer), 0))
    attempt("kill every process", lambda: os.kill(-1, 0))
    attempt("kill a bystander", lambda: os.kill(bystander, 0))
    # kill with one of its threads' ids signals the whole trainer
    threads = [int(t) for t in os.listdir(f"/proc/{trainer}/task") if int(t) != trainer]
    for tid in threads:
        attempt(f"kill the trainer's thread {tid}", lambda tid=tid: os.kill(tid, 0))
    outcome["threads"] = len(threads)
    attempt("limit the trainer", lambda: resource.prlimit(trainer, resource.RLIMIT_CPU))
    attempt("own the trainer's I/O signals", lambda: fcntl.fcntl(read, fcntl.F_SETOWN, trainer))
    attempt("kill itself", lambda: os.kill(os.getpid(), 0))
    attempt("kill its own group", lambda: os.killpg(0, 0))
    child = subprocess.Popen(["sleep", "30"])
    attempt("kill its child", child.kill)
    child.wait()
    return json.dumps(outcome)


def test_a_forked_call_cannot_signal_the_processes_that_existed_before_it():
    bystander = subprocess.Popen(["sleep", "30"])
    done = threading.Event()
    waiting = threading.Thread(target=done.wait, daemon=True)  # the trainer has a thread or more
    waiting.start()
    try:
        runner = ToolRunner({"probe": as_tool(probe)}, 20.0, 10_000, "process")
        (result,) = runner.run([ToolCall("probe", {"bystander": bystander.pid})])
    finally:
        done.set()
        bystander.kill()
        bystander.wait()
    assert not result.failed, result.content
    outcome = json.loads(result.content)
    assert outcome.pop("threads") >= 1
    assert outcome.pop(f"kill the trainer's thread {waiting.native_id}") == "EPERM"
    for name in [name for name in outcome if name.startswith("kill the trainer's thread")]:
        assert outcome.pop(name) in ("EPERM", "ESRCH")  # refused, or the thread has ended
    assert outcome == {
        "kill the trainer": "EPERM",
        "kill the trainer's group": "EPERM",
        "kill every process": "EPERM",
        "kill a bystander": "EPERM",
        "limit the trainer": "EPERM",
        "own the trainer's I/O signals": "EPERM",
        "kill itself": "allowed",
        "kill its own group": "allowed",
        "kill its child": "allowed",
    }


def hog(mib: int) -> str:
    """Holds `mib` MiB, written to, one MiB at a time.

    Args:
        mib: How many MiB.
    """
    held = [bytearray(1 << 20) for _ in range(mib)]
    return f"held {len(held)} MiB"


def grab(mib: int) -> str:
    """Holds `mib` MiB, written to, in one allocation.

    Args:
        mib: How many MiB.
    """
    return f"held {len(bytearray(mib << 20)) >> 20} MiB"


def test_a_forked_call_past_its_memory_limit_gets_an_error_and_the_next_call_runs():
    """One allocation of 256 MiB with a limit of 32: glibc maps it on its own (no free block of
    the trainer's heap is that large), so it grows the call's data size and RLIMIT_DATA refuses
    it, with or without the call's cgroup."""
    runner = ToolRunner({"grab": as_tool(grab)}, 20.0, 1000, "process", memory_mb=32)
    small, large, again = runner.run(
        [ToolCall("grab", {"mib": 8}), ToolCall("grab", {"mib": 256}), ToolCall("grab", {"mib": 8})]
    )
    assert (small.content, small.failed) == ("held 8 MiB", False)
    assert large.failed and not large.timed_out
    assert large.content.startswith(
        "error: MemoryError: the call went past its memory limit, 32 MiB beyond what it shares"
    ), large.content
    assert "rollout.tool_memory_mb" in large.content
    assert (again.content, again.failed) == ("held 8 MiB", False)
    # and the limit is the call's, not the trainer's
    assert resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY


def _require_call_cgroups() -> None:
    if not tool_memory.cgroups_usable():
        if os.environ.get("GRPO_REQUIRE_SANDBOX"):
            pytest.fail("a forked call gets no cgroup here (GRPO_REQUIRE_SANDBOX is set)")
        pytest.skip("a forked call gets a cgroup as root with a writable cgroup hierarchy only")


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc 2.33 and later)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


FREED_CHUNKS = 160
"""Chunks of 1.25 MiB a long-lived trainer has freed, each between two it holds."""


def _calls_beside_a_freed_heap(calls: list[ToolCall], memory_mb: int) -> dict:
    """`calls` run by a ToolRunner in a fork of this process whose heap first holds what a
    long-lived trainer's does: memory it freed that glibc keeps mapped for reuse (1.25 MiB chunks
    from the heap, each between two still held, so that none is returned), which a call's 1 MiB
    allocations take without growing its data size; and how much such memory the heap holds
    (glibc's mallinfo2: free bytes in its heaps). The fork, so that this process's heap and
    glibc's thresholds stay as they were."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
            libc.mallinfo2.restype = _MallInfo2
            # freeing a mapped 16 MiB block raises glibc's mmap threshold past it, so that the
            # chunks below come from the heap
            libc.free(libc.malloc(16 << 20))
            chunks = [libc.malloc(5 << 18) for _ in range(2 * FREED_CHUNKS)]
            for chunk in chunks[::2]:
                libc.free(chunk)
            free_mib = libc.mallinfo2().fordblks >> 20
            runner = ToolRunner({"hog": as_tool(hog)}, 20.0, 1000, "process", memory_mb=memory_mb)
            results = [r.__dict__ for r in runner.run(calls)]
            os.write(write, json.dumps({"free_mib": free_mib, "results": results}).encode())
        except BaseException as error:
            os.write(write, json.dumps({"error": repr(error)}).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_a_forked_call_is_held_to_its_limit_whatever_the_trainer_freed_before_it():
    """A call that writes 128 MiB in 1 MiB pieces with a limit of 32, forked from a trainer whose
    heap holds 200 MiB it freed: RLIMIT_DATA alone let it through (those pieces reuse the
    trainer's freed chunks, and its data size does not grow); its cgroup counts every page it
    writes and ends it at the limit."""
    _require_call_cgroups()
    seen = _calls_beside_a_freed_heap(
        [ToolCall("hog", {"mib": 128}), ToolCall("hog", {"mib": 8})], memory_mb=32
    )
    assert "error" not in seen, seen
    # the freed chunks are still the heap's: room for the call's 128 MiB
    assert seen["free_mib"] >= FREED_CHUNKS * 1.25, seen["free_mib"]
    large, again = seen["results"]
    assert large["failed"] and not large["timed_out"]
    assert large["content"].startswith(
        "error: MemoryError: the call went past its memory limit, 32 MiB of memory written "
        "(rollout.tool_memory_mb)"
    ), large["content"]
    assert (again["content"], again["failed"]) == ("held 8 MiB", False)


def test_the_memory_limit_is_a_checked_key():
    with pytest.raises(Exception, match=r"rollout.tool_memory_mb: must be in \[0, 1048576\] MiB"):
        config.from_dict({"output_dir": "x", "rollout": {"tool_memory_mb": -1}})
    assert config.from_dict({"output_dir": "x"}).rollout.tool_memory_mb == 1024


GRAB_CALL = '<tool_call>{"name": "grab", "arguments": {"mib": 256}}</tool_call>'


def test_a_tool_past_its_memory_limit_fails_its_calls_and_the_run_goes_on(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls, monkeypatch
):
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)  # plots: not what is tested
    overrides = [
        "data.chat_template=auto",
        "rollout.num_generations=2",
        "rollout.max_completion_length=200",
        "rollout.tool_isolation=process",
        "rollout.tool_memory_mb=32",
        "rollout.tool_output_chars=40",  # the error's start, with room for a reply after it
        "training.per_device_train_batch_size=4",
        "training.max_steps=2",
    ]
    trainer = make_trainer(tool_tokenizer, tmp_path, overrides, hidden=32, tools=[grab])
    trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, GRAB_CALL)
    history = trainer.train()
    assert len(history) == 2
    for metrics in history:
        assert metrics["tools/call_frequency"] == 1.0  # each completion's first turn calls it
        assert metrics["tools/failure_frequency"] == 1.0  # and every call failed
    rows = trainer.task.train_rows[:2]
    rollout = trainer.engine.generate(trainer.sampler.prompts(rows), 2, trainer.sampling, [3, 4])
    for turns in rollout.messages:
        assert turns[1]["role"] == "tool"
        assert turns[1]["content"].startswith("error: MemoryError:"), turns[1]["content"]


def signaller(key: str) -> str:
    """Sends SIGTERM to the trainer and to its process group, and notes what the kernel said.

    Args:
        key: Anything.
    """
    outcome = []
    trainer = os.getppid()
    for name, send in (
        ("kill", lambda: os.kill(trainer, signal.SIGTERM)),
        ("killpg", lambda: os.killpg(os.getpgid(trainer), signal.SIGTERM)),
    ):
        try:
            send()
            outcome.append(f"{name}: sent")
        except OSError as error:
            outcome.append(f"{name}: {error.strerror}")
    with open(os.environ["SIGNALLER_NOTES"], "a") as f:
        f.write("; ".join(outcome) + "\n")
    return "1"


SIGNALLER_CALL = '<tool_call>{"name": "signaller", "arguments": {"key": "a"}}</tool_call>'


def test_a_tool_that_sigterms_the_trainer_and_its_group_cannot_stop_the_run(
    tool_tokenizer, make_trainer, tmp_path, ForcedCalls, monkeypatch
):
    """A 2-step run whose every completion calls a tool that sends SIGTERM to the trainer and to
    the trainer's process group. The run is trained in a fork of this process that leads a
    session of its own, so that those signals can reach nothing else. Without the filter the
    first SIGTERM asked the run to stop after its step and the second stopped it at once,
    without a checkpoint (grpo.run.stop_signals); with it every signal is refused, and the run
    ends its steps and writes final/."""
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)  # plots: not what is tested
    notes = tmp_path / "attempts.txt"
    monkeypatch.setenv("SIGNALLER_NOTES", str(notes))
    overrides = [
        "data.chat_template=auto",
        "rollout.num_generations=2",
        "rollout.max_completion_length=140",
        "rollout.tool_isolation=process",
        "training.device=cpu",  # the fork below may not use CUDA the test process initialised
        "training.per_device_train_batch_size=4",
        "training.max_steps=2",
    ]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the trainer: trains, writes what came of it, and ends without pytest's cleanup
        code = 1
        try:
            os.close(read)
            os.setsid()
            trainer = make_trainer(
                tool_tokenizer, tmp_path, overrides, hidden=32, tools=[signaller]
            )
            trainer.engine.inner = ForcedCalls(trainer.engine.inner, tool_tokenizer, SIGNALLER_CALL)
            history = trainer.train()
            outcome = {
                "steps": [row.get("step") for row in history],
                "stopped_by": trainer.stopped_by,
            }
            code = 0
        except BaseException as error:
            outcome = {"error": repr(error)}
        finally:
            try:
                os.write(write, json.dumps(outcome).encode())
            finally:
                os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        outcome = json.loads(f.read() or "{}")
    _, status = os.waitpid(pid, 0)
    attempts = notes.read_text().splitlines()
    assert len(attempts) == 8  # 4 completions a step, each calling the tool in its first turn
    assert set(attempts) == {"kill: Operation not permitted; killpg: Operation not permitted"}
    assert outcome == {"steps": [1, 2], "stopped_by": None}
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "run" / "final").is_dir()
