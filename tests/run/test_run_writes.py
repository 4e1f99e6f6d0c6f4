"""grpo.run.run_writes: each way a run writes in its directory never follows a link below it,
and refuses one (UnsafeRunPath, naming the path and the fix) rather than writing through it."""

from __future__ import annotations

import os
import stat

import pytest

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.run import run_writes, runlog
from grpo.run.run_writes import UnsafeRunPath


@pytest.fixture
def places(tmp_path):
    """(the run directory, a folder of the user's with one file in it)."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    run.mkdir()
    mine.mkdir()
    (mine / "notes.txt").write_bytes(b"mine\n")
    return run, mine


def test_a_whole_file_is_replaced_atomically_as_a_regular_file(places):
    run, _ = places
    path = run_writes.replace_file(run, "report.md", "first\n")
    run_writes.replace_file(run, "report.md", b"second\n")
    assert path == run / "report.md" and path.read_bytes() == b"second\n"
    run_writes.replace_file(run, "plots/reward.png", lambda f: f.write(b"\x89PNG"))
    assert (run / "plots" / "reward.png").read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in run.rglob("*")) == [
        "plots",
        "report.md",
        "reward.png",
    ]  # no temporaries


@pytest.mark.parametrize("name", ["report.md", "plots/reward.png"])
def test_a_whole_file_is_not_written_through_a_link_to_a_file(places, name):
    run, mine = places
    (run / "plots").mkdir()
    (run / name).symlink_to(mine / "notes.txt")
    with pytest.raises(UnsafeRunPath, match=r"is a symbolic link .*remove the link"):
        run_writes.replace_file(run, name, "theirs")
    assert (mine / "notes.txt").read_bytes() == b"mine\n"
    assert (run / name).is_symlink()


def test_nothing_is_written_into_a_linked_directory(places):
    run, mine = places
    (run / "plots").symlink_to(mine)
    for write in (
        lambda: run_writes.replace_file(run, "plots/reward.png", b"png"),
        lambda: run_writes.make_directory(run, "plots"),
        lambda: run_writes.remove(run, "plots/notes.txt"),
        lambda: run_writes.open_append(run, "plots/render.log"),
    ):
        with pytest.raises(UnsafeRunPath, match=f"{run / 'plots'} is a symbolic link"):
            write()
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    assert (mine / "notes.txt").read_bytes() == b"mine\n"


def test_a_log_is_appended_to_its_own_file_only(places):
    run, mine = places
    with run_writes.open_append(run, "metrics.jsonl") as f:
        f.write('{"step": 1}\n')
    with run_writes.open_append(run, "metrics.jsonl") as f:
        f.write('{"step": 2}\n')
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'

    (run / "samples.jsonl").symlink_to(mine / "notes.txt")
    (run / "eval.jsonl").symlink_to(mine / "absent.jsonl")  # dangling: not created either
    for name in ("samples.jsonl", "eval.jsonl"):
        with pytest.raises(UnsafeRunPath, match="is a symbolic link"):
            run_writes.open_append(run, name)
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    assert (mine / "notes.txt").read_bytes() == b"mine\n"


def test_a_named_pipe_is_refused_without_waiting_for_a_reader(places):
    run, _ = places
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(UnsafeRunPath, match="is a named pipe"):
        run_writes.open_append(run, "metrics.jsonl")
    with pytest.raises(UnsafeRunPath, match="is a named pipe"):
        run_writes.read_own(run, "metrics.jsonl")
    assert stat.S_ISFIFO(os.lstat(run / "metrics.jsonl").st_mode)


def test_reading_back_follows_no_link(places):
    run, mine = places
    assert run_writes.read_own(run, "metrics.jsonl") is None
    (run / "metrics.jsonl").write_bytes(b"0123456789")
    assert run_writes.read_own(run, "metrics.jsonl", 4) == b"0123"
    (run / "config.yaml").symlink_to(mine / "notes.txt")
    with pytest.raises(UnsafeRunPath):
        run_writes.read_own(run, "config.yaml")


def test_removing_a_link_removes_the_link_only(places):
    run, mine = places
    (run / "metrics.jsonl").symlink_to(mine / "notes.txt")
    run_writes.remove(run, "metrics.jsonl")
    run_writes.remove(run, "metrics.jsonl")  # absent: nothing to do
    assert not os.path.lexists(run / "metrics.jsonl")
    assert (mine / "notes.txt").read_bytes() == b"mine\n"


def test_a_name_missing_from_the_list_cannot_be_written(places):
    """A writer that took a name of its own would escape the claim check's list."""
    run, _ = places
    for name in ("notes.md", "../mine/notes.txt", "plots/../notes.md", "/etc/passwd"):
        with pytest.raises(ValueError, match="RUN_NAMES"):
            run_writes.replace_file(run, name, "x")
    assert os.listdir(run) == []


def test_the_start_up_check_refuses_links_and_wrong_kinds_but_not_a_users_config(places):
    run, mine = places
    (run / "config.yaml").symlink_to(mine / "notes.txt")  # the user's config: allowed
    (run / "notes.txt").symlink_to(mine / "notes.txt")  # not a name a run writes: allowed
    (run / "checkpoint-3").mkdir()
    run_writes.check_run_names(run)
    (run / "final").symlink_to(run / "checkpoint-3")  # a link even within the run directory
    with pytest.raises(UnsafeRunPath, match=f"{run / 'final'} is a symbolic link"):
        run_writes.check_run_names(run)
    run_writes.check_run_names(run, ("report.md", "plots"))  # only those
    (run / "final").unlink()
    (run / "plots").write_text("")
    with pytest.raises(UnsafeRunPath, match="is a file where the run writes its own directory"):
        run_writes.check_run_names(run)
    assert issubclass(UnsafeRunPath, ConfigError)  # one grpo: line from the command line, exit 2


def test_temporaries_of_a_killed_process_are_removed_and_a_running_ones_kept(places):
    run, _ = places
    dead = 2**22 + 7  # above Linux's largest PID (pid_max is at most 2**22)
    leftover = run / f".report.md.tmp-{dead}-0123abcd"
    mine = run / f".report.md.tmp-{os.getpid()}-0123abcd"
    other = run / ".notes.tmp-1-0123abcd"  # not a run name's: not the run's to remove
    for path in (leftover, mine, other):
        path.write_text("")
    run_writes.remove_temporaries(run)
    assert sorted(p.name for p in run.iterdir()) == sorted([mine.name, other.name])


def test_the_end_of_run_report_refuses_a_link_planted_during_the_run_and_the_run_ends(
    places, capsys
):
    """A link put in place of plots/ while the run trained: no report, one line saying why, and
    the run's end (its checkpoints already saved) goes on."""
    run, mine = places
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (run / "plots").symlink_to(mine)
    log = runlog.RunLog(loading.from_dict({"output_dir": str(run)}))
    log.report()
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("grpo:")]
    assert line.startswith("grpo: no report written:") and "plots is a symbolic link" in line
    assert sorted(os.listdir(mine)) == ["notes.txt"]
    assert not (run / "report.md").exists()
