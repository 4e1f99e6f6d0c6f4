"""float32 matrix products on the CPU through oneDNN.

torch sends a float32 `F.linear` on the CPU to MKL. On AMD CPUs MKL runs a
generic code path; oneDNN, which ships inside the same torch build, does the
same float32 products (float32 accumulation, no reduced-precision shortcut)
about twice as fast. Measured on the 2-core AMD EPYC this project is
developed on, 1024 x 640 by 640 x 262,144 (Gemma's output layer): 2.34 s with
MKL, 1.06 s with oneDNN; results agree with a float64 product to 1e-6
relative either way (tests/test_kernels.py).

`use_cpu_linear(model)` switches a model's `nn.Linear` layers to `CPULinear`,
a subclass whose forward and backward run through oneDNN for float32 CPU
tensors and fall back to `F.linear` for everything else (CUDA, bf16 autocast,
other dtypes). Parameters, state dicts and `isinstance(m, nn.Linear)` are
unchanged. Products that are not layers (the tiled output layer in
`grpo.logprobs`) call `linear_nt` directly.

A cast-once cache of bf16 weight copies for bf16 autocast was tried (autocast
casts every weight again in every forward pass) and measured no faster in the
benchmark (10.5 s vs 10.6 s per bf16 step) while holding 0.54 GB more, so it
is not kept.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    """oneDNN's linear op exists in this torch build and agrees with F.linear."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 5, generator=gen), torch.randn(4, 5, generator=gen)
        return bool(torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def _onednn_applies(*tensors: torch.Tensor) -> bool:
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() > 0 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and onednn_available()
    )


def linear_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T for a [..., K] and b [N, K] (no autograd); oneDNN for float32 CPU
    tensors, strided views accepted, otherwise torch's matmul."""
    if _onednn_applies(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return a @ b.t()


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        with torch.autocast("cpu", enabled=False):  # float32 gradients even if called under autocast
            if ctx.needs_input_grad[0]:
                grad_x = linear_nt(g, weight.t()).reshape(x.shape)  # g @ W
            if ctx.needs_input_grad[1]:
                grad_w = linear_nt(g.t(), x.reshape(-1, x.shape[-1]).t())  # g^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN for float32 CPU tensors outside autocast."""
    if _onednn_applies(x, weight, *([bias] if bias is not None else [])):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class CPULinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU products run through oneDNN (see module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_cpu_linear(model: torch.nn.Module) -> int:
    """Switch every plain nn.Linear in `model` to CPULinear, in place; returns how many.
    Subclasses (LoRA, quantized layers) are left alone."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CPULinear
            count += 1
    return count
