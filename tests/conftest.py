import pytest
import torch
import torch

from grpo.tiny import char_tokenizer, tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    return tiny_model(tokenizer, hidden_size=32, num_layers=2, seed=3)


@pytest.fixture
def gemma3_tiny(tokenizer):
    """Builds a tiny random Gemma 3 (a sliding-window layer of 4 tokens, then a full one),
    the same weights for the same head counts."""

    def build(num_attention_heads: int = 2, num_key_value_heads: int = 1):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=16,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            pad_token_id=tokenizer.pad_token_id, max_position_embeddings=256,
        )
        torch.manual_seed(0)
        return Gemma3ForCausalLM(config)

    return build


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models: thread hand-offs cost more than the arithmetic, and the 2 cores are shared.
    torch.set_num_threads(1)
