"""The `server` engine against `grpo serve --engine hf` in a thread of the test process (the
subprocess that `grpo serve` is, and the run against it compared with the in-process engine, are
tests/test_serve.py's): after a push the server's weights are the trainer's bitwise (a LoRA
policy's merged); each fault ends as promised: a server unreachable at start (one line naming the
URL and `grpo serve`, before the model loads), another model (refused at start), a restart
mid-run (the step's weights pushed again and the run the uninterrupted one), a stall past a
timeout (one line naming its key), a server that does not come back (one line, then --resume)."""

import copy
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file
from serve_settings import SERVED_TINY

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.rollout.server import weights_checksum
from grpo.rollout.server_http import ServerError
from grpo.run import checkpoint
from grpo.training.trainer import Trainer

REWARDS = '''
def third(completions, **kwargs):
    """1 for a third of all first characters: groups with spread, weights that move."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(bool(t) and ord(t[0]) % 3 == 0) for t in texts]
'''
TIMING = ("time/", "tokens_per_second", "weight_sync/")


def _config(tmp_path, name, overrides=(), server=None):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = copy.deepcopy(SERVED_TINY)
    data["rewards"]["funcs"] = [f"{rewards}:third"]
    data["training"] = {
        "max_steps": 4,
        "per_device_train_batch_size": 8,
        "learning_rate": 0.003,
        "save_steps": 1,
    }
    data["logging"] = {"log_every": 100, "sample_every": 0}
    data["output_dir"] = str(tmp_path / name)
    engine = ["rollout.engine=server", f"rollout.server.url={server.url}"] if server else []
    return loading.from_dict(data, [*engine, *overrides])


def _final_weights(run) -> dict:
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, run
    return {name: t for f in files for name, t in load_file(f).items()}


def _untimed(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def _checksum(serving) -> dict:
    with serving.app.lock:
        from grpo.rollout import weight_transfer

        return {
            "version": serving.app.version,
            **weight_transfer.checksum(serving.app.tensors.items()),
        }


class AtStep:
    """A callback that calls `action()` at the end of step `step`."""

    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


def test_a_push_makes_the_servers_weights_the_policys_bitwise(serve_in_thread, tmp_path):
    served = serve_in_thread()
    for lora in ([], ["model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj]"]):
        cfg = _config(tmp_path, f"run{len(lora)}", [*lora, "training.max_steps=2"], served)
        trainer = Trainer.from_config(cfg)
        trainer.train()
        mine = weights_checksum(trainer.model)  # a LoRA policy merged, as it was pushed
        theirs = _checksum(served)
        assert theirs["version"] == trainer.engine.version == 3  # the start's push and 2 steps'
        assert theirs["digest"] == mine["digest"] and theirs["tensors"] == mine["tensors"]
    # the LoRA run's push is its merged weights: a base layer's weight differs from them
    base = trainer.model.model.layers[0].self_attn.q_proj.base_layer.weight
    pushed = served.app.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(base, pushed)


def test_a_server_that_is_not_there_is_named_before_the_model_loads(
    tmp_path, monkeypatch, serve_in_thread
):
    import grpo.training.build as build

    served = serve_in_thread()
    port = served.port
    served.shutdown()  # nothing listens there now
    loaded = []
    monkeypatch.setattr(build, "load_model_and_tokenizer", lambda *a: loaded.append(a))
    cfg = _config(tmp_path, "run", ["rollout.server.timeout=0.5"], served)
    with pytest.raises(ConfigError) as refused:
        Trainer.from_config(cfg)
    message = str(refused.value)
    assert f"http://127.0.0.1:{port}" in message and "grpo serve" in message
    assert "\n" not in message and not loaded
    monkeypatch.delenv("GRPO_SERVE_API_KEY")
    with pytest.raises(ConfigError, match="GRPO_SERVE_API_KEY"):
        Trainer.from_config(cfg)
    assert not loaded


def test_another_model_or_secret_is_refused_at_start(serve_in_thread, tmp_path, monkeypatch):
    other = copy.deepcopy(SERVED_TINY)
    other["model"]["tiny_hidden_size"] = 48
    served = serve_in_thread(other)
    with pytest.raises(ConfigError, match="serves another model than the policy: its model.*"):
        Trainer.from_config(_config(tmp_path, "run", (), served))
    same = serve_in_thread()
    monkeypatch.setenv("GRPO_SERVE_API_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match="refused the shared secret in GRPO_SERVE_API_KEY"):
        Trainer.from_config(_config(tmp_path, "run2", (), same))


def test_a_restarted_server_gets_the_steps_weights_and_the_run_goes_on(serve_in_thread, tmp_path):
    Trainer.from_config(_config(tmp_path, "in_process")).train()
    served = serve_in_thread()
    port, restarted = served.port, []

    def restart():  # the server goes away, and another comes up on its port a moment later
        served.shutdown()
        timer = threading.Timer(0.5, lambda: restarted.append(serve_in_thread(port=port)))
        timer.start()

    cfg = _config(tmp_path, "served", ["rollout.server.timeout=60"], served)
    trainer = Trainer.from_config(cfg, callbacks=[AtStep(2, restart)])
    trainer.train()
    assert restarted, "the server was not restarted"
    assert _untimed(tmp_path / "served") == _untimed(tmp_path / "in_process")
    expected, got = _final_weights(tmp_path / "in_process"), _final_weights(tmp_path / "served")
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    # the new server holds the final weights under the run's version (pushed again, then 2 more)
    assert _checksum(restarted[0])["version"] == trainer.engine.version == 5
    assert _checksum(restarted[0])["digest"] == weights_checksum(trainer.model)["digest"]


def test_a_stalled_server_ends_the_run_naming_the_timeout(serve_in_thread, tmp_path):
    served = serve_in_thread()
    stalls = [
        ("rollout.server.request_timeout", "generation", AtStep(1, served.app.lock.acquire)),
        ("rollout.server.weight_sync_timeout", "push", None),
    ]
    for key, where, callback in stalls:
        overrides = [f"{key}=1"]
        funcs = None
        if where == "push":  # stalled while the step's rewards are computed: its push waits

            def third(completions, **kwargs):
                served.app.lock.acquire(blocking=False)
                return [float(ord(c[0]) % 3 == 0) if c else 0.0 for c in completions]

            funcs = {"third": third}
            overrides.append("rewards.funcs=[]")
        cfg = _config(tmp_path, where, overrides, served)
        trainer = Trainer.from_config(
            cfg, callbacks=[callback] if callback else [], reward_funcs=funcs
        )
        with pytest.raises(ServerError) as stopped:
            trainer.train()
        message = str(stopped.value)
        assert message.startswith(key) and "\n" not in message and "--resume" in message, message
        served.app.lock.release()  # the stall over: the server answers again


def test_a_server_that_does_not_come_back_stops_the_run_and_resume_continues_it(
    serve_in_thread, tmp_path, capsys
):
    Trainer.from_config(_config(tmp_path, "in_process")).train()
    served = serve_in_thread()
    cfg = _config(tmp_path, "served", ["rollout.server.timeout=0.5"], served)
    trainer = Trainer.from_config(cfg, callbacks=[AtStep(2, served.shutdown)])
    with pytest.raises(ServerError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert served.url in message and "grpo serve" in message and "--resume" in message
    assert "\n" not in message
    latest = checkpoint.latest_checkpoint(tmp_path / "served")
    assert latest.name == "checkpoint-2"
    back = serve_in_thread(port=served.port)
    resumed = Trainer.from_config(_config(tmp_path, "served", [], back), resume=latest)
    resumed.train()
    assert _untimed(tmp_path / "served") == _untimed(tmp_path / "in_process")
    expected, got = _final_weights(tmp_path / "in_process"), _final_weights(tmp_path / "served")
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert os.environ["GRPO_SERVE_API_KEY"]  # the fixture's, for the trainer


def test_the_engine_refuses_what_it_cannot_push():
    with pytest.raises(ConfigError, match="rollout.engine: server pushes .*training.sharding=fsdp"):
        loading.from_dict(
            copy.deepcopy(SERVED_TINY), ["rollout.engine=server", "training.sharding=fsdp"]
        )
