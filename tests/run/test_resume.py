"""Exact resume: a run killed at any moment (SIGKILL mid-step, mid-save, between the manifest
and the rename) or stopped by a signal, and resumed, ends with the same metrics, logs and
weights as a run that was never interrupted; damaged checkpoints are passed over; a
changed config is refused; run directories hold nothing a later run could mistake.

The runs are `grpo train` in forked children (a fresh interpreter would spend ~10 s
importing torch and transformers on 2 cores; a fork starts in milliseconds), through the
fixtures of tests/run/conftest.py."""

import os
import random
import signal
import time

import pytest
import torch
import yaml

from grpo.cli import main
from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.run import checkpoint, run_lock, runlog

pytestmark = pytest.mark.usefixtures("quick")


@pytest.mark.parametrize(
    "overrides,seed",
    [
        ([], 0),
        (["algorithm.num_iterations=2"], 1),
        (["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3"], 2),
    ],
)
def test_killed_at_random_moments_and_resumed_is_the_uninterrupted_run(
    tmp_path, overrides, seed, write_config, run_grpo, read_rows, assert_same_run
):
    expected_cfg = write_config(tmp_path, "expected", overrides)
    assert run_grpo(["train", str(expected_cfg)]) == 0
    expected = tmp_path / "expected"
    assert len(read_rows(expected / "metrics.jsonl")) == 6
    # the weights move every step; the reference is the start, then (ref_sync_steps=3) step 3's policy
    kl = [row["kl"] for row in read_rows(expected / "metrics.jsonl")]
    assert all(kl[i] > 0 for i in (1, 2, 4, 5)), kl

    cfg = write_config(tmp_path, "killed", overrides)
    rng = random.Random(seed)
    # named points (a fixed count of hits) and wall-clock moments, drawn at random
    kills = [
        (rng.choice(["step", "logged", "save", "manifest"]), rng.randint(1, 3)) for _ in range(4)
    ]
    kills.insert(rng.randint(0, 4), ("save", 1))  # at least once mid-save
    # last: a run fast enough to finish first changes no other kill
    kills.append((None, rng.uniform(0.2, 1.0)))
    outcomes, starts = [], []
    for point, when in kills:
        latest = checkpoint.latest_checkpoint(tmp_path / "killed")
        starts.append(checkpoint.manifest_step(latest) if latest else 0)
        rc = run_grpo(
            ["train", str(cfg), "--resume"],
            kill_at=f"{point}:{when}" if point else None,
            kill_after=None if point else when,
        )
        outcomes.append(rc)
        if rc == 0:
            break
        assert rc == -signal.SIGKILL, (point, when, rc)
    if outcomes[-1] != 0:
        latest = checkpoint.latest_checkpoint(tmp_path / "killed")
        starts.append(checkpoint.manifest_step(latest) if latest else 0)
        assert run_grpo(["train", str(cfg), "--resume"]) == 0
    print(kills, outcomes, starts)
    # killed several times, and resumed from checkpoints, not rerun from the start
    assert (
        outcomes.count(-signal.SIGKILL) >= 3 and len(set(starts) - {0}) >= 2 and starts[-1] > 0
    ), (kills, outcomes, starts)
    assert_same_run(tmp_path / "killed", expected)
    # leftovers cleaned; the lock file stays (unlocked: a killed run's lock dies with it)
    assert [p.name for p in (tmp_path / "killed").iterdir() if p.name.startswith(".")] == [
        run_lock.LOCK
    ]


def test_a_damaged_latest_checkpoint_is_passed_over_with_a_warning(
    tmp_path, caplog, run_grpo, train_to, assert_same_run
):
    path, run = train_to(
        tmp_path, "run", ["training.max_steps=4", "training.save_steps=2", "eval.after=false"]
    )
    weights = run / "final" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of a weight: the size is right, the hash is not
    weights.unlink()  # final/ shares checkpoint-4's big files (hard links): damage only its own
    weights.write_bytes(bytes(data))
    (run / "checkpoint-4" / "train_state.pt").write_bytes(b"cut short")
    assert checkpoint.verify(run / "checkpoint-2") == ""
    assert "does not match its" in checkpoint.verify(run / "final")
    assert "bytes" in checkpoint.verify(run / "checkpoint-4")
    with caplog.at_level("WARNING"):
        assert checkpoint.latest_checkpoint(run) == run / "checkpoint-2"
    assert "final is damaged" in caplog.text and "checkpoint-2" in caplog.text

    # resumed from checkpoint-2 it is the run never damaged (the damaged ones are replaced)
    assert run_grpo(["train", str(path), "--resume"]) == 0
    _, expected = train_to(
        tmp_path, "expected", ["training.max_steps=4", "training.save_steps=2", "eval.after=false"]
    )
    assert_same_run(run, expected)
    assert checkpoint.verify(run / "final") == "" and checkpoint.verify(run / "checkpoint-4") == ""

    for name in ("checkpoint-2", "checkpoint-4", "final"):
        (run / name / checkpoint.MANIFEST).unlink()
    with pytest.raises(ConfigError, match="no intact checkpoint.*overwrite_output_dir"):
        checkpoint.latest_checkpoint(run)


def test_a_changed_config_is_refused_naming_the_keys(tmp_path, capsys, read_rows, train_to):
    path, run = train_to(tmp_path, "run", ["training.max_steps=2", "eval.after=false"])
    rc = main(
        ["train", str(path), "--resume", "training.learning_rate=0.01", "rollout.temperature=1.0"]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "rollout.temperature (saved 0.9, now 1.0)" in err and "training.learning_rate" in err
    assert "training.max_steps" not in err.split("differ:")[1].split(";")[0]
    # what may change: how long, what is logged and evaluated, which kernels compute the tiles
    assert (
        main(
            [
                "train",
                str(path),
                "--resume",
                "training.max_steps=3",
                "logging.sample_every=1",
                "eval.every=0",
                "training.save_total_limit=1",
                "cpu.compile=eager",
            ]
        )
        == 0
    )
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in checkpoint.checkpoints(run)) == ["checkpoint-3", "final"]


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_is_exact(
    tmp_path,
    write_config,
    run_grpo,
    start_grpo,
    read_rows,
    finished_rows,
    train_to,
    assert_same_run,
):
    overrides = [
        "training.max_steps=40",
        "training.save_steps=0",
        "eval.every=0",
        "eval.after=false",
    ]
    path = write_config(tmp_path, "run", overrides)
    run = tmp_path / "run"
    process = start_grpo(["train", str(path)])
    deadline = time.monotonic() + 60
    while len(finished_rows(run / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGTERM)
    process.join(60)
    assert process.exitcode == 143  # 128 + SIGTERM, as the README says
    (saved,) = checkpoint.checkpoints(run)
    step = int(saved.name.split("-")[1])
    assert checkpoint.verify(saved) == "" and [
        r["step"] for r in read_rows(run / "metrics.jsonl")
    ] == list(range(1, step + 1))
    assert torch.load(saved / checkpoint.STATE, weights_only=True)["train"]["step"] == step

    assert run_grpo(["train", str(path), "--resume"]) == 0
    _, expected = train_to(tmp_path, "expected", overrides)
    assert_same_run(run, expected)


def test_a_second_signal_stops_at_once(
    tmp_path, write_config, start_grpo, read_rows, finished_rows
):
    path = write_config(
        tmp_path, "run", ["training.max_steps=50", "training.save_steps=0", "eval.every=0"]
    )
    data = yaml.safe_load(path.read_text())
    data["rewards"]["funcs"] = [f"{tmp_path / 'rewards.py'}:slow"]
    path.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    process = start_grpo(["train", str(path)])
    deadline = time.monotonic() + 60
    while not finished_rows(run / "metrics.jsonl") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # past step 1's end (where a first signal would save checkpoint-1), into step 2
    os.kill(process.pid, signal.SIGINT)
    time.sleep(0.1)  # two separate signals (the same one twice at once is delivered once)
    os.kill(process.pid, signal.SIGINT)
    process.join(60)
    assert process.exitcode == 130  # 128 + SIGINT
    assert len(read_rows(run / "metrics.jsonl")) < 3
    assert not checkpoint.checkpoints(run)  # at once: not at the step's end with a checkpoint


# ---------------------------------------------------------------- run directories


def test_output_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys, write_config):
    path = write_config(tmp_path, "run")
    (tmp_path / "run").write_text("not a directory")
    assert main(["train", str(path)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(
        ConfigError, match=r"output_dir: .* is a file, not a directory; set output_dir"
    ):
        runlog.check_output_dir(tmp_path / "run", overwrite=True)


def test_a_run_stopped_before_its_first_checkpoint_is_simply_rerun(
    tmp_path, write_config, run_grpo, read_rows
):
    path = write_config(tmp_path, "run", ["training.save_steps=3", "eval.every=0"])
    run = tmp_path / "run"
    assert run_grpo(["train", str(path)], kill_at="step:2") == -signal.SIGKILL
    assert read_rows(run / "metrics.jsonl") and not checkpoint.checkpoints(run)
    # rerun; killed mid-way through its first save
    assert run_grpo(["train", str(path)], kill_at="save:1") == -signal.SIGKILL
    # the half-written one is hidden, never taken for a checkpoint
    assert not checkpoint.checkpoints(run)
    assert [p.name for p in run.iterdir() if p.name.startswith(".checkpoint-3.tmp-")]
    # no overwrite_output_dir needed
    assert run_grpo(["train", str(path), "training.max_steps=2"]) == 0
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == [run_lock.LOCK]
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2]


def test_a_run_with_checkpoints_is_kept_unless_overwritten(tmp_path, capsys, train_to):
    path, run = train_to(tmp_path, "run", ["training.max_steps=2", "eval.after=false"])
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "already holds a run (checkpoint-1/, checkpoint-2/, final/)" in err
    assert "--resume" in err and "overwrite_output_dir=true" in err
    assert main(["train", str(path), "overwrite_output_dir=true", "training.save_steps=0"]) == 0
    # the old run's checkpoints are gone
    assert [p.name for p in checkpoint.checkpoints(run)] == ["final"]


def test_a_failed_start_writes_nothing(tmp_path, write_config):
    path = write_config(tmp_path, "run")
    data = yaml.safe_load(path.read_text())
    data["rewards"]["funcs"] = ["no_such_reward"]
    path.write_text(yaml.safe_dump(data))
    assert main(["train", str(path)]) == 2
    assert not (tmp_path / "run").exists()


def test_resume_without_a_checkpoint_starts_from_step_0(tmp_path, capsys, write_config):
    path = write_config(
        tmp_path, "run", ["training.max_steps=1", "eval.every=0", "eval.after=false"]
    )
    assert main(["train", str(path), "--resume"]) == 0
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", str(path), "--resume", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_resuming_a_finished_run_neither_repeats_nor_loses_its_evaluations(
    tmp_path, read_rows, train_to
):
    path, run = train_to(tmp_path, "run", ["training.max_steps=2", "eval.every=0"])
    labels = lambda: [(r["label"], r["step"]) for r in read_rows(run / "eval.jsonl")]  # noqa: E731
    assert labels() == [("after", 2), ("after", 2)]  # greedy and sampled
    # as if killed during the "after" evaluation: resumed from final/, it is redone, not repeated
    assert main(["train", str(path), "--resume"]) == 0
    assert labels() == [("after", 2), ("after", 2)]
    # trained on for longer: the old "after" stays, at its step
    assert main(["train", str(path), "--resume", "training.max_steps=3"]) == 0
    assert labels() == [("after", 2), ("after", 2), ("after", 3), ("after", 3)]
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2, 3]


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
    assert [key for key, _, _ in checkpoint.config_differences(saved, now)] == [
        "training.learning_rate"
    ]


# ---------------------------------------------------------------- tools

TOOLS = [
    "data.chat_template=auto",  # the template offers the tool and renders its results
    "rollout.tools=[mytools.py:lookup]",  # found beside the config, in every process
    "rollout.max_completion_length=24",  # a call and its result (18 tokens), and a reply
    "training.max_steps=4",
]


def test_killed_and_resumed_with_tools_is_the_uninterrupted_run(
    tmp_path, save_tool_model, write_config, run_grpo, read_rows, assert_same_run
):
    """The model's sampled calls run the tool (in forked processes, the default isolation); the
    run is killed in step 3, the step after an evaluation (eval.every=2, whose completions call
    the tool too), and resumed from checkpoint-2: its metrics, tool metrics among them, samples,
    evaluations and weights are the uninterrupted run's."""
    overrides = [*TOOLS, f"model.name={save_tool_model(tmp_path)}"]
    assert run_grpo(["train", str(write_config(tmp_path, "expected", overrides))]) == 0
    expected = read_rows(tmp_path / "expected" / "metrics.jsonl")
    # calls happened, some of them failed (key z): the comparison covers both counts
    assert all(row["tools/call_frequency"] > 0 for row in expected), expected
    assert any(row["tools/failure_frequency"] > 0 for row in expected), expected

    cfg = write_config(tmp_path, "killed", overrides)
    assert run_grpo(["train", str(cfg)], kill_at="step:3") == -signal.SIGKILL
    assert checkpoint.latest_checkpoint(tmp_path / "killed").name == "checkpoint-2"
    assert run_grpo(["train", str(cfg), "--resume"]) == 0
    tools = lambda rows: [{k: v for k, v in r.items() if k.startswith("tools/")} for r in rows]  # noqa: E731
    got = read_rows(tmp_path / "killed" / "metrics.jsonl")
    for a, b in zip(tools(got), tools(expected), strict=True):
        assert {**a, "tools/seconds": 0} == {**b, "tools/seconds": 0}
    assert_same_run(tmp_path / "killed", tmp_path / "expected")
