"""One process, one device: the backend of a run not started by torchrun.

What it does for every device:

- a tied input embedding sends a sparse gradient (no dense vocabulary x hidden
  zeros), and the tiled output layer adds its weight gradient straight into
  the preallocated .grad (no out-of-place sum of the two gradients);
- gradients are allocated once and zeroed in place; AdamW is the fused kernel.

It installs the run's device layer (grpo.backends.device_layer: grpo.cpu on the CPU
with cpu.enabled, grpo.cuda on a CUDA device) and hands out what that layer provides: the
output layer's kernels, the engine's decoding (the CPU's fused steps, CUDA's captured loop),
and what follows each update (the CPU's memory release). Without one, the same trainer runs
plain PyTorch.

The data-parallel backend (grpo.backends.distributed) keeps all of them: it
sums gradients after the backward passes, when the in-place output-layer and
sparse-row contributions are already in the dense .grad.
"""

from __future__ import annotations

import contextlib

import torch

from grpo.backends.device_layer import device_layer
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.logprobs import OutputLayerKernels
from grpo.models.precision import bf16_autocast, uses_bf16


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; `cuda` without a GPU is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "training.device: cuda requested but no CUDA device is available; use training.device=cpu"
        )
    return torch.device(name)


def sparse_tied_embedding_gradient(model) -> None:
    """Let the input embedding send a sparse gradient when it shares its weight with the output layer.

    The lookup's dense gradient is vocabulary x hidden (670 MB for Gemma-3-270M)
    and almost all zeros: only the rows of tokens in the batch are non-zero. With
    a tied output layer the weight's gradient is dense anyway, so the sparse rows
    are simply added to it; an untied embedding keeps its dense gradient, which
    AdamW needs.
    """
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    if (
        isinstance(embedding, torch.nn.Embedding)
        and output is not None
        and embedding.weight is output.weight
    ):
        embedding.sparse = True


def enable_checkpointing(model, enabled: bool) -> None:
    """training.gradient_checkpointing (non-reentrant), and the KV cache on for generation."""
    if enabled:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    model.config.use_cache = True


def adamw(model, t, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, as training.* (`t`) configures it."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
        weight_decay=t.weight_decay,
        # one kernel per tensor, no temporaries the size of the model
        fused=device.type in ("cpu", "cuda"),
    )


class SingleProcess:
    world_size = 1
    rank = 0

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = resolve_device(cfg.training.device)
        self.bf16 = uses_bf16(cfg.training.bf16, self.device)
        self.layer = device_layer(cfg, self.device)

    @property
    def cpu(self):
        """The CPU layer (grpo.cpu.layer.CPULayer) when this run has it, else None."""
        return self.layer if self.device.type == "cpu" else None

    @property
    def is_main(self) -> bool:
        return True

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if (
            getattr(model, "hf_quantizer", None) is None
        ):  # a QLoRA base is placed by bitsandbytes, and cannot move
            model = model.to(self.device)
        enable_checkpointing(model, self.cfg.training.gradient_checkpointing)
        sparse_tied_embedding_gradient(model)
        if self.layer is not None:
            self.layer.install(model)
        return model

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = adamw(model, self.cfg.training, self.device)
        # gradients live for the whole run and are zeroed in place (no re-allocation each step)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        return optimizer

    def autocast(self):
        return bf16_autocast(self.device, self.bf16)

    def output_layer_kernels(self) -> OutputLayerKernels:
        # the output weight's gradient goes straight into its preallocated .grad (make_optimizer)
        if self.layer is not None:
            return self.layer.output_layer_kernels(weight_grad_in_place=True)
        return OutputLayerKernels(weight_grad_in_place=True)

    @property
    def decoding(self):
        return self.layer.decoding if self.layer is not None else None

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        return float(
            torch.sqrt(
                sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None)
            )
        )

    # the collectives of grpo.backends.distributed.DataParallel, for one rank
    def sum(self, value: float) -> float:
        return value

    def reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(sums)

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def all_gather_object(self, value):
        return [value]

    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
        return tensor, slice(0, len(tensor))

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        pass

    def broadcast_module(self, module: torch.nn.Module) -> None:
        pass

    def barrier(self) -> None:
        pass

    def generation(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        return optimizer

    def load_weights(self, saved, model: torch.nn.Module) -> None:
        saved.load_weights(model)

    def passes_needed(self, count: int) -> int:
        return count

    def idle_pass(self, model: torch.nn.Module, grad: bool) -> None:
        raise AssertionError("only a sharded backend pads its passes")

    def savable_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return model

    def after_update(self) -> None:
        if self.layer is not None:
            self.layer.after_update()
