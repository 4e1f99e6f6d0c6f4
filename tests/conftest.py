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


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Tiny models: thread hand-offs cost more than the arithmetic, and the 2 cores are shared.
    torch.set_num_threads(1)
