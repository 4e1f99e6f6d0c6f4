"""The tiny random Llama the vLLM tests serve and train (tests/rollout/test_vllm.py,
tests/serve/test_vllm_server.py): grpo.models.tiny's, with vLLM's smallest CPU attention head
size (32; tiny_model's heads are 16 by default). A module of its own, not conftest.py, so both
test modules import it by a name no other conftest.py shadows."""

from __future__ import annotations

from grpo.models.tiny import tiny_model


def llama(tokenizer, seed=0, hidden=64):
    """A tiny random Llama (2 layers of `hidden`, heads of 32), deterministic in `seed`, in eval mode."""
    return tiny_model(tokenizer, hidden_size=hidden, seed=seed, head_size=32).eval()
