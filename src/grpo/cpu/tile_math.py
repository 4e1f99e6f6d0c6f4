"""The element-wise work over the output layer's logits, as fused kernels (torch.compile).

grpo.models.logprobs computes log-probabilities one tile of logits at a time: a
product of a chunk of hidden states with a block of the output weight, then
element-wise work over that product (the log-sum-exp and entropy sums in the
forward pass, the softmax gradient in the backward pass), and before the
products each block of the float32 weight is cast to the compute dtype, after
them each block's bf16 weight gradient is added into the float32 gradient.
Eagerly, each step is its own pass over the tile, and a mixed-dtype sum or
cast is slow. Here each is written once as a plain function of tensors and
compiled by torch.compile (inductor: vectorised C++ with OpenMP on the CPU)
into one or two passes.

The definition is grpo.models.tiles (`forward_tile`, `backward_tile`, the cast and
the sum); `COMPILED` is those very functions compiled (through grpo.cpu.compiling,
which also decides whether to compile), with the interface of grpo.models.tiles.EAGER.
Measurements: docs/performance.md.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from grpo.cpu import compiling
from grpo.models import TILE_DEFINITION

forward_tile, backward_tile = TILE_DEFINITION.forward_tile, TILE_DEFINITION.backward_tile
cast_into, accumulate = TILE_DEFINITION.cast_into, TILE_DEFINITION.accumulate


def _scalars(softcap, temperature, device) -> tuple:
    """softcap (None when off) and temperature as 0-d tensors: inputs of the compiled kernels."""
    softcap = torch.tensor(float(softcap), device=device) if softcap else None
    return softcap, torch.tensor(float(temperature), device=device)


def _forward_compiled(product, bias, column, m, S, U, target_z, softcap, temperature, buffers):
    softcap, temperature = _scalars(softcap, temperature, product.device)
    return compiling.call(
        forward_tile, product, bias, column, m, S, U, target_z, softcap, temperature
    )


def _backward_compiled(
    product, bias, column, lse, grad, softcap, temperature, out_dtype, with_bias, buffers
):
    softcap, temperature = _scalars(softcap, temperature, product.device)
    # column-major: the two products that follow, gz @ W and gz.T @ h, then read it in the layouts
    # oneDNN multiplies fastest (docs/performance.md), and the kernel writes it so at no extra cost;
    # eagerly the transposing copy would cost more
    return compiling.call(
        backward_tile,
        product,
        bias,
        column,
        lse,
        grad,
        softcap,
        temperature,
        out_dtype,
        with_bias,
        True,
    )


def _cast_into_compiled(out, x):
    compiling.call(cast_into, out, x)


def _accumulate_compiled(acc, part):
    compiling.call(accumulate, acc, part)


COMPILED = SimpleNamespace(
    forward=_forward_compiled,
    backward=_backward_compiled,
    cast_into=_cast_into_compiled,
    accumulate=_accumulate_compiled,
)
