"""Optional trackers: nothing imported unless listed, clear errors, the calls each backend gets."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.run.trackers import Trackers


def test_empty_report_to_imports_nothing_and_log_is_a_no_op(tmp_path):
    # in a fresh interpreter, so modules imported by other tests do not hide an import
    code = (
        "import sys\n"
        "from grpo.config.schema import Config\n"
        "from grpo.run.trackers import Trackers\n"
        "before = set(sys.modules)\n"
        f"cfg = Config(output_dir={str(tmp_path / 'run')!r})\n"
        "t = Trackers.from_config(cfg)\n"
        "t.log({'reward': 1.0, 'text': 'x'}, step=1)\n"
        "t.close()\n"
        "new = set(sys.modules) - before\n"
        "bad = sorted(m for m in new if m.split('.')[0] in ('wandb', 'trackio', 'tensorboard', 'tensorboardX')\n"
        "             or m.startswith('torch.utils.tensorboard'))\n"
        "print('NEW', bad, bool(t))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "NEW [] False" in out
    assert not (tmp_path / "run").exists()  # nothing written either


def test_unknown_backend_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'.*tensorboard, wandb, trackio"):
        Trackers(["mlflow"], tmp_path)


def test_missing_backend_names_the_pip_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it raises ImportError
    with pytest.raises(ConfigError, match=r"pip install wandb"):
        Trackers(["wandb"], tmp_path)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install tensorboard"):
        Trackers(["tensorboard"], tmp_path)


class _FakeRunModule(types.ModuleType):
    """Records wandb/trackio calls."""

    def __init__(self, name):
        super().__init__(name)
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return object()

    def log(self, metrics, step=None):
        self.calls.append(("log", dict(metrics), step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_get_init_log_finish(tmp_path, monkeypatch, name):
    fake = _FakeRunModule(name)
    monkeypatch.setitem(sys.modules, name, fake)
    cfg = Config(output_dir=str(tmp_path / "my-run"))
    cfg.logging.report_to = [name]
    with Trackers.from_config(cfg) as trackers:
        trackers.log(
            {"step": 3, "reward": 0.5, "kl": float("nan"), "note": "text", "num_tokens": 12}, step=3
        )
    init, log, finish = fake.calls
    assert init[0] == "init" and init[1]["project"] == "grpo" and init[1]["name"] == "my-run"
    assert init[1]["config"]["logging"]["report_to"] == [name]
    assert log == ("log", {"reward": 0.5, "num_tokens": 12.0}, 3)  # numbers only, NaN dropped
    assert finish == ("finish",)


def test_run_name_is_passed(tmp_path, monkeypatch):
    fake = _FakeRunModule("wandb")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    Trackers(["wandb"], tmp_path, run_name="exp-1").close()
    assert fake.calls[0][1]["name"] == "exp-1"


def test_tensorboard_calls_summary_writer(tmp_path, monkeypatch):
    """Without tensorboard installed: a stand-in SummaryWriter records the calls."""
    written = []

    class Writer:
        def __init__(self, log_dir):
            written.append(("dir", log_dir))

        def add_scalar(self, key, value, global_step):
            written.append((key, value, global_step))

        def flush(self):
            pass

        def close(self):
            written.append(("close",))

    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    trackers = Trackers(["tensorboard"], tmp_path / "run")
    trackers.log({"reward": 0.25, "rewards/arithmetic_correct/mean": 0.5}, step=7)
    trackers.close()
    assert written == [
        ("dir", str(tmp_path / "run" / "tensorboard")),
        ("reward", 0.25, 7),
        ("rewards/arithmetic_correct/mean", 0.5, 7),
        ("close",),
    ]


def test_tensorboard_writes_an_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    trackers = Trackers(["tensorboard"], tmp_path)
    for step in range(1, 4):
        trackers.log({"reward": step / 4, "loss": 0.1}, step=step)
    trackers.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


# ---------------------------------------------------------------- completions tables


class _FakeTable:
    def __init__(self, columns=None, data=None, dataframe=None):
        if dataframe is not None:
            columns, data = list(dataframe.columns), dataframe.values.tolist()
        self.columns, self.data = columns, data


ROWS = [
    {
        "step": 4,
        "prompt": [{"role": "user", "content": "2+2?"}],
        "completion": "4",
        "reward": 1.0,
        "correct": 1.0,
    },
    {"step": 4, "prompt": "a|b", "completion": "x\ny", "reward": float("nan"), "correct": None},
]


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_completions_go_to_wandb_and_trackio_as_a_table(tmp_path, monkeypatch, name):
    fake = _FakeRunModule(name)
    fake.Table = _FakeTable
    monkeypatch.setitem(sys.modules, name, fake)
    with Trackers([name], tmp_path) as trackers:
        trackers.log_completions(ROWS, step=4)
    _, (kind, logged, step), _ = fake.calls
    table = logged["completions"]
    assert (kind, step, table.columns) == (
        "log",
        4,
        ["step", "prompt", "completion", "reward", "correct"],
    )
    assert table.data[0] == [4, "2+2?", "4", 1.0, 1.0]  # a chat prompt as its last message's text
    missing = table.data[1][3]
    assert table.data[1][:3] == [4, "a|b", "x\ny"]
    # no reward (a DataFrame holds it as NaN)
    assert missing is None or (name == "trackio" and missing != missing)


def test_a_tracker_without_a_table_type_is_said_once(tmp_path, monkeypatch, caplog):
    fake = _FakeRunModule("trackio")
    monkeypatch.setitem(sys.modules, "trackio", fake)
    with Trackers(["trackio"], tmp_path) as trackers:
        trackers.log_completions(ROWS, step=1)
        trackers.log_completions(ROWS, step=2)
    assert [c[0] for c in fake.calls] == ["init", "finish"]
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1
    assert "has no Table type" in caplog.records[0].message


def test_completions_go_to_tensorboard_as_markdown(tmp_path, monkeypatch):
    texts = []

    class Writer:
        def __init__(self, log_dir):
            pass

        def add_text(self, tag, text, global_step):
            texts.append((tag, text, global_step))

        def flush(self):
            pass

        def close(self):
            pass

    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    with Trackers(["tensorboard"], tmp_path) as trackers:
        trackers.log_completions(ROWS, step=4)
    assert texts == [
        (
            "completions",
            (
                "| step | prompt | completion | reward | correct |\n"
                "|---|---|---|---|---|\n"
                "| 4 | 2+2? | 4 | 1 | 1 |\n"
                "| 4 | a\\|b | x<br>y |  |  |"
            ),
            4,
        )
    ]


def test_run_log_samples_reach_the_tracker_every_sample_step(tmp_path, monkeypatch):
    from grpo.run.runlog import RunLog

    fake = _FakeRunModule("wandb")
    fake.Table = _FakeTable
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = Config(output_dir=str(tmp_path / "run"))
    cfg.logging.report_to = ["wandb"]
    run = RunLog(cfg)
    run.start()
    run.start_training(0)
    prompts = ["p0", "p0", "p1", "p1"]
    run.samples(
        2,
        prompts,
        ["a", "b", "c", "d"],
        [0.5, 0.0, 1.0, 1.0],
        group_size=2,
        reward_columns={"correct": [0.0, 0.0, 1.0, 1.0], "reward": [0.5, 0.0, 0.0, 0.0]},
    )
    run.close()
    (table,) = [c[1]["completions"] for c in fake.calls if c[0] == "log"]
    assert table.columns == ["step", "prompt", "completion", "reward", "correct", "reward (reward)"]
    # one per group
    assert table.data == [
        [2, "p0", "a", 0.5, 0.0, 0.5],
        [2, "p1", "c", 1.0, 1.0, 0.0],
    ]
    import json

    lines = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    assert lines[1] == {
        "step": 2,
        "prompt": "p1",
        "completion": "c",
        "reward": 1.0,
        "rewards": {"correct": 1.0, "reward": 0.0},
    }
