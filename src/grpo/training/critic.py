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

    values   V [N, T] of a batch before the update, no gradient (`CriticPhase.values`)
    critic   num_iterations passes of its own optimizer toward GAE's returns (`CriticPhase.update`)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo import algorithm
from grpo.models.logprobs import _decoder, completion_hidden_states
from grpo.training.batching import GenerationBatch
from grpo.training.forward import Forward, trim_left

log = logging.getLogger(__name__)


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


@dataclass
class CriticPhase:
    """The values and critic phases of a step: the critic's values of a batch before the update,
    and its own passes toward GAE's returns after it. It holds what they read: the critic, the
    batch's split and the backend (`forward`: the policy's, for the same minibatches), gae's
    gamma and lambda, the value clip, the passes (algorithm.num_iterations) and the gradient clip."""

    critic: Critic
    forward: Forward
    gamma: float
    lam: float
    value_clip: float | None
    num_iterations: int
    max_grad_norm: float

    def rows_values(self, model, batch: GenerationBatch, rows: torch.Tensor, grad: bool):
        """V [len(rows), width] of the completions `rows` under the critic, width = their longest."""
        ro = batch.rollout
        prompt_ids, prompt_mask = trim_left(ro.prompt_ids[rows], ro.prompt_mask[rows])
        width = max(1, int(ro.completion_mask[rows].sum(-1).max()))
        context = contextlib.nullcontext() if grad else torch.no_grad()
        with context, self.forward.backend.autocast():
            return model.values(
                prompt_ids,
                prompt_mask,
                ro.completion_ids[rows, :width],
                ro.completion_mask[rows, :width],
            )

    def values(self, batch: GenerationBatch) -> torch.Tensor:
        """V [N, T] of every completion position before the update (GAE's values, the value
        clip's centre)."""
        model = self.critic.model
        out = torch.zeros(
            len(batch), batch.rollout.completion_ids.shape[1], device=self.forward.backend.device
        )
        model.eval()
        try:
            for pieces in self.forward.split(batch):
                for rows in pieces:
                    values = self.rows_values(model, batch, rows, grad=False)
                    out[rows, : values.shape[1]] = values
        finally:
            model.train()
        return out

    def update(self, batch: GenerationBatch, old_values: torch.Tensor) -> dict[str, float]:
        """num_iterations passes of the critic's own optimizer over the batch toward GAE's
        returns (from `old_values`, its values before the update): the clipped value loss, a mean
        over every counted token of the batch (so the split does not change it)."""
        critic, backend = self.critic, self.forward.backend
        model = critic.model
        returns = algorithm.gae_returns(
            batch.rewards.to(old_values.device),
            old_values,
            batch.rollout.completion_mask.to(old_values.device),
            self.gamma,
            self.lam,
        )
        pieces = self.forward.split(batch)
        num_tokens = max(1.0, backend.sum(batch.loss_mask.sum().item()))
        losses, grad_norms = [], []
        model.train()
        for _ in range(self.num_iterations):
            critic.optimizer.zero_grad(set_to_none=True)
            pass_loss = 0.0
            for minibatch in pieces:
                for rows in minibatch:
                    values = self.rows_values(model, batch, rows, grad=True)
                    width = values.shape[1]
                    mask = batch.loss_mask[rows, :width].to(values.device)
                    per_token = algorithm.clipped_value_loss(
                        values,
                        old_values[rows, :width],
                        returns[rows, :width],
                        mask,
                        self.value_clip,
                    )
                    loss = (per_token * mask).sum() / num_tokens
                    loss.backward()
                    pass_loss += loss.item()
            pass_loss = backend.sum(pass_loss)
            backend.reduce_gradients(model)
            # the norm before clipping
            grad_norm = backend.clip_grad_norm(model, self.max_grad_norm)
            if math.isfinite(pass_loss) and math.isfinite(grad_norm):
                critic.optimizer.step()
            else:
                log.warning(
                    "critic update skipped: loss %s, gradient norm %s", pass_loss, grad_norm
                )
            losses.append(pass_loss)
            grad_norms.append(grad_norm)
        return _critic_metrics(batch, old_values, returns, losses, grad_norms, backend)


def _critic_metrics(batch, old_values, returns, losses, grad_norms, backend) -> dict[str, float]:
    """The critic's metrics over every rank's counted tokens: its loss, gradient norm, values,
    returns and their explained variance."""
    mask = batch.loss_mask.to(old_values.device).bool()
    v, r = (
        backend.gather_rows(old_values[mask])[0],
        backend.gather_rows(returns[mask])[0],
    )
    explained = (
        1.0 - float((r - v).var() / r.var())
        if r.numel() > 1 and float(r.var()) > 0
        else float("nan")
    )
    return {
        "critic/value_loss": sum(losses) / len(losses),
        "critic/grad_norm": sum(grad_norms) / len(grad_norms),
        "critic/values_mean": float(v.mean()) if v.numel() else float("nan"),
        "critic/returns_mean": float(r.mean()) if r.numel() else float("nan"),
        "critic/explained_variance": explained,
    }
