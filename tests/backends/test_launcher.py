"""`accelerate launch`: its config's distributed type read from the environment it sets (DDP:
grpo's data parallelism; FSDP: training.sharding=fsdp; DeepSpeed and fp16 refused by name),
and, in make test-slow, real launches of 2 CPU processes that train as torchrun's do."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.backends import create_backend
from grpo.backends.launcher import launcher_settings
from grpo.config import loading
from grpo.config.errors import ConfigError

TINY = {
    "model": {"name": "tiny", "tiny_hidden_size": 32, "tiny_num_layers": 1},
    "data": {
        "chat_template": "never",
        "arithmetic": {
            "operands": [[1, 9], [1, 9]],
            "operators": ["+"],
            "num_train": 60,
            "num_eval": 4,
        },
    },
    "rollout": {"num_generations": 4, "max_completion_length": 3},
    "rewards": {"isolation": "thread"},
    "training": {"max_steps": 2, "per_device_train_batch_size": 8, "save_steps": 0},
    "eval": {"before": False, "after": False},
}


def test_outside_accelerate_and_with_ddp_nothing_is_set():
    assert launcher_settings({}) == {}
    # what `accelerate launch --multi_gpu` sets beside torchrun's variables
    ddp = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}
    assert launcher_settings(ddp) == {}
    assert launcher_settings({"ACCELERATE_MIXED_PRECISION": "bf16"}) == {}


def test_an_fsdp_config_is_grpos_sharding():
    assert launcher_settings({"ACCELERATE_USE_FSDP": "true"}) == {"training.sharding": "fsdp"}
    assert launcher_settings({"ACCELERATE_USE_FSDP": "false"}) == {}


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed config .* distributed_type: FSDP"),
        ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "mixed_precision: fp16.* bf16 or no"),
    ],
)
def test_what_grpo_would_run_otherwise_is_refused_by_name(environ, named):
    with pytest.raises(ConfigError, match=named):
        launcher_settings(environ)


def test_the_backend_takes_the_launchers_sharding_into_the_config(monkeypatch, tmp_path):
    cfg = loading.from_dict({**TINY, "output_dir": str(tmp_path / "run")})
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    # one process cannot shard: the refusal names both launchers
    with pytest.raises(ConfigError, match="accelerate launch"):
        create_backend(cfg)
    assert cfg.training.sharding == "fsdp"  # what the run directory's config would record
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="DeepSpeed"):
        create_backend(cfg)


def _launch(launcher: list[str], run: Path) -> list[dict]:
    path = run.with_suffix(".yaml")
    loading.save(loading.from_dict({**TINY, "output_dir": str(run)}), path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ACCELERATE_")}
    command = [*launcher, "-m", "grpo", "train", str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens_per"))} for r in rows]


ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2"]
ACCELERATE += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
def test_accelerate_launch_trains_as_torchrun_does(tmp_path):
    """DDP (--multi_gpu, on CPUs: 2 gloo ranks) and FSDP configs: the metrics of the torchrun
    launch with the same settings, exactly (the same code on the same CPU)."""
    pytest.importorskip("accelerate")
    ddp = _launch([*ACCELERATE, "--multi_gpu"], tmp_path / "ddp")
    assert _untimed(ddp) == _untimed(_launch(TORCHRUN, tmp_path / "torchrun"))
    fsdp = _launch([*ACCELERATE, "--use_fsdp"], tmp_path / "fsdp")
    assert "sharding: fsdp" in (tmp_path / "fsdp" / "config.yaml").read_text()
    assert len(fsdp) == 2
