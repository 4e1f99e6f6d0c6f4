"""A run directory is safe to share and to resume from: a checkpoint's train state is read
without running code from it; a checkpoint that cannot be loaded (a crafted or an old pickle,
a file cut short with its manifest rewritten, NaN weights) is passed over for the one before
it, or refused when named; one run at a time holds output_dir (a second `grpo train`, a
`--resume`, an `overwrite_output_dir=true` are refused, naming the PID); an unwritable
output_dir is refused before the model loads, and a full disk ends the run with the
previous checkpoint intact and a message that says so.

The runs are `grpo train` as in tests/run/test_resume.py (the fixtures of tests/run/conftest.py):
children, or `main` in this process."""

import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import time
from collections import namedtuple
from pathlib import Path

import numpy
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from grpo.cli import main
from grpo.config import loading as config
from grpo.config.errors import ConfigError
from grpo.run import checkpoint, run_lock

pytestmark = pytest.mark.usefixtures("quick")

SHORT = ["training.max_steps=3", "training.save_steps=1", "eval.every=0", "eval.after=false"]


def _rewrite_manifest(directory: Path) -> None:
    """The manifest made to match the files as they are now: what anyone sharing a checkpoint can do."""
    manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
    for name in manifest["files"]:
        data = (directory / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    assert checkpoint.verify(directory) == ""


class _WritesAFile:
    """Unpickled, it would create `path` (as any code a pickle names could run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


# ---------------------------------------------------------------- checkpoints safe to load


def test_a_crafted_train_state_runs_no_code_and_is_refused_or_passed_over(
    tmp_path, capsys, caplog, read_rows, train_to
):
    path, run = train_to(tmp_path, "run", SHORT)
    marker = tmp_path / "code-ran"
    # in final/: a torch.save archive whose pickle calls os.system; in checkpoint-3: a bare pickle
    torch.save(
        {"train": {"step": 3}, "payload": _WritesAFile(marker)}, run / "final" / checkpoint.STATE
    )
    (run / "checkpoint-3" / checkpoint.STATE).write_bytes(
        pickle.dumps({"train": _WritesAFile(marker)})
    )
    for name in ("final", "checkpoint-3"):
        _rewrite_manifest(run / name)

    # named explicitly: refused, saying why
    assert main(["train", str(path), "--resume", str(run / "final")]) == 2
    err = capsys.readouterr().err
    assert (
        "grpo: config error: --resume" in err
        and "train_state.pt was written by an older grpo whose train state "
        "needs unpickling arbitrary objects (posix.system); it cannot be loaded safely"
        in err
    )
    assert main(["train", str(path), "--resume", str(run / "checkpoint-3")]) == 2
    assert (
        "train_state.pt is unreadable (not a file written by torch.save)" in capsys.readouterr().err
    )
    assert not marker.exists()

    # --resume alone: both passed over with a warning, the run continues from checkpoint-2
    with caplog.at_level("WARNING"):
        assert main(["train", str(path), "--resume", "training.max_steps=4"]) == 0
    assert not marker.exists()
    assert (
        f"checkpoint {run / 'final'} cannot be loaded (train_state.pt was written by an older grpo"
        in caplog.text
    )
    assert (
        f"checkpoint {run / 'checkpoint-3'} cannot be loaded (train_state.pt is unreadable"
        in caplog.text
    )
    assert f"resuming from {run / 'checkpoint-2'} instead" in caplog.text
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert checkpoint.problem(run / "final") == ""


def test_a_train_state_that_needs_unpickling_numpy_is_refused_as_an_older_grpos(tmp_path, train_to):
    path, run = train_to(tmp_path, "run", SHORT)
    state = torch.load(run / "final" / checkpoint.STATE, weights_only=True)
    assert isinstance(state["train"]["rng"]["numpy"], list)  # NumPy's key array saved as ints
    state["train"]["rng"]["numpy"] = numpy.random.get_state()  # as grpo wrote it before: an ndarray
    torch.save(state, run / "final" / checkpoint.STATE)
    _rewrite_manifest(run / "final")
    with pytest.raises(
        ConfigError,
        match=r"older grpo .*numpy.*cannot be loaded safely: start afresh or resume "
        r"with the grpo version that wrote it",
    ):
        checkpoint.load_checkpoint(run / "final", config.load(path))


def test_a_checkpoint_that_fails_to_load_is_passed_over_and_a_named_one_refused(
    tmp_path, capsys, caplog, run_grpo, train_to, assert_same_run
):
    overrides = [
        "training.max_steps=4",
        "training.save_steps=1",
        "eval.every=0",
        "eval.after=false",
    ]
    path, run = train_to(tmp_path, "run", overrides)
    # final/: train state cut short; checkpoint-4: weights cut short; checkpoint-3: a NaN weight
    state = (run / "final" / checkpoint.STATE).read_bytes()
    (run / "final" / checkpoint.STATE).write_bytes(state[: len(state) // 2])
    weights = (run / "checkpoint-4" / "model.safetensors").read_bytes()
    (run / "checkpoint-4" / "model.safetensors").write_bytes(weights[:-100])
    tensors = load_file(run / "checkpoint-3" / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, run / "checkpoint-3" / "model.safetensors", metadata={"format": "pt"})
    for directory in ("final", "checkpoint-4", "checkpoint-3"):
        _rewrite_manifest(run / directory)

    assert "train_state.pt is unreadable" in checkpoint.problem(run / "final")
    assert "model.safetensors is unreadable" in checkpoint.problem(run / "checkpoint-4")
    assert (
        f"model.safetensors holds non-finite weights (NaN or infinity in {name})"
        == checkpoint.problem(run / "checkpoint-3")
    )
    with caplog.at_level("WARNING"):
        assert checkpoint.latest_checkpoint(run) == run / "checkpoint-2"
    for bad in ("final", "checkpoint-4", "checkpoint-3"):
        assert f"checkpoint {run / bad} cannot be loaded" in caplog.text

    # named: refused with the file and the reason, before the model is loaded
    assert main(["train", str(path), "--resume", str(run / "checkpoint-3")]) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume {run / 'checkpoint-3'}: cannot resume from it: model.safetensors holds non-finite weights"
        in err
    )

    # --resume alone: from checkpoint-2, and the run ends as the one never damaged
    assert run_grpo(["train", str(path), "--resume"]) == 0
    _, expected = train_to(tmp_path, "expected", overrides)
    assert_same_run(run, expected)


def test_a_checkpoint_tensor_of_another_shape_is_passed_over_and_a_named_one_refused(
    tmp_path, capsys, caplog, train_to
):
    """A weight cut to another shape with the manifest rewritten to match: passed over (or, named,
    refused in one line) like any checkpoint that cannot be loaded, never a raw size mismatch; and
    one whose config.json was changed to match it too is refused against the run's own model."""
    overrides = [
        "training.max_steps=2",
        "training.save_steps=1",
        "eval.every=0",
        "eval.after=false",
    ]
    path, run = train_to(tmp_path, "run", overrides)
    for directory in ("final", "checkpoint-2"):
        tensors = load_file(run / directory / "model.safetensors")
        for name in ("model.embed_tokens.weight", "lm_head.weight"):  # one token fewer
            tensors[name] = tensors[name][:-1].clone()
        save_file(tensors, run / directory / "model.safetensors", metadata={"format": "pt"})
        _rewrite_manifest(run / directory)
    why = checkpoint.problem(run / "checkpoint-2")
    assert why.startswith("model.safetensors: lm_head.weight has shape [") and (
        "and the model of its config.json" in why
    )
    with caplog.at_level("WARNING"):
        assert checkpoint.latest_checkpoint(run) == run / "checkpoint-1"
    assert main(["train", str(path), "--resume", str(run / "checkpoint-2")]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo:")]
    assert "cannot resume from it: model.safetensors: lm_head.weight has shape" in line

    # the checkpoint's own config.json made to agree: it fits itself, not the run's model
    conf = json.loads((run / "checkpoint-2" / "config.json").read_text())
    conf["vocab_size"] -= 1
    (run / "checkpoint-2" / "config.json").write_text(json.dumps(conf))
    _rewrite_manifest(run / "checkpoint-2")
    assert checkpoint.problem(run / "checkpoint-2") == ""
    assert main(["train", str(path), "--resume", str(run / "checkpoint-2")]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("grpo:")]
    assert "its weights do not fit model.name's model (" in line and "in the model" in line
    assert "Traceback" not in capsys.readouterr().err


# ---------------------------------------------------------------- one run per output_dir

GATE = """
import pathlib
import time

calls = 0


def gated(completions, **kwargs):
    # the first step's rewards wait for the test to open the gate: the run is surely going meanwhile
    global calls
    calls += 1
    gate = pathlib.Path(__file__).with_name("gate")
    while calls == 1 and not gate.exists():
        time.sleep(0.01)
    return [0.0] * len(completions)
"""


def _gated_config(write_config, tmp_path, overrides):
    path = write_config(tmp_path, "run", overrides)
    (tmp_path / "gated.py").write_text(GATE)
    data = yaml.safe_load(path.read_text())
    data["rewards"]["funcs"] = [*data["rewards"]["funcs"], f"{tmp_path / 'gated.py'}:gated"]
    path.write_text(yaml.safe_dump(data))
    return path


def _wait_for(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_second_run_resume_or_overwrite_during_a_run_is_refused_naming_its_pid(
    tmp_path, write_config, read_rows, start_grpo
):
    path = _gated_config(write_config, tmp_path, SHORT)
    run = tmp_path / "run"
    lock = run / run_lock.LOCK
    first = start_grpo(["train", str(path)], err_path=tmp_path / "first.err")
    _wait_for(
        lambda: lock.is_file() and lock.read_text().startswith(f"{first.pid} "),
        "the first run's lock",
    )

    for n, extra in enumerate([[], ["--resume"], ["overwrite_output_dir=true"]]):
        err = tmp_path / f"second-{n}.err"
        second = start_grpo(["train", str(path), *extra], err_path=err)
        second.join(60)
        assert second.exitcode == 2, (extra, err.read_text())
        message = err.read_text()
        assert (
            message.startswith("grpo: config error: output_dir: ") and message.count("\n") == 1
        ), message
        assert f"is in use by another grpo run, process {first.pid}, which holds {lock}" in message
        assert first.is_alive()

    (tmp_path / "gate").touch()
    first.join(120)
    assert first.exitcode == 0, (tmp_path / "first.err").read_text()
    # the first run's results, as it wrote them alone
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_rows(run / "samples.jsonl")] == sorted(
        r["step"] for r in read_rows(run / "samples.jsonl")
    )
    assert [p.name for p in checkpoint.checkpoints(run)] == [
        "checkpoint-1",
        "checkpoint-2",
        "checkpoint-3",
        "final",
    ]
    assert all(checkpoint.problem(p) == "" for p in checkpoint.checkpoints(run))
    # over: the directory is free again (a resume of the finished run is accepted)
    assert main(["train", str(path), "--resume"]) == 0


def test_a_sigkilled_run_leaves_no_stale_lock(tmp_path, write_config, run_grpo, read_rows):
    path = write_config(tmp_path, "run", SHORT)
    run = tmp_path / "run"
    # step 2 logged, checkpoint-1 saved
    assert run_grpo(["train", str(path)], kill_at="logged:2") == -signal.SIGKILL
    assert (run / run_lock.LOCK).is_file()  # the file stays; its lock died with the process
    assert [p.name for p in checkpoint.checkpoints(run)] == ["checkpoint-1"]
    assert run_grpo(["train", str(path), "--resume"]) == 0  # no manual unlock
    assert [r["step"] for r in read_rows(run / "metrics.jsonl")] == [1, 2, 3]


def test_trainers_in_one_process_share_its_claim_and_a_failed_start_leaves_nothing(tmp_path):
    first = run_lock.claim(tmp_path / "a" / "b")
    # e.g. GRPOTrainer's trainer replaced by one that resumes
    again = run_lock.claim(tmp_path / "a" / "b")
    first.release()
    assert again.held
    again.abandon()  # the last: created here and holding only the lock file, the directories go
    assert not (tmp_path / "a").exists()
    kept = run_lock.claim(tmp_path / "c")
    (tmp_path / "c" / "metrics.jsonl").write_text("")
    kept.abandon()
    assert (tmp_path / "c" / "metrics.jsonl").is_file()  # what it holds stays


# ---------------------------------------------------------------- unwritable or full disks


def test_an_unwritable_output_dir_is_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch, write_config
):
    path = write_config(tmp_path, "run", SHORT)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("grpo.training.build.load_model_and_tokenizer", no_model)
    assert main(["train", str(path), "output_dir=/proc/no/such/dir"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "grpo: config error: output_dir: cannot write to /proc/no/such/dir (No such file or directory); "
            "set output_dir to a directory"
        )
        and err.count("\n") == 1
    )

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    with pytest.raises(
        ConfigError, match=r"output_dir: cannot write to .*run \(Read-only file system\)"
    ):
        run_lock.claim(tmp_path / "run")


def test_too_little_free_space_for_a_checkpoint_is_warned_at_start(
    tmp_path, monkeypatch, caplog, write_config
):
    from grpo.training.trainer import Trainer

    path = write_config(tmp_path, "run", SHORT)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 << 20, 10 << 20, 1000))
    with caplog.at_level("WARNING"):
        trainer = Trainer.from_config(config.load(path))
    size = checkpoint.estimated_size(trainer.model)
    params = sum(p.numel() for p in trainer.model.parameters())
    assert size == 3 * 4 * params  # float32 weights, and AdamW's two moments of each
    assert (
        f"output_dir {tmp_path / 'run'} has 1000 B free, less than one checkpoint needs (about "
        f"{checkpoint.format_bytes(size)}" in caplog.text
    )


def test_a_full_disk_at_a_save_keeps_the_previous_checkpoint_and_says_so(
    tmp_path, capsys, monkeypatch, write_config, run_grpo, train_to, assert_same_run
):
    overrides = [
        "training.max_steps=3",
        "training.save_steps=1",
        "eval.every=0",
        "eval.after=false",
    ]
    path = write_config(tmp_path, "run", overrides)
    run = tmp_path / "run"
    real_save = torch.save

    def disk_full_at_step_2(obj, f, *args, **kwargs):
        target = getattr(f, "path", f)  # the train state goes through a HashedFile
        if "checkpoint-2" in str(target):
            Path(target).write_bytes(b"half")  # a part written, then the disk is full
            monkeypatch.setattr(
                shutil,
                "disk_usage",
                lambda p: namedtuple("Usage", "total used free")(1 << 30, 1 << 30, 0),
            )
            # torch.save's words for a write the disk refused
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . unexpected pos 1536 vs 1428"
            )
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_2)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"could not write {run / 'checkpoint-2'} ([enforce fail at inline_container.cc:664] . unexpected pos "
        in err
    )
    assert (
        "the disk is full: 0 B free); the checkpoints before it (checkpoint-1) are intact: free space or point "
        "output_dir elsewhere, then resume with --resume" in err
    )
    assert err.count("\n") == 1  # one line, no traceback
    # no half-written one
    assert not [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != run_lock.LOCK]
    assert [p.name for p in checkpoint.checkpoints(run)] == ["checkpoint-1"] and checkpoint.problem(
        run / "checkpoint-1"
    ) == ""

    monkeypatch.undo()  # space freed
    assert run_grpo(["train", str(path), "--resume"]) == 0
    _, expected = train_to(tmp_path, "expected", overrides)
    assert_same_run(run, expected)


def test_a_failed_replacement_keeps_the_checkpoint_it_would_replace(tmp_path):
    target = tmp_path / "final"
    checkpoint.atomic_directory_write(target, lambda d: (d / "a").write_text("old"), step=1)

    def fails(directory):
        (directory / "a").write_text("new, cut")
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(
        checkpoint.SaveFailed,
        match=r"could not write .*final \(Disk quota exceeded; .* free\); the "
        r"checkpoints before it \(final\) are intact",
    ):
        checkpoint.atomic_directory_write(target, fails, step=2)
    assert (target / "a").read_text() == "old" and checkpoint.manifest_step(target) == 1
    with pytest.raises(checkpoint.SaveFailed, match=r"\(No space left on device; "):
        checkpoint.atomic_directory_write(
            target, lambda d: _raise(OSError(errno.ENOSPC, "No space left on device")), step=2
        )
    assert (target / "a").read_text() == "old" and checkpoint.manifest_step(target) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    with pytest.raises(
        ValueError, match="a bug"
    ):  # not the disk: raised as it is, the temporary directory gone
        checkpoint.atomic_directory_write(target, lambda d: _raise(ValueError("a bug")), step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def _raise(error):
    raise error
