"""TRL's LoRA arguments as grpo's `model.lora`: a peft.LoraConfig (`peft_config=`) mapped onto
its keys by `lora_keys`, and a peft.PeftModel passed as the model adopted as grpo's LoRA holds
its own; whatever grpo's plain LoRA does not implement is refused by name."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

from grpo.config.errors import ConfigError


def is_peft_model(model) -> bool:
    """Whether `model` is a peft.PeftModel (never, when peft was not imported)."""
    peft = sys.modules.get("peft")  # not imported: then it cannot be one
    return peft is not None and isinstance(model, peft.PeftModel)


def model_and_lora_keys(model, peft_config) -> tuple[Any, dict[str, Any] | None, Any]:
    """GRPOTrainer's model= and peft_config= as grpo's: the model trained (a PeftModel's base
    model, adapted in place), the model.lora keys (None without LoRA), and the PeftModel passed
    (None unless one was)."""
    if not is_peft_model(model):
        return model, (lora_keys(peft_config, model) if peft_config is not None else None), None
    if peft_config is not None:
        raise ConfigError(
            "GRPOTrainer: model is a PeftModel and peft_config is given; pass one: the PeftModel (its "
            "adapter is trained) or the base model with peft_config (merge_and_unload the PeftModel first)"
        )
    inner, keys = adopt_peft_model(model)
    return inner, keys, model


def adopt_peft_model(model) -> tuple[Any, dict[str, Any]]:
    """A peft.PeftModel holding one plain LoRA adapter, as grpo's LoRA holds its own: the
    transformers model inside (adapted in place) with the wrapper kept beside it
    (grpo.models.lora.peft_model), and the model.lora keys of that adapter. Its adapter is the
    one trained, from the weights it has; anything grpo's LoRA cannot train is refused by name."""
    import peft

    from grpo.models import lora

    configs = dict(model.peft_config)
    if list(configs) != [lora.POLICY_ADAPTER]:
        raise ConfigError(
            f"GRPOTrainer: model is a PeftModel with adapters {sorted(configs)}; grpo trains one LoRA adapter "
            f"named {lora.POLICY_ADAPTER!r}: pass a PeftModel made with get_peft_model(model, LoraConfig(...)), "
            "or the base model with peft_config"
        )
    config = configs[lora.POLICY_ADAPTER]
    if not isinstance(config, peft.LoraConfig):
        raise ConfigError(
            f"GRPOTrainer: model is a PeftModel with a {type(config).__name__} adapter; grpo trains LoRA adapters "
            "only: use peft.LoraConfig"
        )
    if config.inference_mode:
        raise ConfigError(
            "GRPOTrainer: model is a PeftModel loaded for inference (its adapter is frozen); load it with "
            "PeftModel.from_pretrained(base_model, path, is_trainable=True)"
        )
    inner = model.get_base_model()
    keys = lora_keys(config, inner)
    lora.attach_peft_model(inner, model)
    return inner, keys


LORA_MAPPING = {
    "r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "target_modules": "model.lora.target_modules",
}
"""LoraConfig field -> the grpo key it sets."""

LORA_DESCRIPTIVE = {
    "task_type",
    "peft_type",
    "peft_version",
    "auto_mapping",
    "base_model_name_or_path",
    "runtime_config",
}
"""LoraConfig fields peft fills in itself or that describe the wrapper rather than the adapter
(task_type is checked on its own). Any other field off peft's default is refused by name."""


def lora_keys(peft_config, model=None) -> dict[str, Any]:
    """The grpo keys (model.lora.*) a peft.LoraConfig stands for; a ConfigError naming each of
    its settings that grpo's plain LoRA does not honour (DoRA, biases, rank patterns, ...)."""
    import peft

    if not isinstance(peft_config, peft.LoraConfig):
        raise TypeError(
            f"GRPOTrainer: peft_config must be a peft.LoraConfig (grpo trains LoRA adapters), "
            f"got {type(peft_config).__name__}"
        )
    task = peft_config.task_type
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ConfigError(
            f"GRPOTrainer: peft_config.task_type={task!s}: grpo trains causal language models; "
            "use task_type='CAUSAL_LM' or leave it unset"
        )
    default = peft.LoraConfig()
    refused = [
        f.name
        for f in dataclasses.fields(peft_config)
        if f.name not in LORA_MAPPING
        and f.name not in LORA_DESCRIPTIVE
        and getattr(peft_config, f.name) != getattr(default, f.name)
    ]
    if refused:
        settings = ", ".join(f"{name}={getattr(peft_config, name)!r}" for name in refused)
        raise ConfigError(
            f"GRPOTrainer: peft_config sets {settings}, which grpo's LoRA does not implement (plain adapters from "
            "r, lora_alpha, lora_dropout and target_modules); leave them at peft's defaults"
        )
    return {
        "model.lora.r": peft_config.r,
        "model.lora.alpha": float(peft_config.lora_alpha),
        "model.lora.dropout": float(peft_config.lora_dropout),
        "model.lora.target_modules": _lora_targets(peft_config.target_modules, model),
    }


def _lora_targets(targets, model) -> list[str]:
    if isinstance(targets, str):
        if targets == "all-linear":
            return ["all-linear"]
        raise ConfigError(
            f"GRPOTrainer: peft_config.target_modules={targets!r}: a string other than 'all-linear' is a regular "
            "expression in peft, which grpo does not take; list the module names instead (e.g. ['q_proj', 'v_proj'])"
        )
    if targets is not None:
        return sorted(targets)  # peft keeps a list as a set: no order to keep
    # peft's own choice for the architecture, as get_peft_model makes it
    from peft.utils.constants import (
        TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS,
    )

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULTS:
        return sorted(PEFT_DEFAULTS[model_type])
    warnings.warn(
        "GRPOTrainer: peft_config.target_modules=None and the model's type is not known here (peft picks per "
        "architecture): adapting every Linear layer (target_modules='all-linear'); set target_modules to choose",
        stacklevel=5,  # GRPOTrainer's caller: here, lora_keys, model_and_lora_keys, GRPOTrainer
    )
    return ["all-linear"]
