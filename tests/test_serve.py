"""`grpo serve --engine hf` as its own process (started by the test on a free port of 127.0.0.1),
and training against it through `rollout.engine: server`:

- a run gives the metrics, samples, evaluations and final weights of the same config with the
  in-process `hf` engine (same seeds), bitwise on this CPU: the server builds the engine as the
  trainer does (its device layer and decoding too) and holds the trainer's weights bitwise, so
  both sample the same tokens from the same per-prompt seeds; after the run the server's
  checksum is the final weights';
- `grpo train` with no server there ends with one `grpo:` line naming the URL and `grpo serve`;
- the server killed mid-run: the run stops with one `grpo:` line (exit 6), and `--resume` against
  a new server continues it to the uninterrupted run's end, bitwise.

Under torchrun, 2 gloo ranks generating through one server are the 2-rank in-process run, bitwise:
tests/backends/test_distributed.py, inside its one torchrun launch.
"""

import copy
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from serve_settings import SERVE_KEY, SERVED_TINY

from grpo.cli import main
from grpo.config import loading
from grpo.rollout import weight_transfer
from grpo.rollout.server_http import HTTPClient
from grpo.training.trainer import Trainer

# a third of all first characters rewarded; with KILL_SERVER_AT=pid:step set, the server is
# killed while the rewards are computed at optimizer step `step` (the push after them fails)
REWARDS = """
import os
import signal


def third(completions, trainer_state=None, **kwargs):
    kill = os.environ.get("KILL_SERVER_AT")
    if kill and trainer_state is not None:
        pid, step = map(int, kill.split(":"))
        if trainer_state.global_step == step:
            os.kill(pid, signal.SIGKILL)
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]
"""
TIMING = ("time/", "tokens_per_second", "weight_sync/")
URL = re.compile(r"at (http://127\.0\.0\.1:\d+);")


def _write_config(tmp, name, overrides=()) -> str:
    rewards = tmp / "rewards.py"
    rewards.write_text(REWARDS)
    data = copy.deepcopy(SERVED_TINY)
    data.update(
        output_dir=str(tmp / name),
        rewards={**data["rewards"], "funcs": [f"{rewards}:third"]},
        algorithm={"beta": 0.04, "num_iterations": 2},
        training={
            "max_steps": 4,
            "per_device_train_batch_size": 16,
            "learning_rate": 0.003,
            "save_steps": 1,
        },
        eval={"every": 2, "after": True, "temperatures": [0.0, 1.0]},
        logging={"log_every": 100, "sample_every": 1},
    )
    cfg = loading.from_dict(data, list(overrides))
    path = tmp / f"{name}.yaml"
    loading.save(cfg, path)
    return str(path)


def _start_server(config: str) -> subprocess.Popen:
    """`grpo serve CONFIG --engine hf --port 0` in a new process (one thread, as the tests')."""
    env = {
        **os.environ,
        "GRPO_SERVE_API_KEY": SERVE_KEY,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "grpo", "serve", config, "--engine", "hf", "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _url(server: subprocess.Popen) -> str:
    """The URL the server printed once it listens."""
    line = server.stdout.readline()
    found = URL.search(line)
    assert found, (line, server.stderr.read() if server.poll() is not None else "")
    return found.group(1)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    server.stdout.close()
    server.stderr.close()


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in _rows(path)]


def _weights(run) -> dict:
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, run
    return {name: t for f in files for name, t in load_file(f).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The in-process run, and a run of the same config against a `grpo serve` process (started
    first: its imports overlap the in-process run). -> (tmp, run dirs, the server's URL)."""
    tmp = tmp_path_factory.mktemp("served")
    server = _start_server(_write_config(tmp, "served_config"))
    try:
        Trainer.from_config(loading.load(_write_config(tmp, "in_process"))).train()
        url = _url(server)
        os.environ["GRPO_SERVE_API_KEY"] = SERVE_KEY
        try:
            served = _write_config(
                tmp, "served", ["rollout.engine=server", f"rollout.server.url={url}"]
            )
            assert main(["train", served]) == 0
            checksum = HTTPClient(url, SERVE_KEY).call(
                "GET", "/weights_checksum", timeout=30, key="test"
            )
        finally:
            del os.environ["GRPO_SERVE_API_KEY"]
        yield tmp, checksum, server, url
    finally:
        _stop(server)


def test_a_served_run_is_the_in_process_run(runs):
    tmp, checksum, _, _ = runs
    one, two = tmp / "in_process", tmp / "served"
    assert _untimed(two / "metrics.jsonl") == _untimed(one / "metrics.jsonl")
    for log in ("samples.jsonl", "eval.jsonl"):
        assert _rows(two / log) == _rows(one / log), log
    expected, got = _weights(one), _weights(two)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    history = _rows(two / "metrics.jsonl")
    assert any(h["reward_std"] > 0 for h in history) and history[-1]["grad_norm"] > 0
    # one push a step, every tensor of the model's (the tied output layer's included)
    size = sum(t.numel() * t.element_size() for t in expected.values())
    assert all(h["weight_sync/bytes"] == size and h["time/weight_sync"] > 0 for h in history)
    # the server holds the final weights (a push after the 4 steps and the start's: version 5)
    assert checksum["weights_version"] == 5
    assert checksum["digest"] == weight_transfer.checksum(expected.items())["digest"]


def test_no_server_there_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    config = _write_config(
        tmp_path,
        "run",
        [
            "rollout.engine=server",
            "rollout.server.url=http://127.0.0.1:9",
            "rollout.server.timeout=0.3",
        ],
    )
    assert main(["train", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("grpo:")
    assert "http://127.0.0.1:9" in err and "grpo serve" in err


def test_a_killed_server_stops_the_run_and_resume_continues_it(
    runs, serve_in_thread, tmp_path, capsys, monkeypatch
):
    """The module's server process is killed during the second step (its push fails); the run
    resumes against another server on the same port (in a thread of this process: a second
    process would spend seconds importing) and ends where the in-process run did."""
    tmp, _, server, url = runs
    run = _write_config(
        tmp_path,
        "killed",
        ["rollout.engine=server", f"rollout.server.url={url}", "rollout.server.timeout=1"],
    )
    monkeypatch.setenv("KILL_SERVER_AT", f"{server.pid}:2")  # global_step: optimizer steps
    capsys.readouterr()
    assert main(["train", run]) == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo: training stopped: the generation server")
    assert url in err[0] and "grpo serve" in err[0] and "--resume" in err[0]
    assert server.wait(timeout=30) == -signal.SIGKILL
    assert [p.name for p in (tmp_path / "killed").glob("checkpoint-*")] == ["checkpoint-1"]
    monkeypatch.delenv("KILL_SERVER_AT")
    serve_in_thread(port=int(url.rsplit(":", 1)[1]))  # back on its port
    assert main(["train", run, "--resume"]) == 0
    expected = tmp / "in_process"
    assert _untimed(tmp_path / "killed" / "metrics.jsonl") == _untimed(expected / "metrics.jsonl")
    for log in ("samples.jsonl", "eval.jsonl"):
        assert _rows(tmp_path / "killed" / log) == _rows(expected / log), log
    got, want = _weights(tmp_path / "killed"), _weights(expected)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_trls_server_mode_trains_through_grpo_serve(serve_in_thread, tmp_path):
    """TRL's script with use_vllm=True, vllm_mode="server" and vllm_server_base_url: the facade's
    server engine generates through the server and pushes each step's weights to it."""
    from grpo import GRPOConfig, GRPOTrainer
    from grpo.models.tiny import char_tokenizer, tiny_model
    from grpo.rollout.server import weights_checksum

    served = serve_in_thread()
    tokenizer = char_tokenizer()

    def first_digit(completions, **kwargs):
        return [float(c[:1].isdigit()) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=served.url,
        vllm_group_port=0,  # TRL's 51216 may be taken by a test beside this one
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=3,
        max_steps=2,
        bf16=False,
        report_to="none",
        grpo_overrides=["rewards.isolation=thread"],
    )
    trainer = GRPOTrainer(
        model=tiny_model(tokenizer, hidden_size=32, num_layers=1, seed=2),
        processing_class=tokenizer,
        args=args,
        train_dataset=[{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 5)],
        reward_funcs=first_digit,
    )
    assert trainer.config.rollout.engine == "server"
    assert trainer.train().global_step == 2
    assert served.app.version == 3  # the start's push and one after each step
    digest = weight_transfer.checksum(served.app.tensors.items())["digest"]
    assert digest == weights_checksum(trainer.model)["digest"]
