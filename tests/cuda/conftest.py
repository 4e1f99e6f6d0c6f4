"""Tiny models of the architectures the CUDA layer's fixed-shape loop covers (Llama, Qwen2 with
tied embeddings and query/key/value biases, Gemma 3 with a sliding window longer than the
rollouts), optionally with a LoRA adapter whose B is not zero, and the engine's rollout of them."""

import pytest
import torch

from grpo.config.model_data import LoraConfig
from grpo.models import lora
from grpo.models.tiny import tiny_model
from grpo.rollout import generate


def build(arch: str, tokenizer, window: int = 256):
    """A tiny random `arch` model in eval mode, 4 query heads over 2 key/value heads."""
    if arch == "llama":
        return tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=3).eval()
    import transformers

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, sliding_window=window, layer_types=["sliding_attention", "full_attention"]
        )
        return transformers.Gemma3ForCausalLM(cfg).eval()
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**common, tie_word_embeddings=True)
    ).eval()
    with torch.no_grad():  # its query/key/value biases start at zero: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def adapted(model, seed: int = 3):
    """`model` with a LoRA adapter on every linear layer, B drawn so that the adapter counts."""
    model = lora.apply_lora(model, LoraConfig(r=4, alpha=8.0), seed=seed)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for key, p in lora.adapter_parameters(model).items():
            if "lora_B" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.fixture
def tiny(tokenizer):
    """tiny(arch, lora=False, window=256): a model of the loop's tests."""

    def make(arch: str, with_lora: bool = False, window: int = 256):
        model = build(arch, tokenizer, window)
        return adapted(model) if with_lora else model

    return make


@pytest.fixture
def prompts(tokenizer):
    """Three prompts of different lengths (so the rows are left-padded)."""
    return [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2="]]


@pytest.fixture
def engine_rollout(tokenizer):
    """engine_rollout(model, prompts, G, params, **kw): the hf engine's own loop (prefix sharing,
    compaction), the reference every loop here is compared with."""

    def run(model, prompts, G, params, **kw):
        return generate(
            model,
            prompts,
            G,
            params,
            eos_token_ids=kw.pop("eos_token_ids", [tokenizer.eos_token_id]),
            pad_token_id=tokenizer.pad_token_id,
            **kw,
        )

    return run
