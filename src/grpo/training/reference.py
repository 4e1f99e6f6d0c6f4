"""The reference policy of the KL penalty, behind one small interface.

    none         beta = 0: no reference, nothing loaded (TRL's default)
    frozen copy  a copy of the starting policy, never trained; `sync` replaces or
                 blends it with the current policy every `ref_sync_steps`
                 (DeepSeek-R1 replaced it every 400 steps)

With LoRA (`model.lora.r > 0`) no copy of the model is made:

    adapter disabled   the reference is the policy with its adapter switched off
                       (peft's `disable_adapter()`): the base model, as it started
    frozen adapter     with `ref_sync_steps`: the base model plus a second, frozen
                       adapter (`grpo_reference`) holding a copy of the policy's adapter
                       as it was at the last reset (at the start: B = 0, so the base
                       model); `module()` makes it the active adapter for its duration.
                       Its state_dict is that adapter's weights, a few MB.

`ref_sync_alpha < 1` blends the reference adapter's A and B factors, each by
alpha; their product is then not the blend of the two adapters' products
(B' A' != alpha B1 A1 + (1 - alpha) B0 A0), a property of blending factorised
weights. alpha = 1 (the default, DeepSeek-R1's reset) copies the adapter exactly.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from grpo.config.algorithm import AlgorithmConfig
from grpo.models import lora
from grpo.training.batching import GenerationBatch
from grpo.training.forward import Forward


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


class AdapterDisabled:
    """The policy with its LoRA adapter switched off: the base model, without a copy."""

    enabled = True

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy
        self.wrapper = lora.peft_model(policy)

    @contextlib.contextmanager
    def module(self) -> Iterator[torch.nn.Module]:
        with self.wrapper.disable_adapter():
            yield self.policy

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        raise RuntimeError(
            "the base model is never synced; with ref_sync_steps the reference is a FrozenAdapter"
        )

    def state_dict(self) -> None:
        return None  # the base model: rebuilt from the model the run starts from


class FrozenAdapter:
    """The base model plus a frozen copy of the policy's adapter, made when this is built
    (or `weights`: a saved reference adapter's state_dict), replaced or blended by `sync`."""

    enabled = True
    NAME = "grpo_reference"

    def __init__(self, policy: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None):
        from peft import PeftModel

        self.policy = policy
        wrapper = lora.peft_model(policy)
        config = copy.deepcopy(wrapper.peft_config[lora.POLICY_ADAPTER])
        config.lora_dropout = 0.0  # the reference is evaluated as it is, in training mode too
        # not inference_mode: peft's add_adapter would apply it to the active (policy's) adapter too
        config.inference_mode = False
        trainable = {k: p.requires_grad for k, p in lora.adapter_parameters(policy).items()}
        PeftModel.add_adapter(wrapper, self.NAME, config)
        for key, p in lora.adapter_parameters(policy).items():
            p.requires_grad_(trainable[key])
        self.weights = lora.adapter_parameters(policy, self.NAME)
        for p in self.weights.values():  # never trained, never in the optimizer (built after this)
            p.requires_grad_(False)
        if weights is None:
            lora.copy_adapter(policy, lora.POLICY_ADAPTER, self.NAME)
        else:
            lora.load_adapter_state(policy, weights, self.NAME, what="the saved reference adapter")

    @contextlib.contextmanager
    def module(self) -> Iterator[torch.nn.Module]:
        with lora.active_adapter(self.policy, self.NAME) as model:
            yield model

    def sync(self, policy: torch.nn.Module, alpha: float) -> None:
        lora.copy_adapter(policy, lora.POLICY_ADAPTER, self.NAME, alpha)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return lora.adapter_state_dict(self.policy, self.NAME)


def create_reference(
    cfg: AlgorithmConfig, policy: torch.nn.Module, restore: dict[str, torch.Tensor] | None = None
) -> Reference:
    """None for beta = 0; for a LoRA policy the base model (adapter disabled), or with
    ref_sync_steps a frozen adapter; otherwise a frozen copy of the policy."""
    if cfg.beta <= 0:
        return NoReference()
    if lora.is_adapted(policy):
        return FrozenAdapter(policy, restore) if cfg.ref_sync_steps else AdapterDisabled(policy)
    return FrozenCopy(policy, restore)


@dataclass
class ReferencePhase:
    """The reference phase of a step, and the reference's refresh after it: log pi_old (only
    with num_iterations > 1: else the update takes its own, detached) and log pi_ref (only with a
    reference: beta > 0) of a batch, without gradients, by `forward`; every `sync_steps` steps
    (algorithm.ref_sync_steps; None: never) the reference replaced by, or blended at `alpha`
    with, the policy."""

    policy: torch.nn.Module
    reference: Reference
    forward: Forward
    num_iterations: int
    sync_steps: int | None
    alpha: float

    def __call__(self, batch: GenerationBatch) -> tuple:
        old_logp = self.forward.batch(self.policy, batch) if self.num_iterations > 1 else None
        ref_logp = None
        if self.reference.enabled:
            with self.reference.module() as reference:
                ref_logp = self.forward.batch(reference, batch)
        return old_logp, ref_logp

    def after_step(self, step: int) -> None:
        """`step` steps are done: the reference is refreshed when a sync is due."""
        if self.sync_steps and step % self.sync_steps == 0:
            self.reference.sync(self.policy, self.alpha)
