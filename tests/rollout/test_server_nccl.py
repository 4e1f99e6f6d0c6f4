"""grpo.rollout.server_nccl: a push over vLLM's NCCL engine, whose trainer side is vLLM's own. No
GPU runs here: what is tested is that a run that cannot use it is refused at start with the fix."""

import pytest

from grpo.config.errors import ConfigError
from grpo.rollout.server_nccl import check_available


def test_an_nccl_server_needs_the_policy_on_a_gpu(tokenizer):
    from grpo.models.tiny import tiny_model

    with pytest.raises(ConfigError, match="needs the policy on a CUDA device") as refused:
        check_available(tiny_model(tokenizer, hidden_size=32, num_layers=1))
    message = str(refused.value)
    assert "\n" not in message and '--weight-transfer-config \'{"backend": "gloo"}\'' in message
