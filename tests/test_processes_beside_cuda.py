"""Every process grpo starts works beside a trainer that has initialised CUDA, which a process
forked after that cannot use again ("Cannot re-initialize CUDA in forked subprocess"):

- reward workers (grpo.rewards.execution) and the math-equivalence worker
  (grpo.rewards.bounded, for math_answer) are fresh interpreters, `python -c BOOT` through
  subprocess.Popen with no preexec_fn, as safe as multiprocessing's spawn; the keeper's fork
  of a reward worker happens inside that fresh interpreter;
- the chat templates' renderer (grpo.rewards.chat_template) is such a worker too;
- the sandbox's chain (grpo.sandbox.runner) is exec'd at once by subprocess.Popen (no Python
  runs between the fork and the exec);
- process-isolated tool calls (grpo.rollout.tools) are forked from the trainer: grpo's part of
  the child never calls into torch's CUDA (checked with CUDA's initialisation made to raise in
  this process and every fork of it), and a tool that does gets an error naming the fix;
- environments start no process: they run in the trainer's own.

The test harness's `grpo train` children (tests/run/conftest.py) are checked in
tests/run/test_harness.py: they are forks of a forkserver, not of the test process."""

import contextlib
import copy
import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo import sandbox
from grpo.rewards import worker as reward_worker
from grpo.rewards.execution import RewardExecutor
from grpo.rewards.reward_set import resolve
from grpo.rollout import tools
from grpo.rollout.environments import Environments
from grpo.rollout.tools import Tool, ToolCall, ToolRunner

BAD_FORK = (
    "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
    "use the 'spawn' start method"
)
"""torch's error (torch.cuda._lazy_init) in a fork of a process that has initialised CUDA."""


# How a process starts CUDA: lazily, at the first call that needs it, always through
# torch.cuda._lazy_init. torch's Python functions call it by name (torch.cuda.init,
# current_device, synchronize, set_device, get_rng_state, mem_get_info, ...; torch.cuda.memory
# and torch.cuda.random hold references of their own, imported from torch.cuda), and torch's
# C++ calls `torch.cuda._lazy_init` by attribute (torch/csrc/utils/device_lazy_init.cpp) for
# a tensor made on or moved to a CUDA device: torch.zeros(..., device="cuda"), .to("cuda"),
# .cuda(). It is also the one place torch raises BAD_FORK: its fork handler marks a fork of a
# process that initialised CUDA, so that the C++ side calls _lazy_init again there, which
# raises. A fork-unsafe child is therefore one that reaches _lazy_init, and replacing every
# reference to it with a function that records the process and raises BAD_FORK catches every
# such call, on this CPU-only build as on a GPU one, in this process and in every fork of it
# (the replacement is in the memory a fork copies). On a CPU-only build the real _lazy_init
# would raise "Torch not compiled with CUDA enabled" from the same place. Not CUDA's
# initialisation, and not caught: torch.cuda.is_available() and device_count() (NVML or a
# count, no CUDA context), manual_seed_all (queued until CUDA starts), is_initialized().
@contextlib.contextmanager
def _cuda_init_raises(record: Path):
    real = torch.cuda._lazy_init

    def intercepted():
        with open(record, "a") as f:
            f.write(f"{os.getpid()}\n")
        raise RuntimeError(f"{BAD_FORK} [CUDA initialisation intercepted by the test]")

    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "torch" and getattr(module, "_lazy_init", None) is real
    ]
    assert torch.cuda in holders
    for module in holders:
        module._lazy_init = intercepted
    try:
        yield
    finally:
        for module in holders:
            module._lazy_init = real


@pytest.fixture
def cuda_touched(tmp_path):
    """Arms the interception for the test; returns a function giving the pids of the processes
    where CUDA's initialisation was attempted (this one or its forks), one per attempt."""
    record = tmp_path / "cuda-touched"
    record.touch()
    with _cuda_init_raises(record):
        yield lambda: [int(line) for line in record.read_text().split()]


@pytest.fixture
def popens(monkeypatch):
    """The (args, keyword arguments) of every subprocess.Popen started during the test."""
    calls = []

    class Recorded(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            calls.append((list(args), dict(kwargs), rest))
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return calls


def _assert_fresh_interpreters(calls):
    """Each Popen started Python itself on grpo's worker program, with no Python run between
    its fork and its exec."""
    assert calls
    for args, kwargs, rest in calls:
        assert args[0] == sys.executable and args[args.index("-c") + 1] == reward_worker.BOOT
        assert not rest and kwargs.get("preexec_fn") is None


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rfind(")") + 2 :].split()[1])


# ---------------------------------------------------------------- the interception itself


CUDA_CALLS = {
    "torch.zeros(device=cuda)": lambda: torch.zeros(1, device="cuda"),
    "torch.tensor(device=cuda)": lambda: torch.tensor([1.0], device="cuda"),
    ".to(cuda)": lambda: torch.ones(1, device="cpu").to("cuda"),
    ".cuda()": lambda: torch.ones(1, device="cpu").cuda(),
    "torch.cuda.init": torch.cuda.init,
    "torch.cuda.current_device": torch.cuda.current_device,
    "torch.cuda.synchronize": torch.cuda.synchronize,
    "torch.cuda.get_rng_state": torch.cuda.get_rng_state,
    "torch.cuda.mem_get_info": torch.cuda.mem_get_info,
}


def test_a_forked_child_that_starts_cuda_is_caught(cuda_touched):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # each call that would start CUDA, then one that would not
        outcome = {}
        for name, call in CUDA_CALLS.items():
            try:
                call()
                outcome[name] = "returned"
            except RuntimeError as error:
                outcome[name] = "bad fork" if str(error).startswith(BAD_FORK) else str(error)
        outcome["cpu"] = torch.zeros(2, device="cpu").add(1).tolist()
        os.write(write, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        outcome = json.loads(f.read())
    os.waitpid(pid, 0)
    assert outcome == {**dict.fromkeys(CUDA_CALLS, "bad fork"), "cpu": [1.0, 1.0]}
    assert cuda_touched() == [pid] * len(CUDA_CALLS)


# ---------------------------------------------------------------- tools, forked from the trainer


def _tool(function) -> Tool:
    return Tool(function.__name__, function, {"name": function.__name__})


def test_a_forked_tool_call_never_starts_cuda(cuda_touched):
    def add(a: int, b: int) -> str:
        return json.dumps({"sum": a + b, "pid": os.getpid()})

    async def later(x: str) -> str:
        return x * 2

    def fails(x: str) -> str:
        raise ValueError(f"no {x}")

    runner = ToolRunner({t.name: t for t in map(_tool, (add, later, fails))}, 30.0, 1000)
    assert runner.isolation == "process"  # the default: forked
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("later", {"x": "ab"})]
    added, doubled, failed = runner.run([*calls, ToolCall("fails", {"x": "y"})])
    assert json.loads(added.content)["sum"] == 5 and not added.failed
    assert json.loads(added.content)["pid"] != os.getpid()  # it ran in a fork
    assert doubled.content == "abab" and not doubled.failed
    assert failed.failed and failed.content == "error: ValueError: no y"
    assert cuda_touched() == []


class _FreedInAFork:
    """Part of a garbage cycle; freed in a process other than the one that made it, it calls into
    CUDA, as freeing a CUDA tensor of the trainer's would."""

    def __init__(self):
        self.made_in, self.cycle = os.getpid(), self

    def __del__(self):
        if os.getpid() != self.made_in:
            torch.cuda.current_device()


def test_a_forked_tool_call_never_frees_the_trainers_garbage(cuda_touched):
    def collects() -> str:
        return str(gc.collect())

    runner = ToolRunner({"collects": _tool(collects)}, 30.0, 1000)
    gc.collect()
    gc.disable()  # the cycle stays uncollected here until the fork
    try:
        _FreedInAFork()
        (result,) = runner.run([ToolCall("collects", {})])
    finally:
        gc.enable()
    assert not result.failed, result
    assert cuda_touched() == []
    assert gc.collect() > 0  # the cycle was there, and goes here


def test_a_tool_that_uses_cuda_in_its_fork_fails_naming_the_fix(cuda_touched, caplog, monkeypatch):
    monkeypatch.setattr(tools, "_forked_cuda_warned", False)

    def on_gpu(x: int) -> str:
        return str(torch.full((1,), x, device="cuda").item())

    runner = ToolRunner({"on_gpu": _tool(on_gpu)}, 30.0, 1000)
    with caplog.at_level(logging.WARNING, logger=tools.__name__):
        results = runner.run([ToolCall("on_gpu", {"x": 1}), ToolCall("on_gpu", {"x": 2})])
    for result in results:
        assert result.failed and not result.timed_out
        assert result.content.startswith(
            f"error: RuntimeError: {tools.FORKED_CUDA_FIX}: {BAD_FORK}"
        )
        assert "rollout.tool_isolation: thread" in result.content
    (pid_1, pid_2) = cuda_touched()
    assert os.getpid() not in (pid_1, pid_2)  # in the forks, not here
    (warning,) = [r.getMessage() for r in caplog.records]  # once, not per call
    assert "'on_gpu'" in warning and "rollout.tool_isolation: thread" in warning

    # an error that is not torch's forked-CUDA one is passed on as it is
    def other(x: int) -> str:
        raise RuntimeError("CUDA out of memory")

    (result,) = ToolRunner({"other": _tool(other)}, 30.0, 1000).run([ToolCall("other", {"x": 1})])
    assert result.content == "error: RuntimeError: CUDA out of memory"


# ---------------------------------------------------------------- environments: no process


class Counter:
    def reset(self, **row):
        self.pids, self.count = [os.getpid()], 0
        return "count"

    def increment(self, by: int) -> str:
        """Adds to the count.

        Args:
            by: how much
        """
        self.pids.append(os.getpid())
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        self.pids.append(os.getpid())
        return float(self.count)


def test_environments_run_in_the_trainers_process(monkeypatch):
    def no_fork():
        raise AssertionError("a process was forked for an environment")

    monkeypatch.setattr(os, "fork", no_fork)
    environments = Environments(Counter)
    episodes = environments.start([{"prompt": "p"}], 2)
    runner = ToolRunner({}, 30.0, 1000)  # tool_isolation: process
    results = runner.run(
        [ToolCall("increment", {"by": 2}), ToolCall("increment", {"by": 3})],
        [episodes[0].tools, episodes[1].tools],
    )
    assert [r.content for r in results] == ["2", "3"]
    (score,) = environments.reward_functions().values()
    assert score(environments=[e.environment for e in episodes]) == [2.0, 3.0]
    for episode in episodes:
        assert episode.environment.pids == [os.getpid()] * 3


# ---------------------------------------------------------------- reward workers: fresh interpreters


PROBE = """
import json, os, sys

def probe(completions, **kwargs):
    with open({facts!r}, "w") as f:
        json.dump({{"pid": os.getpid(), "ppid": os.getppid(), "torch": "torch" in sys.modules}}, f)
    return [float(len(c)) for c in completions]
"""


def test_reward_workers_are_fresh_interpreters(tmp_path, popens):
    facts = tmp_path / "facts.json"
    (tmp_path / "probe_rewards.py").write_text(PROBE.format(facts=str(facts)))
    _, fn = resolve(f"{tmp_path / 'probe_rewards.py'}:probe")
    executor = RewardExecutor(["probe"], [fn], timeout=60.0, workers=1)
    try:
        completions = ["a", "bcd"]
        inputs = {"prompts": ["p"] * 2, "completions": completions, "completion_ids": [[1]] * 2}
        ((call,),) = executor(inputs, 2)
        assert executor.in_worker(0)
        assert call.status == "ok" and call.values == [1.0, 3.0]
        worker = json.loads(facts.read_text())
        keeper = worker["ppid"]
        _assert_fresh_interpreters(popens)
        assert popens[0][0][:1] == _cmdline(keeper)[:1]
        assert _cmdline(keeper)[_cmdline(keeper).index("-c") + 1] == reward_worker.BOOT
        assert _ppid(keeper) == os.getpid()  # the keeper: this process's child, a new program
        # the worker, forked by the keeper, holds none of this process's state: no torch
        assert "torch" in sys.modules and worker["torch"] is False
    finally:
        executor.close()


def test_the_math_equivalence_worker_is_a_fresh_interpreter(popens):
    pytest.importorskip("math_verify")
    from grpo.rewards.math_answer import MathAnswer

    math_answer = MathAnswer(timeout=30.0)
    try:
        assert math_answer.equal("\\frac{1}{2}", "0.5") and not math_answer.equal("1/3", "0.5")
        process = math_answer._worker._process
        _assert_fresh_interpreters(popens)
        assert _cmdline(process.pid)[_cmdline(process.pid).index("-c") + 1] == reward_worker.BOOT
        assert _ppid(process.pid) == os.getpid()
    finally:
        math_answer.close()


def test_the_chat_template_renderer_is_a_fresh_interpreter(popens, tokenizer):
    """Chat templates render in a worker of their own (grpo.rewards.chat_template), started as
    the reward workers are."""
    from grpo.rewards import chat_template

    chat_template._SHARED.close()  # a worker an earlier test started: this one starts its own
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }};{% endfor %}"
    try:
        [text] = chat_template.render(tokenizer, [[{"role": "user", "content": "hi"}]])
        assert text == "hi;"
        process = chat_template._SHARED.worker.process
        _assert_fresh_interpreters(popens)
        assert _cmdline(process.pid)[_cmdline(process.pid).index("-c") + 1] == reward_worker.BOOT
        assert _ppid(process.pid) == os.getpid()
    finally:
        chat_template._SHARED.close()


# ---------------------------------------------------------------- the sandbox: exec'd at once


def test_the_sandbox_chain_is_execd_with_no_python_before_it(popens, cuda_touched):
    if sandbox.bwrap_path() is None and not os.environ.get("GRPO_REQUIRE_SANDBOX"):
        pytest.skip("bubblewrap is not installed (make test installs it)")
    result = sandbox.run("print(6 * 7)", timeout=30)
    assert result.status == "ok" and result.stdout == "42\n", result
    chain = [args for args, kwargs, rest in popens if args[0] == "/bin/sh"]
    assert chain, popens
    for args, kwargs, rest in popens:  # the chain and bwrap's probes
        assert not rest and kwargs.get("preexec_fn") is None, args
    assert cuda_touched() == []
