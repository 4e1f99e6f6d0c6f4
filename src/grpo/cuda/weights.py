"""The weights the fixed-shape loop decodes from: a copy of the policy in the decoding dtype, with
its LoRA adapter merged in, refreshed in place at the start of every rollout.

On CUDA the training step keeps float32 master weights and computes under bf16 autocast, which
casts every weight again at every product of every decoding step; a captured graph would also
bake those casts in. The loop reads a bf16 copy instead, outside autocast: one cast of each
weight per rollout, not one per token. With LoRA the copy holds each adapted layer's merged
weight W + scale * B @ A (grpo.models.merged_linear), so a decoding step costs what it costs
without an adapter. The copy is a module of the policy's own class (a deep copy whose parameters
are fresh tensors of the decoding dtype, its buffers and settings the policy's), and the
refresh writes into its tensors in place, because a captured graph reads them at fixed addresses.
A parameter already in the decoding dtype, of a model without LoRA, is shared, not copied (a bf16
policy decodes from its own weights). The refresh runs at the start of each rollout, so the copy
is never behind the policy: after an optimizer step, a restored checkpoint or anything else that
changed the weights; it is one pass over them, where decoding reads them once per token.

The CPU tests build the same copy in float32 (tests/cuda/test_weights.py).
"""

from __future__ import annotations

import copy

import torch

from grpo.models import lora_layers, merged_linear, peft_model, plain_lora_linear, sharded_by_fsdp


def unsupported_reason(policy: torch.nn.Module) -> str | None:
    """Why the policy cannot be copied for decoding, or None."""
    if getattr(policy, "hf_quantizer", None) is not None:
        return "a quantized base model (its weights are not plain tensors to copy)"
    if sharded_by_fsdp(policy):
        return "parameters sharded by FSDP"
    if not all(plain_lora_linear(layer) for layer in lora_layers(policy)):
        return "a LoRA variant whose merged weight is not all it computes (DoRA, an adapted embedding, adapter biases)"
    return None


class DecodingCopy:
    """The policy's weights for decoding (see the module's docstring): `refreshed(policy, dtype)`
    -> the copy, built on first use and rewritten in place on every later call."""

    def __init__(self):
        self.model: torch.nn.Module | None = None
        self._source: torch.nn.Module | None = None
        self._dtype: torch.dtype | None = None
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module, bool]] = []

    @torch.no_grad()
    def refreshed(self, policy: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        if self.model is None or self._source is not policy or self._dtype != dtype:
            self.model, self._pairs = _copy_for_decoding(policy, dtype)
            self._source, self._dtype = policy, dtype
        for target, source, adapted in self._pairs:
            if adapted:
                weight, bias = merged_linear(source)
                target.weight.copy_(weight)
                if bias is not None:
                    target.bias.copy_(bias)
                continue
            for name, p in target.named_parameters(recurse=False):
                src = getattr(source, name)
                if p is not src:
                    p.copy_(src)
        return self.model

    def release(self) -> None:
        """Drop the copy (its memory), e.g. once the loop is no longer used."""
        self.model, self._source, self._dtype, self._pairs = None, None, None, []


def _copy_for_decoding(policy: torch.nn.Module, dtype: torch.dtype):
    """(copy, pairs): a deep copy of `policy` whose parameters are new, uninitialised tensors in
    `dtype` (integers kept), with each LoRA layer replaced by its base Linear; and the (copy's
    module, policy's module, adapted) pairs that `refreshed` writes the weights through."""
    adapted_layers = lora_layers(policy)
    share = not adapted_layers
    memo: dict[int, object] = {}
    wrapper = peft_model(policy)
    if wrapper is not None:  # the PeftModel kept beside the policy: not part of what decodes
        memo[id(wrapper)] = None
    for p in policy.parameters():
        if id(p) in memo:
            continue
        target = dtype if p.is_floating_point() else p.dtype
        if share and p.dtype == target:
            memo[id(p)] = p
        else:
            memo[id(p)] = torch.nn.Parameter(
                torch.empty(p.shape, dtype=target, device=p.device), requires_grad=False
            )
    # a parameter's copy is its memo'd placeholder, so no gradient is copied with it; the
    # PeftModel maps to None, which is what grpo.models.peft_model reads for "no adapter"
    model = copy.deepcopy(policy, memo)
    model.eval()
    # each LoRA layer of the copy becomes its base Linear, which will hold the merged weight
    adapted_ids = {id(m) for m in adapted_layers}
    adapted_names = {name for name, m in policy.named_modules() if id(m) in adapted_ids}
    for name in sorted(adapted_names, key=len, reverse=True):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, getattr(parent, child).base_layer)
    pairs = []
    for name, target in model.named_modules():
        if not any(True for _ in target.parameters(recurse=False)):
            continue
        source = policy.get_submodule(name)
        pairs.append((target, source, name in adapted_names))
    return model, pairs
