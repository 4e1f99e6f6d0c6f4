"""LoRA adapters through peft: applying them to a loaded policy, and what the rest of grpo
needs to know about an adapted model.

`apply_lora(model, cfg.model.lora, seed)` wraps the policy with peft's `get_peft_model`
(a `LoraConfig` from grpo's fields, task type CAUSAL_LM): every base weight is frozen,
and each targeted Linear layer becomes peft's `lora.Linear`, which holds the original
layer as its `base_layer` and adds `scale * B @ A` (scale = alpha / r) to its output.

The policy module the trainer, the rollout engine and the logprobs work with stays the
transformers model itself (`PeftModel.get_base_model()`, the same object, adapted in
place): its decoder body, output layer and cache arguments are where grpo's chunked
logprobs and fused decoder look for them, which a `PeftModel` wrapper hides behind its
own `forward(**kwargs)` and attribute forwarding. The wrapper is kept with the model
(`peft_model(model)`) for what only it does: switching the adapter off
(`disable_adapter()`, the KL reference without a copy), adding and switching adapters
(a reference reset with `ref_sync_steps`), and writing peft's adapter files.

The adapter's initial weights are drawn from `training.seed` (B = 0, so the adapted
model starts as the base model), without touching the global random state.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from grpo.config.errors import ConfigError
from grpo.config.model_data import LoraConfig

POLICY_ADAPTER = "default"
"""peft's name for the adapter that trains."""
_WRAPPER = "_grpo_peft_model"
"""Attribute of an adapted model holding its PeftModel (set outside torch's module registry:
the wrapper contains the model, and a registered cycle would make state_dict recurse)."""


def peft_config(cfg: LoraConfig, inference_mode: bool = False):
    """peft's LoraConfig from grpo's `model.lora` section."""
    from peft import LoraConfig as PeftLoraConfig

    targets = cfg.target_modules
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=inference_mode,
    )


def peft_model(model: torch.nn.Module):
    """The PeftModel that adapted `model` (apply_lora), or None for a model without LoRA."""
    return model.__dict__.get(_WRAPPER)


def attach_peft_model(model: torch.nn.Module, wrapper) -> None:
    """Keeps `wrapper`, the PeftModel whose base model `model` is, beside it (what `peft_model`
    returns): a PeftModel made elsewhere (GRPOTrainer's model=) held as apply_lora holds its own."""
    object.__setattr__(model, _WRAPPER, wrapper)


def is_adapted(model: torch.nn.Module) -> bool:
    return peft_model(model) is not None


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's LoRA layers in `model` (lora.Linear, lora.Embedding, ...)."""
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def linear_module_names(model: torch.nn.Module, limit: int = 12) -> list[str]:
    """The distinct last names of the model's Linear layers (q_proj, ..., lm_head), for messages."""
    names: list[str] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf not in names:
            names.append(leaf)
    return names[:limit]


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> torch.nn.Module:
    """`model` with LoRA adapters per `cfg` (the same object, adapted in place), or `model`
    unchanged when cfg.r == 0. Idempotent: an already adapted model is returned as it is."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        raise ConfigError(
            "model: a PeftModel was passed; grpo applies the adapter itself from model.lora: pass the "
            "transformers model before wrapping and set model.lora.r (and alpha, dropout, target_modules)"
        )
    if is_adapted(model):
        rank = peft_model(model).peft_config[POLICY_ADAPTER].r
        if rank != cfg.r:
            raise ConfigError(
                f"model.lora.r: {cfg.r}, but the model passed already carries a rank-{rank} adapter from an earlier "
                f"Trainer; pass a fresh model, or set model.lora.r: {rank}"
            )
        return model
    if lora_layers(model):
        raise ConfigError(
            "model: the model passed already holds peft LoRA layers; pass the model before get_peft_model and set "
            "model.lora instead (or merge the adapter first with merge_and_unload)"
        )
    if cfg.r == 0:
        return model
    _refuse_output_layer(model, cfg)
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "hf_quantizer", None) is not None:
        # QLoRA: norms in float32, inputs that carry gradients into the frozen quantized layers.
        # Activation checkpointing is the backend's (training.gradient_checkpointing).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    device = next(model.parameters()).device
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=devices):  # the adapter's initial A from training.seed alone
        torch.manual_seed(seed)
        try:
            wrapper = get_peft_model(model, peft_config(cfg))
        except ValueError as error:
            if "not found in the base model" not in str(error) and "Target module" not in str(
                error
            ):
                raise
            raise ConfigError(
                f"model.lora.target_modules: {cfg.target_modules} match no layer of this model; its Linear layers "
                f"are named {', '.join(linear_module_names(model))}; set model.lora.target_modules to some of these "
                "(e.g. [q_proj, v_proj]) or to [all-linear]"
            ) from None
    inner = wrapper.get_base_model()
    output = inner.get_output_embeddings()
    if output is not None and hasattr(
        output, "base_layer"
    ):  # matched some other way (a regular expression)
        raise ConfigError(_OUTPUT_LAYER_ERROR.format(targets=cfg.target_modules))
    attach_peft_model(inner, wrapper)
    return inner


# grpo's tiled logprobs read the output layer's weight directly, so an adapter there would be left out
_OUTPUT_LAYER_ERROR = (
    "model.lora.target_modules: {targets} include the output layer, which grpo computes in tiles from its "
    "weight (an adapter on it would be left out); leave it out (all-linear already does)"
)


def _refuse_output_layer(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Before wrapping (which changes the model in place): no adapter on the output layer.
    peft matches a module name by its last parts (`lm_head` matches `model.lm_head`)."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = (
        next((n for n, m in model.named_modules() if m is output), None)
        if output is not None
        else None
    )
    if name and any(name == t or name.endswith("." + t) for t in cfg.target_modules):
        raise ConfigError(_OUTPUT_LAYER_ERROR.format(targets=cfg.target_modules))


# ------------------------------------------------------------------ adapter weights


def adapter_parameters(
    model: torch.nn.Module, adapter: str = POLICY_ADAPTER
) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter, by their name with the adapter's name taken out
    (`...q_proj.lora_A.weight`), so that two adapters' parameters pair up by key."""
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if adapter in parts and any(part.startswith("lora_") for part in parts):
            out[".".join(part for part in parts if part != adapter)] = p
    return out


def copy_adapter(model: torch.nn.Module, source: str, target: str, alpha: float = 1.0) -> None:
    """target <- alpha * source + (1 - alpha) * target, for every weight of two adapters of `model`."""
    src, dst = adapter_parameters(model, source), adapter_parameters(model, target)
    if src.keys() != dst.keys():
        raise ValueError(f"adapters {source!r} and {target!r} do not have the same layers")
    with torch.no_grad():
        for key, p in src.items():
            dst[key].mul_(1.0 - alpha).add_(p.detach(), alpha=alpha)


def adapter_state_dict(
    model: torch.nn.Module, adapter: str = POLICY_ADAPTER
) -> dict[str, torch.Tensor]:
    """One adapter's weights as peft saves them (its adapter_model.safetensors), cloned."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model(model), adapter_name=adapter)
    return {k: v.detach().clone() for k, v in state.items()}


def load_adapter_state(
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    adapter: str = POLICY_ADAPTER,
    what: str = "adapter",
) -> None:
    """peft-format adapter weights (adapter_model.safetensors, adapter_state_dict) into one
    adapter of `model`, in place; every weight of that adapter must be given, nothing else."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    wrapper = peft_model(model)
    expected = set(get_peft_model_state_dict(wrapper, adapter_name=adapter))
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{what}: its weights do not fit this model's LoRA adapter (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); use the model and model.lora settings the run started with"
        )
    with torch.no_grad():
        set_peft_model_state_dict(wrapper, weights, adapter_name=adapter)


@contextlib.contextmanager
def active_adapter(model: torch.nn.Module, adapter: str) -> Iterable[torch.nn.Module]:
    """Within the context, `adapter` is the one in use, frozen; after, the policy's adapter is
    in use and trainable again (peft's set_adapter sets requires_grad on the adapter it activates)."""
    wrapper = peft_model(model)
    wrapper.set_adapter(adapter, inference_mode=True)
    try:
        yield model
    finally:
        wrapper.set_adapter(POLICY_ADAPTER)


# ------------------------------------------------------------------ merged weights


def merged_linear(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a Linear layer as it computes: for a peft lora.Linear, its base weight
    plus scale * B @ A of each active adapter (a new tensor; the layer is left untouched)."""
    base = getattr(layer, "base_layer", None)
    if base is None:
        return layer.weight, layer.bias
    weight = base.weight
    if not layer.disable_adapters and not layer.merged:  # merged: the base weight already holds it
        with torch.no_grad():
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    weight = weight + layer.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def plain_lora_linear(layer: torch.nn.Module) -> bool:
    """Whether `layer` is a Linear or a peft lora.Linear over a Linear with plain LoRA (no DoRA
    or other variant, no adapter bias): a layer whose merged weight is all it computes."""
    if isinstance(layer, torch.nn.Linear):
        return True
    base = getattr(layer, "base_layer", None)
    return (
        isinstance(base, torch.nn.Linear)
        and hasattr(layer, "get_delta_weight")
        and not getattr(layer, "lora_variant", {})
        and not any(getattr(layer, "use_dora", {}).values())
        and not any(getattr(layer, "lora_bias", {}).values())
    )


def adapter_sublayers(model: torch.nn.Module) -> set[int]:
    """ids of the small Linear layers inside LoRA layers (each adapter's A and B)."""
    ids: set[int] = set()
    for layer in lora_layers(model):
        for key in ("lora_A", "lora_B"):
            ids.update(id(m) for m in getattr(layer, key, {}).values())
    return ids


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model whose weights are `model`'s with its adapter merged in
    (merge_and_unload of a copy); `model` itself is left as it is."""
    import copy

    wrapper = peft_model(model)
    if wrapper is None:
        return copy.deepcopy(model)
    return copy.deepcopy(wrapper).merge_and_unload()


# ------------------------------------------------------------------ counting


def held_tensors(*modules: torch.nn.Module) -> dict[int, int]:
    """{storage address: elements} of every parameter and buffer the modules hold, a tensor
    shared between them (tied weights, a reference that is the policy) counted once."""
    held: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            storage = t.untyped_storage()
            held[storage.data_ptr()] = max(
                held.get(storage.data_ptr(), 0), storage.nbytes() // t.element_size()
            )
    return held


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`, shared tensors counted once."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = (p.numel(), p.requires_grad)
    return sum(n for n, g in seen.values() if g), sum(n for n, _ in seen.values())
