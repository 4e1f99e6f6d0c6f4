"""`grpo serve --engine vllm`'s pieces that need no vLLM: the arguments vLLM's server is started
with (grpo.serve.vllm) and the shared secret on every route but /health and /version
(grpo.serve.vllm_secret). The server itself runs in `make test-vllm` (tests/serve/test_vllm_server.py)."""

import asyncio
import json

import pytest

from grpo.config.errors import ConfigError
from grpo.serve import vllm_secret
from grpo.serve.vllm import servable, vllm_arguments


def _value(args, flag):
    return args[len(args) - 1 - args[::-1].index(flag) + 1]  # the last one: argparse's


def test_the_arguments_turn_weight_transfer_on_and_leave_vllms_own_last(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=8192).save_pretrained(tmp_path)
    options = {"tensor_parallel_size": 2, "max_model_len": None, "dtype": "bfloat16"}
    cpu = vllm_arguments(str(tmp_path), "0.0.0.0", 8001, "cpu", options, ["--dtype", "float32"])
    assert cpu[0] == str(tmp_path) and _value(cpu, "--port") == "8001"
    assert json.loads(_value(cpu, "--weight-transfer-config")) == {"backend": "gloo"}
    assert _value(cpu, "--middleware") == "grpo.serve.vllm_secret.SharedSecret"
    assert _value(cpu, "--logprobs-mode") == "processed_logprobs"
    assert "--enable-scale-out" in cpu and _value(cpu, "--tensor-parallel-size") == "2"
    # on CPUs prompts are prefilled whole: a step takes the model's whole context
    assert (
        "--no-enable-chunked-prefill" in cpu and _value(cpu, "--max-num-batched-tokens") == "8192"
    )
    assert _value(cpu, "--dtype") == "float32"  # what follows -- comes last, and wins
    gpu = vllm_arguments(str(tmp_path), "127.0.0.1", 8000, "cuda", {}, [])
    assert json.loads(_value(gpu, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "--no-enable-chunked-prefill" not in gpu and "--tensor-parallel-size" not in gpu


def test_what_vllm_cannot_load_is_one_line(tmp_path):
    for name, why in [
        ("tiny", "grpo's own random model"),
        ("model.gguf", "GGUF"),
        (str(tmp_path), "not a model directory"),
    ]:
        with pytest.raises(ConfigError, match=why) as refused:
            servable(name)
        assert "\n" not in str(refused.value)
    (tmp_path / "config.json").write_text("{}")
    assert servable(str(tmp_path)) == str(tmp_path)
    assert servable("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id, vLLM's to fetch


def _request(app, path, authorization=None):
    """(status, body) of one HTTP request through `app`."""
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def _reached(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached"})


def test_every_route_but_health_and_version_takes_the_secret(monkeypatch):
    monkeypatch.setenv("GRPO_SERVE_API_KEY", "s3cret")
    app = vllm_secret.SharedSecret(_reached)
    for path in ("/update_weights", "/init_weight_transfer_engine", "/collective_rpc", "/pause"):
        for given in (None, "Bearer wrong", "Basic s3cret", "Bearer s3cret2", "Bearer"):
            status, body = _request(app, path, given)
            assert status == 401 and b"shared secret" in body, (path, given)
        assert _request(app, path, "Bearer s3cret") == (200, b"reached")
    assert _request(app, "/health") == (200, b"reached")
    assert _request(app, "/version/") == (200, b"reached")
    monkeypatch.delenv("GRPO_SERVE_API_KEY")
    with pytest.raises(RuntimeError, match="GRPO_SERVE_API_KEY is not set"):
        vllm_secret.SharedSecret(_reached)
