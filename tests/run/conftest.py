"""`grpo train` runs in children, shared by tests/run/test_resume.py, test_run_safety.py and
test_resume_entropy.py: a run's config on the toy task, the run itself, its logs, and the check
that two runs are the same.

A child is forked from a forkserver (multiprocessing's "forkserver" start method), not from the
test process: once a test in this process has initialised CUDA (GRPO_TEST_DEVICE=cuda), a fork
of it cannot use CUDA again. The server is a fresh interpreter (multiprocessing starts it by
fork and exec) that imports harness_child, and with it torch, transformers and grpo's command
line, once (~10 s on 2 cores, started as soon as collection finds a test that needs it, so the
import overlaps the tests before it), and never touches CUDA; each child is a fork of it and
starts in milliseconds, as a fork of the test process did. A child gets the test process's
stdout and stderr (pytest's capture), environment, working directory and torch thread count,
and the `quick` fixture's patches are applied in it (harness_child); monkeypatches of other
things in the test process do not reach it (those tests call `main` in this process).
tests/run/test_harness.py checks all of this."""

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
from pathlib import Path

import pytest
import torch
import tqdm
from harness_child import (
    child,
    inherited_fd,
)  # tests/run is on sys.path: pytest puts it there for this file
from safetensors.torch import load_file

from grpo.config import loading as config
from grpo.run import runlog

ROOT = Path(__file__).resolve().parents[2]
# tools/seconds: the seconds spent in tool calls, a timing like those under time/
TIMING = ("time/", "tokens_per_second", "tools/seconds")

BASE = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "instruction": "{expression}=",
            "num_train": 200,
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 2, "temperature": 0.9},
    "rewards": {"isolation": "thread"},  # the functions: REWARDS, below
    # a KL reference that ref_sync_steps changes, a schedule with warm-up: all of it must come back
    "algorithm": {"beta": 0.04, "ref_sync_steps": 3},
    "training": {
        "max_steps": 6,
        "per_device_train_batch_size": 16,
        "learning_rate": 0.003,
        "lr_scheduler_type": "linear",
        "warmup_steps": 1,
        "save_steps": 1,
    },
    "eval": {"every": 2, "after": True, "temperatures": [0.0, 1.0]},
    "logging": {"log_every": 100, "sample_every": 2},
}


# The toy task's reward is almost always 0 for a random model: no learning signal, weights that
# hardly move, and a resume that forgot something could still look exact. This one rewards a
# third of all first characters, so most groups have spread and every step changes the weights.
REWARDS = """
import time


def slow(completions, **kwargs):
    time.sleep(1.0)  # a step long enough that two signals surely land in the same one
    return [0.0] * len(completions)


def third(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]
"""


@pytest.fixture
def quick(monkeypatch):
    """For the files that run `grpo train` (pytestmark = pytest.mark.usefixtures("quick")): no
    plots, and no tqdm monitor thread."""
    # plots: seconds, and not what is tested here
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)
    # no monitor thread whose lock a fork could copy held
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)


def _write_config(tmp_path, name, overrides=()):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    funcs = [f"{rewards}:third", f"{ROOT / 'examples' / 'toy_rewards.py'}:first_char_correct"]
    cfg = config.from_dict(
        {
            **BASE,
            "output_dir": str(tmp_path / name),
            "rewards": {**BASE["rewards"], "funcs": funcs},
        },
        list(overrides),
    )
    path = tmp_path / f"{name}.yaml"
    config.save(cfg, path)
    return path


CONTEXT = multiprocessing.get_context("forkserver")
# what a run imports, so that no child imports it again: harness_child (torch, transformers,
# grpo's command line and trainer) and what a run imports on its way (peft, torch.compile's
# modules, the tiny model's). A 2-step run of the toy task took 0.2 s in such a child, and 2.6 s
# in a fork of a test process that had not imported them, as the earlier harness's children were.
CONTEXT.set_forkserver_preload(
    [
        "harness_child",
        "peft",
        "accelerate",
        "sympy",
        "torch._dynamo",
        "torch.distributed",
        "transformers.models.llama.modeling_llama",
        "grpo.backends.single",
        "grpo.backends.distributed",
        "grpo.config.docs",
        "grpo.cpu.layer",
        "grpo.models.lora",
        "grpo.models.tiny",
        "grpo.run.report",
        "grpo.run.trackers",
        "grpo.tasks.arithmetic",
    ]
)


def _server() -> None:
    """Starts the forkserver unless it runs. It imports harness_child from this directory, which
    it finds on PYTHONPATH: Python 3.11's forkserver does not take the sys.path it is given."""
    here, before = str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, before] if before else [here])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def pytest_collection_modifyitems(items):
    """Starts the forkserver, which imports for a while, once a test that runs `grpo` is collected."""
    if any("quick" in getattr(item, "fixturenames", ()) for item in items):
        _server()


class _Fd:
    """A file descriptor of this process that the child gets as its own (passed by the forkserver
    with SCM_RIGHTS): multiprocessing's DupFd works only while the Process is being pickled."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return inherited_fd, (DupFd(self.fd),)


def _start(argv, kill_at=None, err_path=None):
    environ = dict(os.environ)
    environ.pop("GRPO_KILL_AT", None)
    if kill_at:
        environ["GRPO_KILL_AT"] = kill_at
    process = CONTEXT.Process(
        target=child,
        args=(
            argv,
            environ,
            torch.get_num_threads(),
            _Fd(1),  # pytest's capture while a test runs
            _Fd(2),
            None if err_path is None else str(err_path),
        ),
    )
    _server()
    process.start()
    return process


def _run(argv, kill_at=None, kill_after=None):
    """`grpo train ...` in a child; its exit code (-9: SIGKILLed). `kill_after`: seconds."""
    process = _start(argv, kill_at)
    process.join(kill_after)
    if process.is_alive():
        os.kill(process.pid, signal.SIGKILL)
    process.join(120)
    return process.exitcode


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finished_rows(path):
    """The rows of a .jsonl file another process is still writing: a last line without its
    newline is being written and is not read (the strict `_rows` would fail on it)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _untimed(rows):
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def _assert_same_run(got: Path, expected: Path):
    assert _untimed(_rows(got / "metrics.jsonl")) == _untimed(_rows(expected / "metrics.jsonl"))
    assert _rows(got / "samples.jsonl") == _rows(expected / "samples.jsonl")
    assert _rows(got / "eval.jsonl") == _rows(expected / "eval.jsonl")
    a, b = (
        load_file(got / "final" / "model.safetensors"),
        load_file(expected / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _train_to(tmp_path, name, overrides=()):
    path = _write_config(tmp_path, name, overrides)
    assert _run(["train", str(path)]) == 0
    return path, tmp_path / name


@pytest.fixture
def write_config():
    """write_config(tmp_path, name, overrides=()): tmp_path/name.yaml, a 6-step run of the toy task
    into tmp_path/name, rewarded by `third` (tmp_path/rewards.py, beside `slow`) and
    first_char_correct; returns its path."""
    return _write_config


@pytest.fixture
def start_grpo():
    """start_grpo(argv, kill_at=None, err_path=None): `grpo argv` started in a child (GRPO_KILL_AT=
    kill_at there; its sys.stderr written to err_path); returns the multiprocessing.Process."""
    return _start


@pytest.fixture
def run_grpo():
    """run_grpo(argv, kill_at=None, kill_after=None): `grpo argv` in a child; its exit code
    (-9: SIGKILLed). `kill_after`: seconds."""
    return _run


@pytest.fixture
def read_rows():
    """read_rows(path): a .jsonl file's rows ([] if there is no file)."""
    return _rows


@pytest.fixture
def finished_rows():
    """finished_rows(path): the rows of a .jsonl file a live run is writing, its unfinished
    last line left out; for waiting on a run, where read_rows could catch a half-written row."""
    return _finished_rows


@pytest.fixture
def train_to():
    """train_to(tmp_path, name, overrides=()): write_config's run, trained to its end (exit 0
    asserted); returns (config path, run directory)."""
    return _train_to


@pytest.fixture
def assert_same_run():
    """assert_same_run(got, expected): two run directories hold the same metrics (but timings),
    samples, evaluations and final weights."""
    return _assert_same_run
