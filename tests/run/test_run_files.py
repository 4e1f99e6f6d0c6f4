"""A run directory read back by `grpo doctor` and `grpo report` (grpo.run.run_files, the one reader
both use) as the hostile directory a stranger may hand over: files that are links to special
files, numbers out of range, evaluation rows of the wrong type, rows with thousands of reward
functions, millions of empty rows. Each answer is either the diagnosis and the report, or exit 2
with one `grpo:` line naming the file; never a traceback, a hang or memory without bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo.cli import main
from grpo.run import report, run_files
from grpo.run.doctor import diagnose_run
from grpo.run.eval_results import EvalResult, read_results
from grpo.run.run_files import RunFileError, read_metrics

COMMANDS = ("doctor", "report")


def _row(step: int, **values) -> dict:
    base = {
        "step": step,
        "reward": 0.5,
        "reward_std": 0.3,
        "frac_reward_zero_std": 0.0,
        "rewards/correct/mean": 0.5,
        "rewards/correct/std": 0.4,
        "loss": 0.05,
        "grad_norm": 1.0,
        "entropy": 1.0,
        "learning_rate": 1e-6,
        "num_tokens": 1000 * step,
        "time/step": 1.0,
    }
    return {**base, **values}


def _run(directory: Path, rows=None, evaluations=()) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".grpo.lock").write_text("1 host\n")
    rows = [_row(s) for s in range(1, 7)] if rows is None else rows
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evaluations:
        (directory / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    return directory


def _refusal(capsys, command: str, run: Path) -> str:
    """`grpo COMMAND RUN` in this process: exit 2, nothing on stdout, one grpo: line on stderr."""
    assert main([command, str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"grpo: {command}: ")
    return line


def _grpo(command: str, run: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """`grpo COMMAND RUN` as a user runs it, in its own process, bounded in time (a reader that
    blocks ends the test with TimeoutExpired, never hangs the suite)."""
    return subprocess.run(
        [sys.executable, "-m", "grpo.cli", command, str(run)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"grpo: {command}: ") and "Traceback" not in result.stderr
    return line


# ------------------------------------------------------------------ special files


def _in_time(capsys, command: str, run: Path, seconds: float = 30) -> str:
    """`_refusal` in a thread waited on for `seconds`: a reader that blocks fails the test
    instead of hanging the suite."""
    answer: list[str] = []
    thread = threading.Thread(target=lambda: answer.append(_refusal(capsys, command, run)))
    thread.daemon = True
    thread.start()
    thread.join(seconds)
    assert answer, f"grpo {command} did not answer within {seconds} s (or failed: see above)"
    return answer[0]


@pytest.mark.parametrize("name", ["metrics.jsonl", "eval.jsonl", "config.yaml", "samples.jsonl"])
def test_a_file_linked_to_a_fifo_is_refused_at_once_not_waited_on(tmp_path, capsys, name):
    run = _run(tmp_path / "run")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(fifo)
    # the doctor reads no samples; the report reads every file
    for command in COMMANDS if name != "samples.jsonl" else ("report",):
        line = _in_time(capsys, command, run)
        assert (
            f"{run / name} is not a regular file (a FIFO)" in line and "does not exist" not in line
        )


def test_the_commands_as_a_user_runs_them_on_a_fifo(tmp_path):
    run = _run(tmp_path / "run")
    os.mkfifo(tmp_path / "fifo")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(tmp_path / "fifo")
    for command in COMMANDS:
        line = _one_line(_grpo(command, run), command)
        assert "metrics.jsonl is not a regular file (a FIFO)" in line


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda p: p.mkdir(), "is not a regular file (a directory)"),
        (lambda p: p.symlink_to("/dev/zero"), "is not a regular file (a device)"),
        # a regular file under /proc whose read fails: /proc/self/mem at offset 0 raises EIO
        (lambda p: p.symlink_to("/proc/self/mem"), "cannot be read (Input/output error)"),
        (lambda p: p.symlink_to(p.parent / "gone"), "is a link to"),
    ],
    ids=["a directory", "a device", "an unreadable /proc file", "a dangling link"],
)
@pytest.mark.parametrize("name", ["metrics.jsonl", "eval.jsonl"])
def test_a_log_that_is_not_a_readable_file_is_named_in_one_line(tmp_path, capsys, make, said, name):
    run = _run(tmp_path / "run", evaluations=[_evaluation(0)])
    (run / name).unlink()
    make(run / name)
    for command in COMMANDS:
        line = _refusal(capsys, command, run)
        assert f"{run / name}" in line and said in line


def test_a_read_that_never_returns_is_given_up_on_in_time(tmp_path, monkeypatch):
    """A hung network mount: the read blocks in the kernel; the reader waits MAX_WAIT_SECONDS."""
    run = _run(tmp_path / "run")
    released = threading.Event()
    monkeypatch.setattr(run_files, "_read_chunk", lambda fd: released.wait() and b"")
    monkeypatch.setattr(run_files, "MAX_WAIT_SECONDS", 0.5)
    try:
        with pytest.raises(RunFileError, match=r"its bytes did not come within 0.5 s"):
            read_metrics(run)
    finally:
        released.set()  # the reading thread ends


# ------------------------------------------------------------------ numbers and rows


@pytest.mark.parametrize("key", ["reward", "loss", "num_tokens", "step"])
def test_a_400_digit_integer_is_refused_by_its_line_not_an_overflow(tmp_path, capsys, key):
    run = _run(tmp_path / "run")
    rows = (run / "metrics.jsonl").read_text().splitlines()
    rows[2] = json.dumps({**_row(3), key: "BIG"}).replace('"BIG"', "9" * 400)
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    for command in COMMANDS:
        line = _refusal(capsys, command, run)
        assert "metrics.jsonl:3: an integer of 400 digits" in line
        assert "nested too deeply" not in line


def test_numbers_at_the_edges_of_a_float_are_read_without_overflow(tmp_path, capsys):
    """What JSON can hold that a float cannot: the largest floats, NaN, Infinity, the largest
    64-bit integer where a count belongs; the doctor and the report (with its plots) take them."""
    pytest.importorskip("matplotlib")
    edges = ["1.7e308", "-1.7e308", "NaN", "Infinity", str(2**63 - 1), "1" * 300 + ".5"]
    lines = []
    for step in range(1, 13):
        row = _row(step, **{k: "EDGE" for k in ("reward", "grad_norm", "time/step", "num_tokens")})
        lines.append(json.dumps(row).replace('"EDGE"', edges[step % len(edges)]))
    run = _run(tmp_path / "run", rows=[])
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["doctor", str(run)]) in (0, 1)
    assert "12 steps logged" in capsys.readouterr().out
    assert main(["report", str(run)]) == 0
    assert (run / "plots" / "reward.png").stat().st_size > 0


def _evaluation(step: int, **values) -> dict:
    return {**EvalResult("step", step, 0.0, 4, {}, 0.5).to_dict(), **values}


@pytest.mark.parametrize("mean_reward", [None, "0.5", [0.5], True, int("9" * 30)])
def test_an_evaluation_row_whose_mean_reward_is_not_a_number_is_passed_over(
    tmp_path, capsys, monkeypatch, mean_reward
):
    good = [_evaluation(2, mean_reward=0.25), _evaluation(6, mean_reward=0.75)]
    raw = json.dumps(_evaluation(4, mean_reward=mean_reward))
    run = _run(tmp_path / "run", evaluations=good)
    with open(run / "eval.jsonl", "a") as f:
        f.write(raw + "\n")
    assert [r.step for r in read_results(run / "eval.jsonl")] == [2, 6]
    assert main(["doctor", str(run)]) in (0, 1)
    assert "2 held-out evaluations" in capsys.readouterr().out
    monkeypatch.setattr(report, "_draws_plots", lambda: False)  # the markdown reads the rows
    text = report.build_report(run, plots_apart=True).read_text()
    assert "## Held-out evaluation" in text and "0.750" in text


def test_evaluation_rows_of_other_wrong_types_are_passed_over(tmp_path):
    spoilt = [
        _evaluation(1, counts={"correct": [int("9" * 400), 4]}),  # refused by the parser
        _evaluation(2, rewards={"f": "high"}),
        _evaluation(3, samples=["not an object"]),
        _evaluation(4, label=7),
        _evaluation(5, n=None),
        {"label": "step", "step": 6, "temperature": 0.0, "n": 4, "mean_reward": 0.5},  # no counts
    ]
    run = _run(tmp_path / "run", evaluations=[*spoilt, _evaluation(7)])
    (run / "eval.jsonl").write_text(
        (run / "eval.jsonl").read_text().replace(str(int("9" * 400)), "9" * 400)
    )
    assert [r.step for r in read_results(run / "eval.jsonl")] == [7]


def test_a_line_longer_than_the_limit_is_refused_in_a_log_and_passed_over_in_eval(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(run_files, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(run_files, "CHUNK_BYTES", 300)  # the long line spans reads
    long_row = _row(3, note="x" * 2000)
    run = _run(tmp_path / "run", rows=[_row(1), _row(2), long_row, _row(4)])
    with pytest.raises(RunFileError, match=r"metrics.jsonl:3: a line longer than the 1,000 bytes"):
        read_metrics(run)
    evaluations = [_evaluation(1), _evaluation(2, samples=[{"prompt": "x" * 2000}]), _evaluation(3)]
    run = _run(tmp_path / "other", evaluations=evaluations)
    assert [r.step for r in read_results(run / "eval.jsonl")] == [1, 3]


def test_what_is_kept_of_a_row_is_its_numbers(tmp_path):
    row = _row(1, note="text", flags=[1, 2], nested={"a": 1}, done=True, missing=None)
    row.update({"health/no_learning_signal": 1.0, "time/update": 2.0, "time/generate": 0.5})
    (kept,) = read_metrics(_run(tmp_path / "run", rows=[row]))
    dropped = {"note", "flags", "nested", "done", "health/no_learning_signal", "time/update"}
    assert kept == {k: v for k, v in row.items() if k not in dropped}


# ------------------------------------------------------------------ size and time


def test_4000_reward_functions_in_a_row_are_read_in_linear_time(tmp_path, monkeypatch):
    """A row with K reward functions (five of the metrics grpo logs for each) costs O(K): the
    checks asked for each function's weight by searching the row's K names, O(K^2). Measured on
    the 2-core AMD EPYC this was written on, under a load of 10: one row of 4,000 means took 33 s
    before; these two rows take 0.4 s for each command. The bound is loose on purpose: it
    guards the complexity, not the speed."""
    per_function = {"mean": 0.5, "std": 0.1, "missing": 0.0, "failures": 0, "errors": 0}
    rows = []
    for step in (1, 2):
        row = _row(step)
        for k in range(4000):
            row.update({f"rewards/function_{k}/{m}": v for m, v in per_function.items()})
        rows.append(row)
    run = _run(tmp_path / "run", rows=rows)
    monkeypatch.setattr(report, "_draws_plots", lambda: False)  # 4,000 curves: not this test's
    started = time.perf_counter()
    diagnosis = diagnose_run(run)
    doctor_seconds, started = time.perf_counter() - started, time.perf_counter()
    report.build_report(run, plots_apart=True)
    report_seconds = time.perf_counter() - started
    assert doctor_seconds < 2.0 and report_seconds < 2.0, (doctor_seconds, report_seconds)
    assert diagnosis.logged == 2


MEMORY_PROBE = """
import resource, sys
from grpo.run.doctor import diagnose_run
from grpo.run.run_files import RunFileError
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
try:
    diagnose_run(sys.argv[1])
except RunFileError as e:
    print(e)
print(peak() - before)
"""


def test_three_million_empty_rows_are_read_in_bounded_memory(tmp_path):
    """9 MB of `{}` rows: streamed, none kept (none has a step); the peak memory of the process
    that reads them grows by a few MB (100 MB allowed; reading them whole took 1.1 GB)."""
    run = _run(tmp_path / "run", rows=[])
    (run / "metrics.jsonl").write_text("{}\n" * 3_000_000)
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(run)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    said, grown = result.stdout.splitlines()
    assert "none of its 3,000,000 rows has a step" in said
    assert int(grown) < 100 * 2**20
