"""PPO's critic: a value head on a copy of the policy's trunk, with its own optimizer.

GRPO needs no critic: a group's mean reward is its baseline. PPO (the `gae`
advantage estimator) learns one: V(q, o_<t), the expected reward from each
completion position, and builds per-token advantages from it with GAE. That
costs a second trunk as large as the policy's, its gradients and its AdamW
moments, trained alongside the policy; which is the memory the seeds say GRPO
saves (benchmarks/grpo_vs_ppo.py measures it).

The critic reads the same positions as the policy's logprobs (the hidden state
that predicts completion token t gives V_t, through grpo.models.logprobs'
completion_hidden_states, prompt shared per group), in the same autocast. The
update's math is grpo.algorithm.values: GAE, the clipped value loss.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from grpo.models.logprobs import _decoder, completion_hidden_states


class ValueModel(torch.nn.Module):
    """trunk (a copy of the policy's decoder body) -> a linear head -> one value per position."""

    base_model_prefix = (
        "body"  # what grpo.models.logprobs' completion_hidden_states looks the trunk up by
    )

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.body = copy.deepcopy(_decoder(policy))
        self.config = self.body.config
        for p in self.body.parameters():
            p.requires_grad_(True)
        embedding = self.body.get_input_embeddings()
        if isinstance(embedding, torch.nn.Embedding):
            # the policy's tied embedding may send sparse gradients (backends/single.py); the
            # critic's own copy is untied, and AdamW needs a dense gradient
            embedding.sparse = False
        hidden = self.config.hidden_size
        weight = next(self.body.parameters())
        # zero: every value starts at 0, so the first advantages are the plain returns
        self.head = torch.nn.Linear(hidden, 1, device=weight.device, dtype=weight.dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """The trunk's (a copy of the policy's, training.gradient_checkpointing included): read by
        completion_hidden_states, which takes the plain path for checkpointed layers."""
        body = self.body
        return bool(
            getattr(
                body,
                "is_activation_checkpointing",
                getattr(body, "is_gradient_checkpointing", False),
            )
        )

    def values(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """V [N, T] (float32) at the positions that predict each completion token, 0 at padding."""
        hidden = completion_hidden_states(
            self, prompt_ids, prompt_mask, completion_ids, completion_mask
        )
        values = self.head(hidden).squeeze(-1).float()
        return values * completion_mask


class Critic:
    """The value model and its optimizer (AdamW, `algorithm.critic_learning_rate`, the policy's
    betas, epsilon and weight decay), saved with the run's state and restored through set-up."""

    def __init__(
        self,
        policy: torch.nn.Module,
        learning_rate: float,
        training_cfg,
        state: dict[str, Any] | None = None,
    ):
        self.model = ValueModel(policy)
        t = training_cfg
        device_type = next(self.model.parameters()).device.type
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
            weight_decay=t.weight_decay,
            fused=device_type in ("cpu", "cuda"),
        )
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
