"""The tiny random Llama the vLLM tests serve and train (tests/rollout/test_vllm.py,
tests/serve/test_vllm_server.py): grpo.models.tiny's layout, but with vLLM's smallest CPU
attention head size (32; tiny_model's heads are 16). A module of its own, not conftest.py, so
both test modules import it by a name no other conftest.py shadows."""

from __future__ import annotations

import torch


def llama(tokenizer, seed=0, hidden=64):
    """A tiny random Llama (2 layers of `hidden`, heads of 32), deterministic in `seed`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()
