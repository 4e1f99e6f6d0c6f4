"""The policy model: loading (a directory, the hub, GGUF, or the embedded model),
LoRA adapters, the tiny random models of the tests and examples, and per-token logprobs.

The names below are the interface the device layers (grpo.cpu, grpo.cuda) build on; they
import them from here, never from the modules, which may change behind these names. Each is
loaded when first asked for, so importing one module of this package costs no more than it.

    OutputLayerKernels   how the tiled output layer computes its tiles (grpo.models.logprobs)
    TILE_DEFINITION      the tiles' element-wise work as plain functions, to compile
    sharded_by_fsdp      whether FSDP shards a model's parameters (no whole weight to read)
    cache_argument       the name of the KV-cache argument of a model's forward
    position_ids_from_mask  the positions that skip left padding
    adapter_sublayers, merged_linear, plain_lora_linear, lora_layers, peft_model
                         LoRA layers, their merged weights, the PeftModel beside the policy
                         (grpo.models.lora)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "OutputLayerKernels": "grpo.models.logprobs",
    "TILE_DEFINITION": "grpo.models.logprobs",
    "sharded_by_fsdp": "grpo.models.logprobs",
    "cache_argument": "grpo.models.logprobs",
    "position_ids_from_mask": "grpo.models.logprobs",
    "adapter_sublayers": "grpo.models.lora",
    "merged_linear": "grpo.models.lora",
    "plain_lora_linear": "grpo.models.lora",
    "lora_layers": "grpo.models.lora",
    "peft_model": "grpo.models.lora",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
