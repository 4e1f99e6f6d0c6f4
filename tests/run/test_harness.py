"""The harness of tests/run/conftest.py: its `grpo` children are forks of a forkserver, a fresh
interpreter, never of the test process (which may have initialised CUDA, after which a fork of
it could not use CUDA again), and they get what the test process gives them: the arguments,
the environment, GRPO_KILL_AT, the working directory, torch's thread count and the `quick`
fixture's patches."""

import json
import multiprocessing.forkserver
import os
from pathlib import Path

import pytest
import torch
import yaml
from harness_child import FACTS  # tests/run is on sys.path: pytest puts it there for conftest.py

pytestmark = pytest.mark.usefixtures("quick")


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")


def test_a_child_is_a_fork_of_the_forkserver_with_the_test_processs_settings(
    tmp_path, monkeypatch, run_grpo, start_grpo
):
    facts = tmp_path / "facts.json"
    monkeypatch.setenv(FACTS, str(facts))  # set after the server started: it reaches the child
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRPO_KILL_AT", "save:7")  # the test process's own is not passed on

    assert run_grpo(["init"]) == 0  # writes grpo.yaml in its working directory
    assert yaml.safe_load((tmp_path / "grpo.yaml").read_text())["training"]
    child = json.loads(facts.read_text())
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert child["ppid"] == server != os.getpid() and child["pid"] != os.getpid()
    assert "from multiprocessing.forkserver import main" in _cmdline(server)  # a new program
    assert child["imported_by"] == server  # torch, transformers, grpo: imported once, there
    assert child["cwd"] == str(tmp_path) and child["quick"] is True
    assert child["threads"] == torch.get_num_threads() and child["kill_at"] is None

    process = start_grpo(["init", "again.yaml"], kill_at="step:1")
    process.join(60)
    assert process.exitcode == 0 and (tmp_path / "again.yaml").is_file()
    assert json.loads(facts.read_text())["kill_at"] == "step:1"

    err = tmp_path / "err.txt"
    process = start_grpo(["train", "missing.yaml"], err_path=err)
    process.join(60)
    assert process.exitcode == 2 and "missing.yaml" in err.read_text()
