"""Reward execution (grpo.rewards.execution): every call bounded in time, failures contained
to the completions of the failing call, functions and chunks run side by side, and the
training run goes on whatever a reward function does."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.models.tiny import tiny_model
from grpo.rewards.arithmetic import arithmetic_format
from grpo.rewards.execution import RewardExecutor
from grpo.rewards.reward_set import RewardSet, resolve
from grpo.sandbox.counts import record
from grpo.training.trainer import Trainer

REWARDS = """
import asyncio, os, sys, time

def length(completions, **kw):
    return [float(len(c)) for c in completions]

def raises_on_x(completions, **kw):
    if any("x" in c for c in completions):
        raise ValueError("a completion with an x")
    return [1.0] * len(completions)

def raises_on_poison(completions, poison, **kw):
    if any(poison):
        raise ValueError("poisoned row")
    return [0.5] * len(completions)

def hangs(completions, **kw):
    time.sleep(1e6)

def sys_exits(completions, **kw):
    sys.exit(3)

def hard_exits(completions, **kw):
    os._exit(1)

def too_short(completions, **kw):
    return [1.0]

async def awaited(completions, **kw):
    await asyncio.sleep(0.01)
    return [2.0] * len(completions)

def sleeps(completions, **kw):
    time.sleep(0.5)
    return [0.0] * len(completions)

def pid_unless_hang(completions, **kw):
    if "hang" in completions:
        time.sleep(1e6)
    return [float(os.getpid())] * len(completions)
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture
def fns(reward_file):
    return lambda *names: [resolve(f"{reward_file}:{name}")[1] for name in names]


def _inputs(completions):
    n = len(completions)
    return {"prompts": ["p"] * n, "completions": list(completions), "completion_ids": [[1]] * n}


def _run(names, funcs, completions, **kwargs):
    executor = RewardExecutor(names, funcs, **kwargs)
    try:
        return executor, executor(_inputs(completions), len(completions))
    finally:
        executor.close()


def test_each_failure_is_contained_and_reported(fns):
    names = ["length", "raises_on_x", "hangs", "sys_exits", "hard_exits", "too_short", "awaited"]
    completions = ["a", "bb", "x", "dddd"]
    start = time.monotonic()
    executor, calls = _run(names, fns(*names), completions, timeout=1.0, workers=3)
    assert time.monotonic() - start < 10  # the hang cost its timeout, not forever
    by_name = {name: c for name, (c,) in zip(names, calls)}
    assert all(executor.in_worker(k) for k in range(len(names)))
    assert by_name["length"].status == "ok" and by_name["length"].values == [1.0, 2.0, 1.0, 4.0]
    assert by_name["awaited"].status == "ok" and by_name["awaited"].values == [2.0] * 4
    raised = by_name["raises_on_x"]
    assert raised.status == "error" and raised.values is None
    # the worker's traceback
    assert "Traceback" in raised.message and "raises_on_x" in raised.message
    assert "ValueError: a completion with an x" in raised.message
    assert by_name["hangs"].status == "timeout" and "1 s" in by_name["hangs"].message
    assert (
        by_name["sys_exits"].status == "error" and "SystemExit: 3" in by_name["sys_exits"].message
    )
    assert (
        by_name["hard_exits"].status == "crashed" and "exit code 1" in by_name["hard_exits"].message
    )
    assert by_name["too_short"].status == "error"
    assert (
        "expected a list of 4 floats or None, got list of length 1" in by_name["too_short"].message
    )


def test_a_failing_chunk_loses_only_its_completions(fns):
    rewards = RewardSet([], [], torch.zeros(0), workers=4)
    (fn,) = fns("raises_on_x")
    rewards.add("raises_on_x", fn, 1.0)
    completions = ["a", "b", "c", "d", "e", "x", "g", "h"]  # 4 workers, 1 function: chunks of 2
    try:
        out = rewards.score(["p"] * 8, completions, [[1]] * 8, [{"prompt": "p"}] * 8)
    finally:
        rewards.close()
    assert torch.isnan(out[4:6, 0]).all()
    assert out[[0, 1, 2, 3, 6, 7], 0].tolist() == [1.0] * 6  # not zero, not NaN: intact
    assert rewards.failures == {"raises_on_x": 1}
    assert rewards.step_failures() == {"raises_on_x": {"errors": 1, "timeouts": 0}}


def test_functions_run_at_the_same_time(fns):
    """Two functions that sleep 0.5 s each take about 0.5 s together, in workers and in threads."""
    executor = RewardExecutor(["a", "b"], fns("sleeps", "sleeps"), timeout=10, workers=2)
    inputs = _inputs(["a", "b"])
    try:
        executor(inputs, 2)  # the workers start
        start = time.monotonic()
        calls = executor(inputs, 2)
        in_workers = time.monotonic() - start
    finally:
        executor.close()
    assert [c.status for (c,) in calls] == ["ok", "ok"]
    assert in_workers < 0.9, in_workers

    def sleeps(completions, **kw):
        time.sleep(0.5)
        return [0.0] * len(completions)

    threads = RewardExecutor(["a", "b"], [sleeps, sleeps], timeout=10, isolation="thread")
    start = time.monotonic()
    calls = threads(inputs, 2)
    assert [c.status for (c,) in calls] == ["ok", "ok"]
    assert time.monotonic() - start < 0.9


def test_a_worker_is_persistent_and_replaced_after_a_timeout(fns):
    executor = RewardExecutor(["pid"], fns("pid_unless_hang"), timeout=1.0, workers=1)
    try:
        ((first,),) = executor(_inputs(["a"]), 1)
        ((again,),) = executor(_inputs(["b"]), 1)
        # the same worker
        assert first.status == again.status == "ok" and first.values == again.values
        ((hung,),) = executor(_inputs(["hang"]), 1)
        assert hung.status == "timeout" and "killed and replaced" in hung.message
        ((after,),) = executor(_inputs(["c"]), 1)
        assert after.status == "ok" and after.values != first.values
        old = int(first.values[0])
        with pytest.raises(ProcessLookupError):
            os.kill(old, 0)
    finally:
        executor.close()
    new = int(after.values[0])
    with pytest.raises(ProcessLookupError):  # close() ended the replacement too
        os.kill(new, 0)


def test_what_runs_in_the_trainer_process(fns, caplog):
    """Unpicklable callables fall back to a thread, with a warning; built-in and trusted rewards
    and `isolation: thread` stay in the trainer process; a user's module function goes to a worker."""
    offset = 10.0

    def closure(completions, **kw):
        return [float(os.getpid()) + offset] * len(completions)

    class Trusted:
        runs_in_process = True

        def __call__(self, completions, **kw):
            return [float(os.getpid())] * len(completions)

    (pid,) = fns("pid_unless_hang")
    funcs = [
        lambda completions, **kw: [float(os.getpid())] * len(completions),
        closure,
        Trusted(),
        arithmetic_format,
        pid,
    ]
    names = ["lambda", "closure", "trusted", "builtin", "user"]
    with caplog.at_level(logging.WARNING, logger="grpo.rewards.execution"):
        executor, calls = _run(names, funcs, ["Answer: 1"], timeout=10, workers=1)
    warned = [r.getMessage() for r in caplog.records if r.name == "grpo.rewards.execution"]
    assert len(warned) == 2 and "'lambda'" in warned[0] and "'closure'" in warned[1]
    assert "os._exit" in warned[0] and "abandoned" in warned[0]
    assert [executor.in_worker(k) for k in range(5)] == [False, False, False, False, True]
    values = [c.values[0] for (c,) in calls]
    me = float(os.getpid())
    assert values[:4] == [me, me + offset, me, 1.0] and values[4] != me
    threaded = RewardExecutor(["user"], [pid], isolation="thread")
    assert not threaded.in_worker(0) and threaded(_inputs(["a"]), 1)[0][0].values == [me]


def test_a_thread_past_its_timeout_is_abandoned_and_not_called_again_until_it_returns():
    release, calls = threading.Event(), []

    def blocks(completions, **kw):
        calls.append(1)
        release.wait()
        return [1.0] * len(completions)

    executor = RewardExecutor(["blocks"], [blocks], timeout=0.3, isolation="thread")
    ((first,),) = executor(_inputs(["a"]), 1)
    ((second,),) = executor(_inputs(["a"]), 1)
    assert first.status == second.status == "timeout"
    assert "abandoned" in first.message and "has not returned" in second.message
    assert len(calls) == 1
    release.set()
    time.sleep(0.1)
    ((third,),) = executor(_inputs(["a"]), 1)
    assert third.status == "ok" and len(calls) == 2


def test_failures_are_counted_and_logged_in_full_once(caplog):
    def broken(completions, **kw):
        raise RuntimeError("reward exploded")

    rewards = RewardSet([], [], torch.zeros(0), isolation="thread")
    rewards.add("broken", broken, 1.0)
    rows = [{"prompt": "p"}] * 2
    with caplog.at_level(logging.WARNING, logger="grpo.rewards.reward_set"):
        for _ in range(3):
            out = rewards.score(["p"] * 2, ["a", "b"], [[1], [2]], rows)
            assert torch.isnan(out).all()
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo.rewards.reward_set"]
    assert len(messages) == 2  # the first in full, then one short reminder at the second
    assert "Traceback" in messages[0] and "RuntimeError: reward exploded" in messages[0]
    assert "Traceback" not in messages[1] and "2 times" in messages[1]
    assert rewards.failures == {"broken": 3}
    assert rewards.step_failures() == {"broken": {"errors": 3, "timeouts": 0}}
    # taken: since the last step
    assert rewards.step_failures() == {"broken": {"errors": 0, "timeouts": 0}}


def test_a_function_its_workers_cannot_load_fails_at_start_up(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("def gone(completions, **kw):\n    return [1.0] * len(completions)\n")
    name, fn = resolve(f"{path}:gone")
    path.unlink()  # the trainer has it; a worker, which loads the file anew, cannot
    executor = RewardExecutor([name], [fn], workers=1)
    with pytest.raises(
        ConfigError, match="reward function 'gone' cannot be loaded in a worker process"
    ):
        executor.start()
    ((call,),) = executor(_inputs(["a"]), 1)  # scoring without start(): the same, as a failed call
    executor.close()
    assert (
        call.status == "error" and "cannot be loaded" in call.message and "gone.py" in call.message
    )


EXIT_SCRIPT = """
import os, sys, threading, time
if __name__ == "__main__":
    from grpo.rewards.reward_set import resolve
    from grpo.rewards.execution import RewardExecutor
    fn = resolve(sys.argv[1] + ":pid_unless_hang")[1]
    executor = RewardExecutor(["pid"], [fn], timeout=1000, workers=2)
    inputs = {"prompts": ["p"] * 2, "completions": ["a", "b"], "completion_ids": [[1]] * 2}
    executor.start()  # both ready: each computes one of the two chunks
    (calls,) = executor(inputs, 2)
    # the workers' keepers, and the workers under them (the pids the function returned)
    pids = [w.process.pid for w in executor._workers] + [int(c.values[0]) for c in calls]
    if sys.argv[2] == "crash":  # the trainer dies while its workers are busy in calls that never return
        inputs["completions"] = ["hang", "hang"]
        threading.Thread(target=executor, args=(inputs, 2), daemon=True).start()
        time.sleep(1.0)
        print(*pids, flush=True)
        os._exit(0)
    print(*pids, flush=True)  # then exits, idle workers left open
"""


def test_workers_never_outlive_the_trainer(reward_file, tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    runs = {
        how: subprocess.Popen(
            [sys.executable, str(script), str(reward_file), how], stdout=subprocess.PIPE, text=True
        )
        for how in ("exit", "crash")
    }
    for how, run in runs.items():
        out, _ = run.communicate(timeout=60)  # an exit that waited on its workers would hang here
        assert run.returncode == 0, how
        pids = [int(p) for p in out.split()]
        assert len(set(pids)) == 4 and os.getpid() not in pids
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), how


def worker_processes() -> list[int]:
    """This process's reward workers still running: its children running grpo.rewards.worker's
    program, but the chat templates' renderer (the same program; one per process, shared by every
    run in it, so an earlier test may have started it)."""
    from grpo.rewards import chat_template

    renderer = chat_template._SHARED.worker
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if (
            int(fields[1]) == os.getpid()
            and fields[0] != b"Z"
            and b"grpo.rewards.worker" in cmdline
            and (renderer is None or int(name) != renderer.pid)
        ):
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(
        f"/proc/{pid}/stat"
    ) as f:  # a zombie is dead, only not reaped by its (gone) parent yet
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("timeout", ".nan", "rewards.timeout: must be a finite number"),
        ("timeout", ".inf", "rewards.timeout"),
        ("timeout", "0", "rewards.timeout"),
        ("timeout", "-1", "rewards.timeout"),
        ("workers", "-1", "rewards.workers: must be >= 0"),
        ("isolation", "fork", "rewards.isolation: 'fork' is not one of process, thread"),
    ],
)
def test_config_refuses_bad_execution_settings(key, value, message, tmp_path, toy_config):
    with pytest.raises(ConfigError, match=message):
        config.from_dict({**toy_config, "output_dir": str(tmp_path)}, [f"rewards.{key}={value}"])
    cfg = config.from_dict({"output_dir": str(tmp_path)})
    assert (cfg.rewards.timeout, cfg.rewards.workers, cfg.rewards.isolation) == (60.0, 0, "process")


def test_training_goes_on_whatever_the_rewards_do(
    tokenizer, tmp_path, reward_file, toy_config, monkeypatch
):
    """Acceptance: a function that raises on some completions, one that hangs, one that calls
    os._exit and a normal one; two steps run and finish, the failures are missing rewards (NaN,
    not 0) and counted in metrics.jsonl, the normal rewards are intact."""
    funcs = [
        f"{reward_file}:{name}" for name in ("raises_on_poison", "hangs", "hard_exits", "length")
    ]
    cfg = config.from_dict(
        {**toy_config, "output_dir": str(tmp_path / "run")},
        [
            f"rewards.funcs={json.dumps(funcs)}",
            "rewards.isolation=process",
            "rewards.timeout=2",
            "rewards.workers=8",  # 2 chunks a function
            "training.max_steps=2",
            "training.per_device_train_batch_size=32",
            "rollout.max_completion_length=2",
        ],
    )
    # 2 prompts a step, 16 each
    rows = [
        {"prompt": "1+1=", "poison": True},
        {"prompt": "2+2=", "poison": False},
    ]
    model = tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    trainer = Trainer.from_config(cfg, model=model, tokenizer=tokenizer, train_rows=rows)
    batches, step = [], trainer.train_step
    trainer.train_step = lambda: (result := step(), batches.append(result[1]))[0]
    trainer.log.report = lambda: None  # its plots are not the subject here, and take seconds
    # each step's batch has 2 sandbox outcomes, as a code reward records them
    collect = trainer.phases.collect
    monkeypatch.setattr(
        trainer.phases,
        "collect",
        lambda step, timer=None: (record("killed"), record("killed"), collect(step, timer))[-1],
    )
    record("killed")  # one before training: not the first step's
    start = time.monotonic()
    history = trainer.train()
    assert len(history) == 2 and time.monotonic() - start < 60

    for batch in batches:
        r = batch.rewards_per_func  # columns: raises_on_poison, hangs, hard_exits, length
        poisoned = torch.tensor([row["poison"] for row in batch.rows])
        # only the poisoned chunk
        assert torch.isnan(r[poisoned, 0]).all() and (r[~poisoned, 0] == 0.5).all()
        assert torch.isnan(r[:, 1]).all() and torch.isnan(r[:, 2]).all()
        assert r[:, 3].tolist() == [float(len(t)) for t in batch.completion_texts]
        assert not torch.isnan(batch.rewards).any()  # every completion keeps the rewards it has

    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(lines) == 2
    for m in lines:
        assert (m["rewards/raises_on_poison/errors"], m["rewards/raises_on_poison/timeouts"]) == (
            1,
            0,
        )
        assert (m["rewards/hangs/errors"], m["rewards/hangs/timeouts"]) == (0, 2)
        assert (m["rewards/hard_exits/errors"], m["rewards/hard_exits/timeouts"]) == (2, 0)
        assert (m["rewards/length/errors"], m["rewards/length/timeouts"]) == (0, 0)
        # a missing mean is null in metrics.jsonl (NaN is not JSON)
        assert m["rewards/hangs/mean"] is None and m["rewards/length/mean"] > 0
        assert m["rewards/raises_on_poison/mean"] == 0.5
    assert lines[-1]["rewards/hangs/failures"] == 4
    assert [m["sandbox/killed"] for m in lines] == [2, 2]  # each step's own, not cumulative
    assert trainer.state_dict()["reward_failures"] == {
        "raises_on_poison": 2,
        "hangs": 4,
        "hard_exits": 4,
        "length": 0,
    }
    assert not worker_processes()  # train() closed them


def test_a_reward_that_bounds_itself_is_waited_for_past_the_timeout():
    class BoundsItself:  # like the code rewards: each item bounded, the batch as long as it takes
        runs_in_process = True
        bounds_itself = True

        def __call__(self, completions, **kw):
            time.sleep(0.8)
            return [1.0] * len(completions)

    def plain(completions, **kw):  # still running when the bounded one returns, past its timeout
        time.sleep(2.0)
        return [1.0] * len(completions)

    plain.runs_in_process = True
    _, calls = _run(["bounded", "plain"], [BoundsItself(), plain], ["a", "b"], timeout=0.3)
    assert [c.status for (c,) in calls] == ["ok", "timeout"] and calls[0][0].values == [1.0, 1.0]
