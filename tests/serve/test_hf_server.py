"""`grpo serve --engine hf`'s endpoints: only /health and /version are open; the weight-update
endpoints refuse a request without the shared secret and change nothing; a generation request
for weights other than those held, or out of bounds, is refused before any work; the server
describes its model for the trainer's check."""

import http.client
import json
from urllib.parse import urlsplit

import pytest
from serve_settings import SERVE_KEY

from grpo.rollout import wire
from grpo.rollout.types import SamplingParams


def _call(url, method, path, body=None, key=SERVE_KEY, headers=None):
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = None if body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        sent["Authorization"] = f"Bearer {key}"
    connection.request(method, path, body=data, headers=sent)
    response = connection.getresponse()
    answer = json.loads(response.read() or b"null")
    connection.close()
    return response.status, answer


def _generate(url, version, key=SERVE_KEY, **changes):
    body = {
        "prompt": [[5, 6, 7]],
        "n": 2,
        "max_tokens": 3,
        "temperature": 1.0,
        "logprobs": 0,
        "seeds": [11],
        "weights_version": version,
        **changes,
    }
    return _call(url, "POST", "/v1/completions", body, key=key)


@pytest.fixture
def server(serve_in_thread):
    return serve_in_thread()


def test_only_health_and_version_are_open(server):
    assert _call(server.url, "GET", "/health", key=None) == (200, {})
    assert _call(server.url, "GET", "/version", key=None)[0] == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/server_info"),
        ("GET", "/weights_checksum"),
        ("POST", "/v1/completions"),
    ]:
        for key in (None, "wrong", SERVE_KEY + "x", ""):
            status, answer = _call(server.url, method, path, {}, key=key)
            assert status == 401 and "shared secret" in answer["error"]["message"], (path, key)
    status, answer = _call(server.url, "GET", "/nowhere")
    assert status == 404


def test_the_description_is_the_models(server):
    status, info = _call(server.url, "GET", "/server_info")
    assert status == 200
    grpo = info["grpo"]
    assert grpo["weights_version"] == 0 and grpo["engine"] == "hf"
    model = grpo["model"]
    assert model["model_type"] == "llama" and model["vocab_size"] > 0
    names = {t[0] for t in model["tensors"]}
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    status, models = _call(server.url, "GET", "/v1/models")
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] > 0


def test_a_push_without_the_secret_is_refused_and_changes_nothing(server):
    _, before = _call(server.url, "GET", "/weights_checksum")
    _, info = _call(server.url, "GET", "/server_info")
    tensors = info["grpo"]["model"]["tensors"]
    update = {
        "update_info": {
            "names": [t[0] for t in tensors],
            "dtype_names": [t[1] for t in tensors],
            "shapes": [t[2] for t in tensors],
            "packed": True,
            "packed_buffer_size_bytes": 1 << 20,
            "weights_version": 7,
        }
    }
    init = {
        "init_info": {
            "master_address": "127.0.0.1",
            "master_port": 9,
            "rank_offset": 1,
            "world_size": 2,
        }
    }
    for key in (None, "wrong"):
        for path, body in [
            ("/init_weight_transfer_engine", init),
            ("/start_weight_update", {}),
            ("/update_weights", update),
            ("/finish_weight_update", {"weights_version": 7}),
        ]:
            status, answer = _call(server.url, "POST", path, body, key=key)
            assert status == 401, (path, key, answer)
    # with the secret but no group joined: refused too, and still nothing changed
    assert _call(server.url, "POST", "/update_weights", update)[0] == 409
    assert _call(server.url, "POST", "/finish_weight_update", {"weights_version": 7})[0] == 409
    _, after = _call(server.url, "GET", "/weights_checksum")
    assert after == before and after["weights_version"] == 0
    status, answer = _generate(server.url, 0)
    assert status == 200 and answer["weights_version"] == 0


def test_generation_is_refused_for_other_weights_and_out_of_bounds(server):
    status, answer = _generate(server.url, 0)
    assert status == 200 and len(answer["choices"]) == 2
    got = wire.parse_completion_answer(
        answer,
        1,
        2,
        vocab=10_000,
        params=SamplingParams(max_new_tokens=3, temperature=1.0),
        version=0,
    )
    assert all(len(ids) <= 3 for ids in got.token_ids)
    # the same seed, the same completions
    assert _generate(server.url, 0)[1]["choices"] == answer["choices"]
    status, answer = _generate(server.url, 3)
    assert status == 409 and answer["weights_version"] == 0
    status, answer = _generate(server.url, 0, prompt=[[10_000_000]])
    assert status == 400 and "token id" in answer["error"]["message"]
    status, answer = _generate(server.url, 0, model="another")
    assert status == 404
    # a body over the bound is refused from its declared length, unread
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Authorization", f"Bearer {SERVE_KEY}")
    connection.putheader("Content-Length", str(wire.MAX_REQUEST_BYTES + 1))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    connection.close()


def test_a_taken_port_or_no_secret_is_one_line(server, capsys, monkeypatch):
    from grpo.cli import main

    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    assert main(["serve", "tiny", "--port", str(server.port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{server.port}" in err
    monkeypatch.delenv("GRPO_SERVE_API_KEY")
    assert main(["serve", "tiny", "--port", "0"]) == 2
    assert "needs a shared secret" in capsys.readouterr().err
    monkeypatch.setenv("GRPO_SERVE_API_KEY", SERVE_KEY)
    assert main(["serve", "tiny", "--engine", "vllm"]) == 2  # vllm is not installed here
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("grpo: config error: grpo serve --engine vllm:")
    assert "vLLM is not importable here" in err and "--engine hf" in err
    # vLLM's server's options are refused for grpo's own
    assert main(["serve", "tiny", "--tensor-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tensor-parallel-size are vLLM's server's" in err
    assert main(["serve", "tiny", "--", "--enforce-eager"]) == 2
    assert "options after -- are vLLM's server's" in capsys.readouterr().err
