"""output_dir may be absent, empty, a grpo run, or anything else only with overwrite_output_dir,
and then nothing grpo did not write is changed: every file that was there before is checked byte
for byte afterwards, the config file given on the command line (kept in output_dir) included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.run import run_lock, runlog

pytestmark = pytest.mark.usefixtures("quick")

SETTINGS = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 4], [1, 4]],
            "operators": ["+"],
            "num_train": 20,
            "num_eval": 2,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 2},
    "rewards": {"isolation": "thread"},
    "training": {"max_steps": 1, "per_device_train_batch_size": 8},
    "logging": {"sample_every": 0},
}
USER_CONFIG = "# my experiment: keep these notes\n"


def _users_folder(root: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A folder of the user's: notes, a subfolder, and the config grpo is run with, output_dir
    pointing at the folder itself."""
    folder = root / "mine"
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_bytes(b"do not lose this\n")
    (folder / "data" / "rows.csv").write_bytes(b"a,b\n1,2\n")
    config = {**SETTINGS, "output_dir": str(folder)}
    (folder / "config.yaml").write_text(USER_CONFIG + yaml.safe_dump(config))
    for name, data in (extra or {}).items():
        (folder / name).write_bytes(data)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _grpo_lines(captured) -> list[str]:
    return [line for line in captured.err.splitlines() if line.startswith("grpo:")]


@pytest.mark.parametrize("through", ["itself", "a symlink"])
def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, capsys, through):
    folder = _users_folder(tmp_path)
    before = _files(folder)
    config = folder / "config.yaml"
    if through == "a symlink":
        (tmp_path / "link").symlink_to(folder)
        argv = ["train", str(config), f"output_dir={tmp_path / 'link'}"]
    else:
        argv = ["train", str(config)]
    assert main(argv) == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert "is not empty and holds no grpo run" in line and "overwrite_output_dir=true" in line
    assert "notes.txt" in line
    assert _files(folder) == before  # nothing changed, nothing added (not even the lock)


def test_overwrite_writes_the_run_beside_the_users_files_and_changes_none(tmp_path, capsys):
    folder = _users_folder(tmp_path)
    before = _files(folder)
    assert main(["train", str(folder / "config.yaml"), "overwrite_output_dir=true"]) == 0
    after = _files(folder)
    assert {name: after[name] for name in before} == before  # every file of the user's, as it was
    # the run's own files beside them; its resolved config under a name of its own
    assert "metrics.jsonl" in after and "final/model.safetensors" in after
    resolved = yaml.safe_load(after[runlog.RESOLVED_ELSEWHERE])
    assert resolved["output_dir"] == str(folder)
    assert "left as it is" in capsys.readouterr().out
    # the folder is a run now: run again with overwrite, the user's files still stay
    assert run_lock.is_a_run(folder)
    assert main(["train", str(folder / "config.yaml"), "overwrite_output_dir=true"]) == 0
    after = _files(folder)
    assert {name: after[name] for name in before} == before


def test_overwrite_refuses_a_file_of_the_users_under_a_name_a_run_writes(tmp_path, capsys):
    folder = _users_folder(tmp_path, {"metrics.jsonl": b'{"mine": 1}\n', "report.md": b"# mine\n"})
    before = _files(folder)
    assert main(["train", str(folder / "config.yaml"), "overwrite_output_dir=true"]) == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert "metrics.jsonl, report.md" in line and "which grpo did not write" in line
    assert _files(folder) == before


def test_a_run_rewrites_its_own_config_but_never_the_users(tmp_path):
    """A run directory's config.yaml written by grpo is grpo's to replace; a config.yaml without
    grpo's first line is the user's, even in a run directory."""
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**SETTINGS, "output_dir": str(run)}))
    assert main(["train", str(config)]) == 0
    assert runlog.resolved_config_path(run) == run / "config.yaml"
    assert (run / "config.yaml").read_text().startswith("# written by grpo")
    (run / "config.yaml").write_text(USER_CONFIG)  # the user's own, now
    assert main(["train", str(config), "overwrite_output_dir=true"]) == 0
    assert (run / "config.yaml").read_text() == USER_CONFIG
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_an_empty_or_absent_folder_and_a_run_need_no_overwrite(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "absent"):
        run_lock.check_claimable(folder, overwrite=False)
    (empty / run_lock.LOCK).write_text("")  # what every run leaves: a run, with or without files
    (empty / "notes.txt").write_text("x")
    run_lock.check_claimable(empty, overwrite=False)
