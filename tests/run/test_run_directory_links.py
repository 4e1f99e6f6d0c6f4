"""A run writes its files only inside its run directory, never through a link: a link planted
where a run writes (a log, plots/, the lock, final/) is refused with one grpo: line naming it and
the fix, before anything is written, and what it points to is left byte for byte as it was; a
config.yaml that is a link is the user's (left alone; the resolved config goes to
config.resolved.yaml). Each test runs `grpo` as a user would, through its command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from grpo.cli import main
from grpo.config.errors import ConfigError
from grpo.run import run_lock

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
    "training": {"max_steps": 1, "per_device_train_batch_size": 8, "save_steps": 1},
    "eval": {"after": True, "temperatures": [0.0]},
    "logging": {"sample_every": 1},
}


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (links not followed) and its bytes; a link as its target's name."""
    out = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[name] = b"-> " + str(path.readlink()).encode()
        elif path.is_file():
            out[name] = path.read_bytes()
    return out


def _grpo_lines(captured) -> list[str]:
    return [line for line in captured.err.splitlines() if line.startswith("grpo:")]


def _config(tmp_path: Path, run: Path, **sections) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**SETTINGS, **sections, "output_dir": str(run)}))
    return path


def _trained(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory of a finished 1-step run (metrics, samples, eval, checkpoint-1/, final/)
    and its config."""
    run = tmp_path / "run"
    config = _config(tmp_path, run)
    assert main(["train", str(config)]) == 0
    return run, config


def _users(tmp_path: Path) -> Path:
    """A folder of the user's, outside the run directory."""
    mine = tmp_path / "mine"
    (mine / "pictures").mkdir(parents=True)
    (mine / "notes.txt").write_bytes(b"do not lose this\n")
    (mine / "pictures" / "reward.png").write_bytes(b"my own picture")
    return mine


def _moved_out(run: Path, name: str, mine: Path) -> Path:
    """`name` moved from the run directory into the user's folder, a link left in its place (as a
    user keeping a run's logs on another disk would do); the link's target."""
    target = mine / f"moved-{name.lstrip('.')}"
    shutil.move(str(run / name), str(target))
    (run / name).symlink_to(target)
    return target


@pytest.mark.parametrize(
    "name, how",
    [
        ("metrics.jsonl", "--resume"),
        ("metrics.jsonl", "overwrite_output_dir=true"),
        ("samples.jsonl", "--resume"),
        ("eval.jsonl", "--resume"),
        ("final", "--resume"),
        ("checkpoint-1", "overwrite_output_dir=true"),
        ("plots", "overwrite_output_dir=true"),
        ("config.resolved.yaml", "overwrite_output_dir=true"),
        (".grpo.lock", "overwrite_output_dir=true"),
        ("metrics.jsonl (dangling)", "--resume"),
    ],
)
def test_a_link_where_a_run_writes_is_refused_and_what_it_points_to_is_kept(
    tmp_path, capsys, name, how
):
    run, config = _trained(tmp_path)
    mine = _users(tmp_path)
    if name == "plots":
        (run / "plots").symlink_to(mine / "pictures")
    elif name == "config.resolved.yaml":
        (mine / "resolved.yaml").write_bytes((run / "config.yaml").read_bytes())
        (run / name).symlink_to(mine / "resolved.yaml")
    elif name == ".grpo.lock":
        (run / name).unlink()
        (run / name).symlink_to(mine / "notes.txt")
    elif name.endswith("(dangling)"):
        name = name.split()[0]
        (run / name).unlink()
        (run / name).symlink_to(mine / "not-yet.jsonl")
    else:
        _moved_out(run, name, mine)
    before = _files(mine)
    capsys.readouterr()

    code = main(["train", str(config), how])
    assert _files(mine) == before  # nothing written there, nothing created
    assert (run / name).is_symlink()  # and the link itself is the user's to remove
    assert code == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert f"{run / name} is a symbolic link" in line and "remove the link" in line


def test_a_config_yaml_link_is_the_users_and_never_written_through(tmp_path, capsys):
    """A run directory's config.yaml that is a link, even to a config grpo wrote (another run's),
    is the user's: left as it is, the resolved config goes to config.resolved.yaml."""
    run, config = _trained(tmp_path)
    mine = _users(tmp_path)
    target = _moved_out(run, "config.yaml", mine)
    assert target.read_text().startswith("# written by grpo")
    before = _files(mine)
    capsys.readouterr()

    code = main(["train", str(config), "overwrite_output_dir=true", "training.seed=7"])
    assert _files(mine) == before
    assert code == 0 and "left as it is" in capsys.readouterr().out
    assert (run / "config.yaml").is_symlink()
    resolved = run / "config.resolved.yaml"
    assert resolved.is_file() and not resolved.is_symlink()
    assert yaml.safe_load(resolved.read_text())["training"]["seed"] == 7


@pytest.mark.parametrize("name", ["plots", "report.md"])
def test_grpo_report_refuses_a_link_where_it_writes_and_writes_nothing(tmp_path, capsys, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / run_lock.LOCK).write_text("")
    rows = [{"step": s, "reward": s / 4, "loss": 0.1, "kl": 0.01} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mine = _users(tmp_path)
    if name == "plots":
        (run / "plots").symlink_to(mine / "pictures")
    else:
        (run / "report.md").symlink_to(mine / "notes.txt")
    before = _files(mine)

    code = main(["report", str(run)])
    assert _files(mine) == before
    assert code == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert line.startswith("grpo: report:")
    assert f"{run / name} is a symbolic link" in line and "remove the link" in line
    assert sorted(p.name for p in run.iterdir()) == sorted([run_lock.LOCK, "metrics.jsonl", name])


PLANT = """
from pathlib import Path


def plant(completions, **kwargs):
    # a link where the run is about to append its samples, planted after the run has started
    link = Path({link!r})
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        link.symlink_to({target!r})
    return [0.0] * len(completions)
"""


def test_a_link_planted_while_the_run_goes_on_is_not_written_through(tmp_path, capsys):
    mine = _users(tmp_path)
    run = tmp_path / "run"
    rewards = tmp_path / "plant.py"
    rewards.write_text(
        PLANT.format(link=str(run / "samples.jsonl"), target=str(mine / "notes.txt"))
    )
    config = _config(tmp_path, run, rewards={"isolation": "thread", "funcs": [f"{rewards}:plant"]})
    before = _files(mine)

    code = main(["train", str(config)])
    assert _files(mine) == before
    assert code == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert f"{run / 'samples.jsonl'} is a symbolic link" in line


def test_overwrite_refuses_a_users_config_resolved_yaml(tmp_path, capsys):
    """config.resolved.yaml is a name a run writes (beside a config.yaml of the user's): a file of
    the user's under that name is refused like any other, never replaced."""
    folder = tmp_path / "mine"
    folder.mkdir()
    config = folder / "config.yaml"
    config.write_text("# my experiment\n" + yaml.safe_dump({**SETTINGS, "output_dir": str(folder)}))
    (folder / "config.resolved.yaml").write_bytes(b"# my own resolved notes\n")
    before = _files(folder)

    code = main(["train", str(config), "overwrite_output_dir=true"])
    assert _files(folder) == before
    assert code == 2
    [line] = _grpo_lines(capsys.readouterr())
    assert "config.resolved.yaml" in line and "which grpo did not write" in line


def test_every_name_a_run_writes_is_kept_from_a_users_files(tmp_path):
    """What a run (with evaluation, samples, checkpoints, a resolved config beside the user's
    config.yaml) and `grpo report` write in output_dir, listed after the fact: a file of the user's
    under any of those names makes overwrite_output_dir refuse the directory (the lock file marks a
    run and config.yaml may be the user's: those two are the run's by design)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"mine\n")
    config = folder / "config.yaml"
    config.write_text("# my experiment\n" + yaml.safe_dump({**SETTINGS, "output_dir": str(folder)}))
    users = {"notes.txt", "config.yaml"}
    assert main(["train", str(config), "overwrite_output_dir=true"]) == 0
    assert main(["report", str(folder)]) == 0
    written = {p.name: p.is_dir() for p in folder.iterdir() if p.name not in users}
    expected = {"config.resolved.yaml", "metrics.jsonl", "samples.jsonl", "eval.jsonl", "report.md"}
    assert expected | {"plots", "checkpoint-1", "final", run_lock.LOCK} <= set(written)

    for name, is_dir in written.items():
        if name == run_lock.LOCK:
            continue
        other = tmp_path / f"other-{name}"
        other.mkdir()
        (other / "notes.txt").write_bytes(b"mine\n")
        if is_dir:
            (other / name).mkdir()
        else:
            (other / name).write_bytes(b"mine\n")
        with pytest.raises(ConfigError, match="which grpo did not write"):
            run_lock.check_claimable(other, overwrite=True)
