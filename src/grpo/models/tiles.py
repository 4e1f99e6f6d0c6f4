"""The element-wise work over one tile of the output layer's logits: the definition, and
the same math in place (what runs unless a backend hands in faster kernels).

grpo.models.logprobs computes log-probabilities one tile of logits at a time: a
product of a chunk of hidden states with a block of the output weight, then
element-wise work over that product (the log-sum-exp and entropy sums in the
forward pass, the softmax gradient in the backward pass); before the products
each block of the weight is cast to the compute dtype, after them each block's
weight gradient is added into the float32 gradient.

`forward_tile` and `backward_tile` are the definition, written as plain functions
of tensors (grpo.cpu.tile_math compiles these very functions); `EAGER` is the same
math written in place into reused buffers (tests/cpu/test_tile_math.py checks the two
against each other).

Conventions (one tile: rows r of a token chunk, columns c of a vocabulary block):
    product [r, c]    hidden @ weight_block.T in the compute dtype (bf16 or float32)
    z       [r, c]    float32 logits: (softcap * tanh((product + bias) / softcap)) / temperature
    column  [r]       the column of the row's target token in this block, -1 when it lies elsewhere
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def product_nt(a: torch.Tensor, b: torch.Tensor, out) -> torch.Tensor:
    """a @ b.T written into `out()` (a buffer of the pass, made on first call)."""
    return torch.matmul(a, b.t(), out=out())


def _logits(product, bias, softcap, temperature):
    """float32 logits of the tile, and tanh(u / softcap) when soft-capping (else None). `softcap`
    and `temperature` may be 0-d tensors (so that compiled kernels take them as inputs rather
    than compiling once per value); dividing by a temperature of 1 is exact."""
    z = product.float()
    if bias is not None:
        z = z + bias
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(z / softcap)
        z = tanh * softcap
    return z / temperature, tanh


def forward_tile(product, bias, column, m, S, U, target_z, softcap, temperature):
    """The running statistics of the online log-sum-exp, updated with one tile.

    m: running max of z; S = sum exp(z - m); U = sum exp(z - m) (z - m); target_z: the
    target's logit, starting at 0 (a row whose target lies in this block adds it here). Returns the
    updated (m, S, U, target_z). m starts at -inf and S = U = 0, where the rescaling
    factor exp(m_old - m_new) is 0 and its shift term is dropped (nan_to_num)."""
    z, _ = _logits(product, bias, softcap, temperature)
    m_new = torch.maximum(m, z.amax(-1))
    zs = z - m_new[:, None]
    e = torch.exp(zs)
    shift = m - m_new
    c = torch.exp(shift)
    S_new = c * S + e.sum(-1)
    U_new = c * (U + torch.nan_to_num(shift) * S) + (e * zs).sum(-1)
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == column[:, None]
    target_new = target_z + torch.where(hit, z, 0.0).sum(-1)
    return m_new, S_new, U_new, target_new


def backward_tile(
    product,
    bias,
    column,
    lse,
    grad,
    softcap,
    temperature,
    out_dtype: torch.dtype,
    with_bias: bool,
    column_major: bool = False,
):
    """d loss / d product of one tile in `out_dtype` (the dtype of the products that follow), and
    with `with_bias` its float32 column sums (the bias gradient), else None. With `column_major`
    the gradient [r, c] is laid out column by column (a transposed view of a contiguous [c, r]).

    d logp / d z = onehot(target) - softmax(z), the softmax from the saved lse, times the
    incoming gradient of each row's logp; then through the temperature and the softcap."""
    z, tanh = _logits(product, bias, softcap, temperature)
    p = torch.exp(z - lse[:, None])
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == column[:, None]
    gz = grad[:, None] * (hit.to(torch.float32) - p) / temperature
    if softcap is not None:
        gz = gz * (1.0 - tanh * tanh)
    sums = gz.sum(0) if with_bias else None
    gz = gz.to(out_dtype)
    return (gz.t().contiguous().t() if column_major else gz), sums


def backward_tile_with_entropy(
    product,
    bias,
    column,
    lse,
    entropy,
    grad,
    grad_entropy,
    softcap,
    temperature,
    out_dtype: torch.dtype,
    with_bias: bool,
):
    """`backward_tile` when the entropy H = -sum p log p is differentiated too (the entropy
    bonus): d H / d z_v = -p_v (log p_v + H), added to the log-prob's gradient, each times its
    row's incoming gradient. Plain tensor math (a pass with the bonus is not the one the
    in-place kernels are tuned for); returns (gradient in `out_dtype`, column sums or None)."""
    z, tanh = _logits(product, bias, softcap, temperature)
    log_p = z - lse[:, None]
    p = torch.exp(log_p)
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == column[:, None]
    gz = grad[:, None] * (hit.to(torch.float32) - p)
    gz = gz - grad_entropy[:, None] * p * (log_p + entropy[:, None])
    gz = gz / temperature
    if softcap is not None:
        gz = gz * (1.0 - tanh * tanh)
    sums = gz.sum(0) if with_bias else None
    return gz.to(out_dtype), sums


# -- eager: the same math in place, into the pass's buffers ---------------------------------
# Run op by op, the functions above would allocate a tile-sized temporary per operation (with
# first-touch page faults on the CPU), which costs as much again as the work; these write into
# `buffers` (grpo.models.logprobs.TileBuffers: get(name, shape, dtype), cast(name, x, dtype)) and
# modify the product. tests/cpu/test_tile_math.py checks both against each other.


def _logits_in_place(product, bias, softcap, temperature, buffers):
    # product itself when it is float32 (then modified)
    z = buffers.cast("z", product, torch.float32)
    if bias is not None:
        z += bias
    tanh = None
    if softcap:
        tanh = torch.tanh(z / softcap)
        z = tanh * softcap
    if temperature != 1.0:
        z /= temperature
    return z, tanh


def _forward_in_place(product, bias, column, m, S, U, target_z, softcap, temperature, buffers):
    z, _ = _logits_in_place(product, bias, softcap, temperature, buffers)
    rows = (column >= 0).nonzero().squeeze(1)
    target_z = target_z.clone()
    target_z[rows] += z[rows, column[rows]]
    m_new = torch.maximum(m, z.amax(-1))
    z -= m_new[:, None]
    e = torch.exp(z, out=buffers.get("e", tuple(z.shape), torch.float32))
    shift = m - m_new
    c = shift.exp()
    block_S = e.sum(-1)
    block_U = e.mul_(z).sum(-1)  # in place: a batched dot product is 2x slower
    return m_new, c * S + block_S, c * (U + torch.nan_to_num(shift) * S) + block_U, target_z


def _backward_in_place(
    product, bias, column, lse, grad, softcap, temperature, out_dtype, with_bias, buffers
):
    z, tanh = _logits_in_place(product, bias, softcap, temperature, buffers)
    gz = z.sub_(lse[:, None]).exp_().mul_(-grad[:, None])
    rows = (column >= 0).nonzero().squeeze(1)
    gz[rows, column[rows]] += grad[rows]
    if temperature != 1.0:
        gz /= temperature
    if softcap:
        gz.mul_(1.0 - tanh * tanh)
    sums = gz.sum(0) if with_bias else None
    return buffers.cast("low", gz, out_dtype), sums  # the product in "low" is no longer needed


def cast_into(out, x):
    """out[...] = x in out's dtype (the weight block's cast to the compute dtype)."""
    out.copy_(x)


def accumulate(acc, part):
    """acc += part, part in another dtype (a bf16 weight-gradient block into the float32 gradient)."""
    acc.add_(part)


EAGER = SimpleNamespace(
    forward=_forward_in_place,
    backward=_backward_in_place,
    cast_into=cast_into,
    accumulate=accumulate,
)
