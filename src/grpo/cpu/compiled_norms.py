"""The decoder's RMS norms as compiled kernels (cpu.compile).

A transformers RMS norm is some nine element-wise operations, each its own pass
over the input in float32 (Gemma 3's: a cast to float32, square, mean, add,
rsqrt, multiply, 1 + weight, multiply, a cast back), and autograd keeps their
intermediates and runs as many again backward. Gemma-3-270M has six norms a
layer (four over the hidden state, two over the query and key heads), and in a
profile of a bf16 update most of its element-wise multiplications are the
norms'. Compiled by torch.compile, a norm's forward is one pass and its
backward one or two (measured: docs/performance.md).

`use_compiled_norms(model)` switches every RMS-norm module of a model (a class
named `...RMSNorm` whose forward takes one tensor: Gemma 3, Llama, Qwen2,
Qwen3 and their kin) to a subclass whose forward is the class's own forward,
compiled: the same operations, in float32 where the original computes in
float32 and rounded to bf16 where it rounds (grpo.cpu.compiling keeps those casts),
so the values agree with eager to float32 rounding, the order of the mean's sum
aside (tests/cpu/test_compiled_norms.py). Through a whole bf16 model that rounding
moves bf16 results as any reordering does: Gemma-3-270M's token log-probabilities
were 0.024 (eager) and 0.025 (compiled) from float32's on average. Inputs below
`MIN_ELEMENTS` (a decoding step's few rows) run eagerly, where a compiled
call's fixed cost is more than the work. Parameters,
state dicts and `isinstance` are unchanged.

Autograd through a compiled function has its backward compiled too;
grpo.cpu.compiling builds it with the forward, so a compile that fails does so
inside `grpo.cpu.compiling.call`, which falls back to eager, and never in the
middle of a backward pass.
"""

from __future__ import annotations

import functools
import inspect

import torch

from grpo.cpu import compiling

MIN_ELEMENTS = 1 << 16
"""Inputs with fewer elements run the eager forward: a decoding step (16 rows of 640) does, a
forward pass over a micro-batch (hundreds of tokens) does not."""


class CompiledNorm:
    """Marks a norm module switched to its compiled forward (the subclasses below)."""


def _is_rms_norm(module: torch.nn.Module) -> bool:
    cls = type(module)
    if isinstance(module, CompiledNorm) or not cls.__name__.endswith("RMSNorm"):
        return False
    return len(inspect.signature(cls.forward).parameters) == 2  # (self, hidden_states)


@functools.cache
def compiled_class(cls: type) -> type:
    """`cls` with its forward run compiled for inputs of at least MIN_ELEMENTS elements."""
    eager = cls.forward

    def forward(self, x):
        if x.numel() < MIN_ELEMENTS:
            return eager(self, x)
        return compiling.call(eager, self, x)

    return type(
        cls.__name__,
        (cls, CompiledNorm),
        {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def use_compiled_norms(model: torch.nn.Module) -> int:
    """Switches `model`'s RMS norms to compiled forwards (idempotent); how many were switched.
    Norms whose weight is sharded (FSDP's DTensor) are left eager."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if _is_rms_norm(module) and not hasattr(weight, "full_tensor"):
            module.__class__ = compiled_class(type(module))
            count += 1
    return count
