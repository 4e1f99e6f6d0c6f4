"""The reference policy of the KL penalty, behind one small interface.

    none         beta = 0: no reference, nothing loaded (TRL's default)
    frozen copy  a copy of the starting policy, never trained; `sync` replaces or
                 blends it with the current policy every `ref_sync_steps`
                 (DeepSeek-R1 replaced it every 400 steps)

With LoRA the reference will be the base model with the adapter disabled (no
copy); it implements the same three methods.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Protocol

import torch

from grpo.config import AlgorithmConfig


class Reference(Protocol):
    enabled: bool

    def module(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The model to compute reference logprobs with, for the duration of the context."""

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a restored run needs to rebuild this reference (None: it is rebuilt from the policy)."""


class NoReference:
    enabled = False

    def module(self):
        raise RuntimeError("no reference model (algorithm.beta = 0)")

    def sync(self, policy, alpha: float) -> None:
        raise RuntimeError("no reference model to sync (algorithm.beta = 0)")

    def state_dict(self) -> None:
        return None


class FrozenCopy:
    """A frozen copy of the policy as it is when this is built, or with `weights`
    (the state_dict of a saved reference)."""

    enabled = True

    def __init__(self, policy: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None):
        self.model = copy.deepcopy(policy)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if weights is not None:
            self.model.load_state_dict(weights)

    @contextlib.contextmanager
    def module(self) -> Iterator[torch.nn.Module]:
        yield self.model

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        with torch.no_grad():
            for ref_p, p in zip(self.model.parameters(), policy.parameters()):
                ref_p.mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # always the weights: a restored run's policy is no longer the starting policy to copy
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def create_reference(cfg: AlgorithmConfig, policy: torch.nn.Module, restore: dict[str, torch.Tensor] | None = None) -> Reference:
    return FrozenCopy(policy, restore) if cfg.beta > 0 else NoReference()
