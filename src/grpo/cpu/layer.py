"""The one seam between the CPU speed layer and the rest of grpo.

A backend running on the CPU with `cpu.enabled` builds one `CPULayer` and asks it:

    install(model)          on the prepared model: Linear layers through oneDNN and
                            grouped-query attention (cpu.kernels), then the compiled
                            RMS norms when the update's kernels are compiled (cpu.compile)
    output_layer_kernels()  how grpo.models.logprobs computes the output layer's tiles:
                            compiled tile math, oneDNN products, cache-sized tiles
    decoding(model, ...)    the decoding steps the `hf` engine generates with
                            (cpu.decoding: fused, or transformers' modules from
                            oneDNN-packed weights)
    after_update()          the update's freed heap back to the OS before the next rollout

Nothing else in grpo imports grpo.cpu (the backends choose it in grpo.backends.device_layer):
the training loop, the update, the log-probabilities and the engine take what the backend hands
them, and without this layer they run plain PyTorch, with the same results to float tolerance
(tests/cpu/test_layer.py). It uses only the public interfaces of grpo.rollout and grpo.models.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from grpo.config.errors import ConfigError
from grpo.config.training import CPUConfig
from grpo.cpu import attention, compiled_norms, compiling, kernels, tile_math
from grpo.cpu.fused_decoding import FusedDecoder, fused_decoding_applies, unsupported_reason
from grpo.cpu.memory import release_free_memory
from grpo.models import OutputLayerKernels
from grpo.rollout import TransformersSteps

TILE_ELEMENTS = 1 << 22
"""Logit elements per output-layer tile: a float32 tile of 16 MB stays mostly in cache across the
passes made over it (max, exp, sums)."""


def onednn_product(a: torch.Tensor, b: torch.Tensor, out) -> torch.Tensor:
    """a @ b.T through oneDNN where grpo.cpu.kernels.uses_onednn picks it (a new tensor), else
    torch's matmul into the buffer `out()`."""
    if kernels.uses_onednn(a, b):
        return kernels.linear_nt(a, b)
    return kernels.linear_nt(a, b, out=out())


class CPULayer:
    """The CPU speed layer of one run, as the cpu: section configures it (see the module's docstring)."""

    def __init__(self, cfg: CPUConfig):
        self.cfg = cfg
        self.compiled = False
        """Whether the update's element-wise work runs compiled (cpu.compile, resolved by `install`)."""

    def install(self, model: torch.nn.Module, swap_modules: bool = True) -> None:
        """The CPU mechanisms on `model`, as it will train (after LoRA wrapped it). `swap_modules`
        False (FSDP's shards) leaves its Linear and attention modules as they are."""
        if swap_modules and self.cfg.kernels:
            kernels.use_cpu_linear(model)
            attention.use_grouped_attention(model)
        self.compiled = compiling.use_compiled(self.cfg.compile, model)
        if self.compiled:
            compiled_norms.use_compiled_norms(model)
        if self.cfg.decoding == "fused":
            was_training = model.training
            reason = unsupported_reason(model.eval())  # as it will decode: in eval mode
            model.train(was_training)
            if reason is not None:
                raise ConfigError(
                    f"cpu.decoding: fused decoding does not support this model ({reason}); use cpu.decoding=auto or plain"
                )

    def output_layer_kernels(self, weight_grad_in_place: bool) -> OutputLayerKernels:
        kernels = OutputLayerKernels(
            product=onednn_product,
            tile_elements=TILE_ELEMENTS,
            weight_grad_in_place=weight_grad_in_place,
        )  # the tiles' element-wise work eagerly, the default, unless it is compiled
        return dataclasses.replace(kernels, tile=tile_math.COMPILED) if self.compiled else kernels

    def uses_fused_decoding(self, model: torch.nn.Module, compute_dtype: torch.dtype) -> bool:
        if self.cfg.decoding != "auto":
            return self.cfg.decoding == "fused"
        return fused_decoding_applies(model, compute_dtype)

    @contextlib.contextmanager
    def decoding(self, model: torch.nn.Module, rows: int, max_length: int):
        """Decoding steps for one rollout of `rows` completions up to `max_length` positions, in the
        compute precision the caller opened (bf16 autocast or the weights' dtype)."""
        bf16 = (
            torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
        compute_dtype = torch.bfloat16 if bf16 else model.get_output_embeddings().weight.dtype
        if self.uses_fused_decoding(model, compute_dtype):
            yield FusedDecoder(model, rows, max_length, pack=bf16 and kernels.packing_available())
            return
        # transformers' modules, under bf16 autocast from oneDNN-reordered bf16 weights
        with kernels.packed_for_decoding(model, rows=rows):
            yield TransformersSteps(model)

    def after_update(self) -> None:
        release_free_memory()  # the update's freed buffers, before the next rollout allocates its own
