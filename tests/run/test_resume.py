"""Exact resume: a run killed at any moment (SIGKILL mid-step, mid-save, between the manifest
and the rename) or stopped by a signal, and resumed, ends with the same metrics, logs and
weights as a run that was never interrupted; damaged checkpoints are passed over; a
changed config is refused; run directories hold nothing a later run could mistake.

The runs are `grpo train` in forked children (a fresh interpreter would spend ~10 s
importing torch and transformers on 2 cores; a fork starts in milliseconds)."""

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
import tqdm
import yaml
from safetensors.torch import load_file

from grpo.run import checkpoint
from grpo.config import schema as config
from grpo.run import run_lock
from grpo.run import runlog
from grpo.cli import main

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time/", "tokens_per_second")

BASE = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {"chat_template": "never", "arithmetic": {
        "operands": [[1, 4], [1, 4]], "operators": ["+"], "instruction": "{expression}=", "num_train": 200, "num_eval": 4}},
    "rollout": {"num_generations": 4, "max_completion_length": 2, "temperature": 0.9},
    "rewards": {"isolation": "thread"},  # the functions: REWARDS, below
    # a KL reference that ref_sync_steps changes, a schedule with warm-up: all of it must come back
    "algorithm": {"beta": 0.04, "ref_sync_steps": 3},
    "training": {"max_steps": 6, "per_device_train_batch_size": 16, "learning_rate": 0.003,
                 "lr_scheduler_type": "linear", "warmup_steps": 1, "save_steps": 1},
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


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setattr(runlog.RunLog, "report", lambda self: None)  # plots: seconds, and not what is tested here
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread whose lock a fork could copy held


def _write_config(tmp_path, name, overrides=()):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    funcs = [f"{rewards}:third", f"{ROOT / 'examples' / 'toy_rewards.py'}:first_char_correct"]
    cfg = config.from_dict({**BASE, "output_dir": str(tmp_path / name), "rewards": {**BASE["rewards"], "funcs": funcs}},
                           list(overrides))
    path = tmp_path / f"{name}.yaml"
    config.save(cfg, path)
    return path


def _child(argv, kill_at):
    if kill_at:
        os.environ["GRPO_KILL_AT"] = kill_at
    os._exit(main(argv))


def _start(argv, kill_at=None):
    process = multiprocessing.get_context("fork").Process(target=_child, args=(argv, kill_at))
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


def _untimed(rows):
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows]


def _assert_same_run(got: Path, expected: Path):
    assert _untimed(_rows(got / "metrics.jsonl")) == _untimed(_rows(expected / "metrics.jsonl"))
    assert _rows(got / "samples.jsonl") == _rows(expected / "samples.jsonl")
    assert _rows(got / "eval.jsonl") == _rows(expected / "eval.jsonl")
    a, b = load_file(got / "final" / "model.safetensors"), load_file(expected / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("overrides,seed", [
    ([], 0),
    (["algorithm.num_iterations=2"], 1),
    (["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"], 2),
])
def test_killed_at_random_moments_and_resumed_is_the_uninterrupted_run(tmp_path, overrides, seed):
    expected_cfg = _write_config(tmp_path, "expected", overrides)
    assert _run(["train", str(expected_cfg)]) == 0
    expected = tmp_path / "expected"
    assert len(_rows(expected / "metrics.jsonl")) == 6
    # the weights move every step; the reference is the start, then (ref_sync_steps=3) step 3's policy
    kl = [row["kl"] for row in _rows(expected / "metrics.jsonl")]
    assert all(kl[i] > 0 for i in (1, 2, 4, 5)), kl

    cfg = _write_config(tmp_path, "killed", overrides)
    rng = random.Random(seed)
    # named points (a fixed count of hits) and wall-clock moments, drawn at random
    kills = [(rng.choice(["step", "logged", "save", "manifest"]), rng.randint(1, 3)) for _ in range(4)]
    kills.insert(rng.randint(0, 4), ("save", 1))  # at least once mid-save
    kills.append((None, rng.uniform(0.2, 1.0)))  # last: a run fast enough to finish first changes no other kill
    outcomes, starts = [], []
    for point, when in kills:
        latest = checkpoint.latest_checkpoint(tmp_path / "killed")
        starts.append(checkpoint.manifest_step(latest) if latest else 0)
        rc = _run(["train", str(cfg), "--resume"], kill_at=f"{point}:{when}" if point else None,
                  kill_after=None if point else when)
        outcomes.append(rc)
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, (point, when, rc)
    if outcomes[-1] != 0:
        latest = checkpoint.latest_checkpoint(tmp_path / "killed")
        starts.append(checkpoint.manifest_step(latest) if latest else 0)
        assert _run(["train", str(cfg), "--resume"]) == 0
    print(kills, outcomes, starts)
    # killed several times, and resumed from checkpoints, not rerun from the start
    assert outcomes.count(-signal.SIGKILL) >= 3 and len(set(starts) - {0}) >= 2 and starts[-1] > 0, (kills, outcomes, starts)
    _assert_same_run(tmp_path / "killed", expected)
    # leftovers cleaned; the lock file stays (unlocked: a killed run's lock dies with it)
    assert [p.name for p in (tmp_path / "killed").iterdir() if p.name.startswith(".")] == [run_lock.LOCK]


def _train_to(tmp_path, name, overrides=()):
    path = _write_config(tmp_path, name, overrides)
    assert _run(["train", str(path)]) == 0
    return path, tmp_path / name


def test_a_damaged_latest_checkpoint_is_passed_over_with_a_warning(tmp_path, caplog):
    path, run = _train_to(tmp_path, "run", ["training.max_steps=4", "training.save_steps=2", "eval.after=false"])
    weights = run / "final" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of a weight: the size is right, the hash is not
    weights.write_bytes(bytes(data))
    (run / "checkpoint-4" / "train_state.pt").write_bytes(b"cut short")
    assert checkpoint.verify(run / "checkpoint-2") == ""
    assert "sha256" in checkpoint.verify(run / "final")
    assert "bytes" in checkpoint.verify(run / "checkpoint-4")
    with caplog.at_level("WARNING"):
        assert checkpoint.latest_checkpoint(run) == run / "checkpoint-2"
    assert "final is damaged" in caplog.text and "checkpoint-2" in caplog.text

    # resumed from checkpoint-2 it is the run never damaged (the damaged ones are replaced)
    assert _run(["train", str(path), "--resume"]) == 0
    _, expected = _train_to(tmp_path, "expected", ["training.max_steps=4", "training.save_steps=2", "eval.after=false"])
    _assert_same_run(run, expected)
    assert checkpoint.verify(run / "final") == "" and checkpoint.verify(run / "checkpoint-4") == ""

    for name in ("checkpoint-2", "checkpoint-4", "final"):
        (run / name / checkpoint.MANIFEST).unlink()
    with pytest.raises(config.ConfigError, match="no intact checkpoint.*overwrite_output_dir"):
        checkpoint.latest_checkpoint(run)


def test_a_changed_config_is_refused_naming_the_keys(tmp_path, capsys):
    path, run = _train_to(tmp_path, "run", ["training.max_steps=2", "eval.after=false"])
    rc = main(["train", str(path), "--resume", "training.learning_rate=0.01", "rollout.temperature=1.0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "rollout.temperature (saved 0.9, now 1.0)" in err and "training.learning_rate" in err
    assert "training.max_steps" not in err.split("differ:")[1].split(";")[0]
    # what may change: how long, what is logged and evaluated, which kernels compute the tiles
    assert main(["train", str(path), "--resume", "training.max_steps=3", "logging.sample_every=1",
                 "eval.every=0", "training.save_total_limit=1", "cpu.compile=eager"]) == 0
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in checkpoint.checkpoints(run)) == ["checkpoint-3", "final"]


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_is_exact(tmp_path):
    overrides = ["training.max_steps=40", "training.save_steps=0", "eval.every=0", "eval.after=false"]
    path = _write_config(tmp_path, "run", overrides)
    run = tmp_path / "run"
    process = _start(["train", str(path)])
    deadline = time.monotonic() + 60
    while len(_rows(run / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGTERM)
    process.join(60)
    assert process.exitcode == 143  # 128 + SIGTERM, as the README says
    (saved,) = checkpoint.checkpoints(run)
    step = int(saved.name.split("-")[1])
    assert checkpoint.verify(saved) == "" and [r["step"] for r in _rows(run / "metrics.jsonl")] == list(range(1, step + 1))
    assert torch.load(saved / checkpoint.STATE, weights_only=True)["train"]["step"] == step

    assert _run(["train", str(path), "--resume"]) == 0
    _, expected = _train_to(tmp_path, "expected", overrides)
    _assert_same_run(run, expected)


def test_a_second_signal_stops_at_once(tmp_path):
    path = _write_config(tmp_path, "run", ["training.max_steps=50", "training.save_steps=0", "eval.every=0"])
    data = yaml.safe_load(path.read_text())
    data["rewards"]["funcs"] = [f"{tmp_path / 'rewards.py'}:slow"]
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    process = _start(["train", str(path)])
    deadline = time.monotonic() + 60
    while not _rows(run / "metrics.jsonl") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # past step 1's end (where a first signal would save checkpoint-1), into step 2
    os.kill(process.pid, signal.SIGINT)
    time.sleep(0.1)  # two separate signals (the same one twice at once is delivered once)
    os.kill(process.pid, signal.SIGINT)
    process.join(60)
    assert process.exitcode == 130  # 128 + SIGINT
    assert len(_rows(run / "metrics.jsonl")) < 3
    assert not checkpoint.checkpoints(run)  # at once: not at the step's end with a checkpoint


# ---------------------------------------------------------------- run directories


def test_output_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    path = _write_config(tmp_path, "run")
    (tmp_path / "run").write_text("not a directory")
    assert main(["train", str(path)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(config.ConfigError, match=r"output_dir: .* is a file, not a directory; set output_dir"):
        runlog.check_output_dir(tmp_path / "run", overwrite=True)


def test_a_run_stopped_before_its_first_checkpoint_is_simply_rerun(tmp_path):
    path = _write_config(tmp_path, "run", ["training.save_steps=3", "eval.every=0"])
    run = tmp_path / "run"
    assert _run(["train", str(path)], kill_at="step:2") == -signal.SIGKILL
    assert _rows(run / "metrics.jsonl") and not checkpoint.checkpoints(run)
    assert _run(["train", str(path)], kill_at="save:1") == -signal.SIGKILL  # rerun; killed mid-way through its first save
    assert not checkpoint.checkpoints(run)  # the half-written one is hidden, never taken for a checkpoint
    assert [p.name for p in run.iterdir() if p.name.startswith(".checkpoint-3.tmp-")]
    assert _run(["train", str(path), "training.max_steps=2"]) == 0  # no overwrite_output_dir needed
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == [run_lock.LOCK]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2]


def test_a_run_with_checkpoints_is_kept_unless_overwritten(tmp_path, capsys):
    path, run = _train_to(tmp_path, "run", ["training.max_steps=2", "eval.after=false"])
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (checkpoint-1/, checkpoint-2/, final/)" in err
    assert "--resume" in err and "overwrite_output_dir=true" in err
    assert main(["train", str(path), "overwrite_output_dir=true", "training.save_steps=0"]) == 0
    assert [p.name for p in checkpoint.checkpoints(run)] == ["final"]  # the old run's checkpoints are gone


def test_a_failed_start_writes_nothing(tmp_path):
    path = _write_config(tmp_path, "run")
    data = yaml.safe_load(path.read_text())
    data["rewards"]["funcs"] = ["no_such_reward"]
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 2
    assert not (tmp_path / "run").exists()


def test_resume_without_a_checkpoint_starts_from_step_0(tmp_path, capsys):
    path = _write_config(tmp_path, "run", ["training.max_steps=1", "eval.every=0", "eval.after=false"])
    assert main(["train", str(path), "--resume"]) == 0
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", str(path), "--resume", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_resuming_a_finished_run_neither_repeats_nor_loses_its_evaluations(tmp_path):
    path, run = _train_to(tmp_path, "run", ["training.max_steps=2", "eval.every=0"])
    labels = lambda: [(r["label"], r["step"]) for r in _rows(run / "eval.jsonl")]  # noqa: E731
    assert labels() == [("after", 2), ("after", 2)]  # greedy and sampled
    # as if killed during the "after" evaluation: resumed from final/, it is redone, not repeated
    assert main(["train", str(path), "--resume"]) == 0
    assert labels() == [("after", 2), ("after", 2)]
    # trained on for longer: the old "after" stays, at its step
    assert main(["train", str(path), "--resume", "training.max_steps=3"]) == 0
    assert labels() == [("after", 2), ("after", 2), ("after", 3), ("after", 3)]
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_checkpoint_with_the_earlier_cpu_keys_resumes():
    """A checkpoint written before the CPU layer's keys moved under cpu: (model.cpu_kernels,
    training.kernels, rollout.decoding) differs from today's config only in keys that pick
    kernels, which a resumed run may change; any other difference is still named."""
    now = yaml.safe_load(yaml.safe_dump(config.from_dict({}).to_dict()))
    saved = yaml.safe_load(yaml.safe_dump(now))
    del saved["cpu"]
    saved["model"]["cpu_kernels"] = False
    saved["training"]["kernels"] = "eager"
    saved["rollout"]["decoding"] = "plain"
    assert checkpoint.config_differences(saved, now) == []
    saved["training"]["learning_rate"] = 0.5
    assert [key for key, _, _ in checkpoint.config_differences(saved, now)] == ["training.learning_rate"]
