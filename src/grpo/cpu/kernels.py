"""float32 matrix products on the CPU through oneDNN.

torch sends a float32 `F.linear` on the CPU to MKL. On AMD CPUs MKL runs a
generic code path; oneDNN, which ships inside the same torch build, does the
same float32 products (float32 accumulation, no reduced-precision shortcut)
about twice as fast (docs/performance.md); results agree with a float64 product
to 1e-6 relative either way (tests/cpu/test_kernels.py). On Intel CPUs MKL takes its own
fast path and is the faster of the two for training's products, while oneDNN
stays faster for decoding's few rows: `uses_onednn` picks by the CPU's make
and the product's rows.

`use_cpu_linear(model)` switches a model's `nn.Linear` layers to `CPULinear`,
a subclass whose forward and backward run through oneDNN for float32 CPU
tensors where `uses_onednn` picks it, and through `F.linear` for everything
else (MKL on Intel for training's products, CUDA, bf16 autocast, other
dtypes). Parameters, state dicts and `isinstance(m, nn.Linear)` are
unchanged. Products that are not layers (the tiled output layer in
`grpo.models.logprobs`) call `linear_nt` directly.

Decoding multiplies each weight by only a few rows (one token per
completion), where oneDNN is faster with the weight reordered into its own
blocked layout. `packed_for_decoding(model, rows)` makes such a copy of every
CPULinear weight in the bf16 autocast dtype for the duration of a rollout;
it replaces the bf16 copies autocast would otherwise cache, so it holds no
more memory (the cast and reorder go a 32 MB piece at a time). float32
weights are not packed: there the copy would be extra memory on top of the
float32 weights (float32 decoding multiplies by the weights themselves,
grpo.cpu.fused_decoding). Measurements, and a cast-once cache of bf16 weights
that was tried and not kept: docs/performance.md.
"""

from __future__ import annotations

import contextlib
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
        # the answer is cached: it must not depend on an autocast the first caller is under
        with torch.autocast("cpu", enabled=False):
            return bool(
                torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-5)
            )
    except (AttributeError, RuntimeError):
        return False


def onednn_applies(*tensors: torch.Tensor) -> bool:
    """Whether products of these tensors go through oneDNN here (float32 CPU, no autocast)."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() > 0 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and onednn_available()
    )


# A float32 product where one side has at most this many rows (decoding: a row per
# completion) goes through oneDNN on every CPU; see uses_onednn.
FEW_ROWS = 32


@functools.cache
def mkl_fast_path() -> bool:
    """Whether torch's MKL takes its fast float32 path on this CPU: an Intel one (on
    other makes MKL runs a generic path, half oneDNN's speed; see the module docstring)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:
        return False


def uses_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the float32 product a @ b.T (a [..., K], b [N, K]) goes through oneDNN:
    where it applies (onednn_applies), for a product with few rows on either side
    (decoding) on every CPU, and for training's larger products where MKL has no fast
    path (the measurements behind FEW_ROWS and this choice: docs/performance.md)."""
    if not onednn_applies(a, b):
        return False
    rows = min(a.numel() // a.shape[-1], b.shape[0])
    return rows <= FEW_ROWS or not mkl_fast_path()


def linear_nt(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b.T for a [..., K] and b [N, K] (no autograd); through oneDNN where
    uses_onednn (strided views accepted), otherwise torch's matmul, written into
    `out` when given (the oneDNN path returns a new tensor and ignores `out`)."""
    if uses_onednn(a, b):
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    if out is not None:
        return torch.matmul(a, b.t(), out=out)
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
        with torch.autocast(
            "cpu", enabled=False
        ):  # float32 gradients even if called under autocast
            if ctx.needs_input_grad[0]:
                grad_x = linear_nt(g, weight.t()).reshape(x.shape)  # g @ W
            if ctx.needs_input_grad[1]:
                grad_w = linear_nt(g.t(), x.reshape(-1, x.shape[-1]).t())  # g^T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN where uses_onednn (float32 CPU tensors outside autocast)."""
    if uses_onednn(x, weight) and (bias is None or onednn_applies(bias)):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


# tall_linear_nt: each piece's result is at most this many elements (2 MB of float32,
# inside the L2 cache)
TALL_PIECE_OUTPUT = 1 << 19


def tall_linear_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for a few rows of x [..., K] and a tall weight [N, K] (the output layer, when
    decoding in float32): computed as weight @ x.T, a piece of the weight at a time, each piece's
    [piece, rows] result transposed into the output while it is still in cache. oneDNN runs a
    float32 product with 16 columns and many rows faster than the same product with 16 rows:
    Gemma's 262,144 x 640 output layer and 16 rows, 2-core Intel Xeon with AMX, 72-78 -> 60-65
    ms (a whole float32 rollout: grpo.cpu.fused_decoding). At 64 rows and more it is slower: more
    than FEW_ROWS, other dtypes and devices go to linear_nt."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > FEW_ROWS or not onednn_applies(flat, weight):
        return linear_nt(x, weight)
    out = flat.new_empty(flat.shape[0], weight.shape[0])
    step = max(1, TALL_PIECE_OUTPUT // max(1, flat.shape[0]))
    for r in range(0, weight.shape[0], step):
        piece = torch.ops.mkldnn._linear_pointwise(weight[r : r + step], flat, None, "none", [], "")
        out[:, r : r + step].copy_(piece.t())
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def packing_available() -> bool:
    """oneDNN can reorder a bf16 weight for products with few rows, and gives F.linear's result."""
    if not onednn_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = (
            torch.randn(3, 5, generator=gen).bfloat16(),
            torch.randn(4, 5, generator=gen).bfloat16(),
        )
        with torch.autocast("cpu", enabled=False):  # cached, as above
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))
    except (AttributeError, RuntimeError):
        return False


# Output rows per reordered piece of a weight: the float32 -> bf16 cast and the reorder
# are done a piece at a time, so packing Gemma's 262,144 x 640 output layer needs a
# 32 MB temporary rather than a second 335 MB copy.
PACK_PIECE_ELEMENTS = 1 << 24


def pack_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, rows: int
) -> list:
    """A copy of `weight` [out, in] (and `bias`) in `dtype`, reordered by oneDNN for products
    with about `rows` rows, as [(reordered rows of the weight, their bias)] pieces of at
    most PACK_PIECE_ELEMENTS (see the module docstring). Needs packing_available()."""
    with torch.no_grad():
        step = max(1, PACK_PIECE_ELEMENTS // weight.shape[1])
        return [
            (
                torch.ops.mkldnn._reorder_linear_weight(
                    weight[r : r + step].to(dtype), max(1, rows)
                ),
                bias[r : r + step].to(dtype) if bias is not None else None,
            )
            for r in range(0, weight.shape[0], step)
        ]


def packed_product(x: torch.Tensor, pieces: list) -> torch.Tensor:
    """x @ W.T + b from pack_weight's pieces (x in their dtype)."""
    outs = [torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") for w, b in pieces]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class CPULinear(torch.nn.Linear):
    """nn.Linear whose float32 CPU products run through oneDNN where uses_onednn (see module docstring)."""

    # (dtype, pack_weight's pieces) under packed_for_decoding
    packed: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not torch.is_grad_enabled():
            dtype, pieces = self.packed
            return packed_product(x.to(dtype), pieces)
        return linear(x, self.weight, self.bias)


@contextlib.contextmanager
def packed_for_decoding(model: torch.nn.Module, rows: int):
    """Within this context and under CPU bf16 autocast, the model's CPULinear layers with
    float32 weights compute without gradients from a bf16 copy of their weight,
    reordered by oneDNN for products with about `rows` rows (see the module docstring).
    The copies are made on entry and dropped on exit: the weights must not change in
    between. Layers whose weights are already bf16 are left alone (a copy would be
    extra memory, not a replacement for autocast's). Does nothing without bf16
    autocast, or where oneDNN cannot do it."""
    dtype = torch.bfloat16
    if (
        not torch.is_autocast_enabled("cpu")
        or torch.get_autocast_dtype("cpu") != dtype
        or not packing_available()
    ):
        yield
        return
    layers = [
        m
        for m in model.modules()
        if isinstance(m, CPULinear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
    ]
    try:
        for m in layers:
            m.packed = (dtype, pack_weight(m.weight, m.bias, dtype, rows))
        yield
    finally:
        for m in layers:
            m.packed = None


def use_cpu_linear(model: torch.nn.Module) -> int:
    """Switch every plain nn.Linear in `model` to CPULinear, in place; returns how many.
    Subclasses (quantized layers) are left alone. peft's LoRA layers are not Linear
    subclasses but hold the original plain nn.Linear as their `base_layer`, and their
    adapters' A and B as plain nn.Linear too: all of these are switched, so an adapted
    model's base products run through oneDNN as they did before the adapter."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CPULinear
            count += 1
    return count
