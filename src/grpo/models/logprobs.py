"""Per-token log-probabilities (and entropy) of completion tokens.

The output layer is most of a small model's FLOPs and memory: Gemma-3-270M
has a 262,144-token vocabulary, so batch x tokens x vocabulary logits would be
gigabytes. Here the logits exist only one tile (a chunk of completion tokens
x a block of the vocabulary) at a time, in the forward pass and again in the
backward pass (recomputed rather than stored), and only at completion
positions. The result equals the plain
`log_softmax(model(...).logits)` computation to float tolerance, gradients
included (tests/models/test_logprobs.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from grpo.models import tiles


@dataclass(frozen=True)
class OutputLayerKernels:
    """How the tiled output layer does its work. The defaults are plain PyTorch and correct
    everywhere; a backend hands in faster ones for its device (grpo.backends: on the CPU,
    grpo.cpu's compiled tile math, oneDNN products and cache-sized tiles)."""

    tile: SimpleNamespace = field(default_factory=lambda: tiles.EAGER)
    """The element-wise math of a tile (grpo.models.tiles.EAGER's interface)."""
    product: Callable = tiles.product_nt
    """`product(a, b, out)` -> a @ b.T, written into the buffer `out()` or returned as a new tensor."""
    tile_elements: int = 1 << 26
    """Logit elements per (token chunk x vocabulary block) tile."""
    weight_grad_in_place: bool = False
    """In a pass with gradients, the backward adds the output weight's gradient into the weight's
    existing `.grad`, tile by tile, and autograd receives none for it. This saves a vocabulary x
    hidden buffer per backward and, for a weight tied to the input embedding, the out-of-place sum
    autograd makes of the two gradients of one tensor. Only for a caller that owns the backward and
    keeps `.grad` allocated (the trainer's backend): `torch.autograd.grad` would not see this part."""


PLAIN = OutputLayerKernels()

TILE_DEFINITION = SimpleNamespace(
    forward_tile=tiles.forward_tile,
    backward_tile=tiles.backward_tile,
    cast_into=tiles.cast_into,
    accumulate=tiles.accumulate,
)
"""The element-wise work of a tile written as plain functions of tensors (grpo.models.tiles): what
a device layer compiles into its own `OutputLayerKernels.tile` (grpo.cpu.tile_math), which must
compute the same as `tiles.EAGER`, the default."""


def vocab_block_size(rows: int, hidden: int, vocab: int, tile_elements: int) -> int:
    """Vocabulary entries per tile for `rows` tokens: within the tile budget both for the
    logits (rows x block) and for the block's weight gradient (block x hidden), at least 256."""
    return min(vocab, max(256, tile_elements // max(rows, hidden, 1)))


class TileBuffers:
    """Flat buffers that every tile of one pass writes into, by name.

    A new tensor per tile costs allocator work and first-touch page faults comparable to
    the tile's own element-wise work; the first tile is the largest, so each buffer is
    allocated once per pass (measured: docs/performance.md).
    """

    def __init__(self, device: torch.device, kernels: OutputLayerKernels = PLAIN):
        self.device, self.flat, self.tile, self.kernels = device, {}, kernels.tile, kernels

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape)
        buf = self.flat.get(name)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self.flat[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[:size].view(shape)

    def cast(self, name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in `dtype` (x itself when it already is)."""
        if x.dtype == dtype:
            return x
        out = self.get(name, tuple(x.shape), dtype)
        self.tile.cast_into(out, x)
        return out

    def product(self, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b.T, into buffer `name` unless the kernels' product returns its own tensor."""
        return self.kernels.product(a, b, lambda: self.get(name, (a.shape[0], b.shape[0]), a.dtype))


def _tiles(n: int, hidden: int, vocab: int, chunk_size: int, block: int | None, tile_elements: int):
    """(token slice, vocabulary slice) pairs covering n x vocab, vocabulary innermost."""
    for t0 in range(0, n, chunk_size):
        t1 = min(t0 + chunk_size, n)
        width = block or vocab_block_size(t1 - t0, hidden, vocab, tile_elements)
        for v0 in range(0, vocab, width):
            yield slice(t0, t1), slice(v0, min(v0 + width, vocab))


def _target_columns(targets: torch.Tensor, vs: slice) -> torch.Tensor:
    """Each row's target as a column of the vocabulary slice, -1 where it lies outside it."""
    inside = (targets >= vs.start) & (targets < vs.stop)
    return torch.where(inside, targets - vs.start, -1)


class _TiledTokenLogprobs(torch.autograd.Function):
    """log p(target) and entropy for rows of hidden states, one tile of logits at a time.

    hidden [n, H], weight [V, H], bias [V] or None, targets [n] -> logp [n], entropy [n].
    The logits exist one (token chunk x vocabulary block) tile at a time; the
    log-sum-exp is accumulated across vocabulary blocks online (running max), and
    the backward recomputes each tile. Each vocabulary block's weight gradient
    is one product over all the chunk's tokens, written into its rows of the
    gradient. The entropy is differentiable too (the entropy bonus): when a
    loss uses it, the backward adds its gradient (`tiles.backward_tile_with_entropy`);
    when none does (logging, the entropy mask), autograd hands the backward no
    gradient for it and the backward is the log-prob's alone.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        softcap,
        chunk_size,
        block,
        compute_dtype,
        weight_grad_sink,
        kernels,
    ):
        n, V = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        # running max m, S = sum exp(z - m), U = sum exp(z - m) (z - m), per token
        m = torch.full((n,), float("-inf"), device=dev)
        S = torch.zeros(n, device=dev)
        U = torch.zeros(n, device=dev)
        target_z = torch.zeros(n, device=dev)
        tile = kernels.tile
        buffers = TileBuffers(dev, kernels)
        with torch.autocast(dev.type, enabled=False):
            b = bias.float() if bias is not None else None
            h_all = hidden.to(compute_dtype)
            for ts, vs in _tiles(n, hidden.shape[1], V, chunk_size, block, kernels.tile_elements):
                # the weight is cast one block at a time (no vocabulary-sized copy in bf16)
                w = buffers.cast("w", weight[vs], compute_dtype)
                product = buffers.product("low", h_all[ts], w)
                m[ts], S[ts], U[ts], target_z[ts] = tile.forward(
                    product,
                    b[vs] if b is not None else None,
                    _target_columns(targets[ts], vs),
                    m[ts],
                    S[ts],
                    U[ts],
                    target_z[ts],
                    softcap,
                    temperature,
                    buffers,
                )
        lse = m + S.log()
        logp = target_z - lse
        # entropy = lse - sum p z = log S - U / S
        entropy = S.log() - U / S
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.settings = (temperature, softcap, chunk_size, block, compute_dtype, kernels)
        ctx.weight_grad_sink = weight_grad_sink
        # an output no loss uses arrives in the backward as None (not as zeros to multiply)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        temperature, softcap, chunk_size, block, compute_dtype, kernels = ctx.settings
        need_h, need_w, need_b = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            ctx.needs_input_grad[2],
        )
        sink = ctx.weight_grad_sink
        n, V = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        if sink is not None:
            grad_w = sink  # accumulate into the caller's buffer, tile by tile
        elif need_w:
            # every row of the weight gradient is written by exactly one vocabulary block
            # per token chunk: the first chunk assigns, later ones add
            grad_w = torch.empty(weight.shape, dtype=torch.float32, device=dev)
        else:
            grad_w = None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=dev) if need_b else None
        g_all = grad_logp.float()
        tile = kernels.tile
        buffers = TileBuffers(dev, kernels)
        with torch.autocast(dev.type, enabled=False):
            b = bias.float() if bias is not None else None
            h_all = hidden.to(compute_dtype)
            for ts, vs in _tiles(n, hidden.shape[1], V, chunk_size, block, kernels.tile_elements):
                h = h_all[ts]
                w = buffers.cast("w", weight[vs], compute_dtype)
                product = buffers.product("low", h, w)
                if grad_entropy is None:
                    gz, column_sums = tile.backward(
                        product,
                        b[vs] if b is not None else None,
                        _target_columns(targets[ts], vs),
                        lse[ts],
                        g_all[ts],
                        softcap,
                        temperature,
                        compute_dtype,
                        need_b,
                        buffers,
                    )
                else:
                    gz, column_sums = tiles.backward_tile_with_entropy(
                        product,
                        b[vs] if b is not None else None,
                        _target_columns(targets[ts], vs),
                        lse[ts],
                        entropy[ts],
                        g_all[ts],
                        grad_entropy[ts].float(),
                        softcap,
                        temperature,
                        compute_dtype,
                        need_b,
                    )
                if need_b:
                    grad_b[vs] += column_sums
                if need_h:
                    grad_h[ts] += buffers.product("grad_h", gz, w.t())
                if grad_w is not None:
                    part = buffers.product("grad_w", gz.t(), h.t())
                    if ts.start == 0 and sink is None:
                        grad_w[vs] = part
                    else:
                        tile.accumulate(grad_w[vs], part)
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w and sink is None else None,
            grad_b.to(bias.dtype) if need_b else None,
            *([None] * 8),  # targets and the settings
        )


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    output_layer: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int = 4096,
    vocab_block: int | None = None,
    kernels: OutputLayerKernels = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [n] of `targets` and entropy [n] from final hidden states [n, H].

    `chunk_size` tokens and `vocab_block` vocabulary entries per tile (None: sized to
    `kernels.tile_elements`). `kernels`: how the tiles are computed (OutputLayerKernels);
    every choice gives the same values to float tolerance."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, output_layer.weight.dtype)
    weight = output_layer.weight
    # (without an allocated .grad, autograd's own gradient: the same values)
    in_place = kernels.weight_grad_in_place and torch.is_grad_enabled() and weight.requires_grad
    sink = weight.grad if in_place else None
    return _TiledTokenLogprobs.apply(
        hidden,
        weight,
        output_layer.bias,
        targets,
        float(temperature),
        softcap,
        int(chunk_size),
        vocab_block,
        compute_dtype,
        sink,
        kernels,
    )


def _decoder(model) -> torch.nn.Module:
    """The transformer body of a *ForCausalLM model (everything but the output layer)."""
    body = getattr(model, model.base_model_prefix, None)
    if body is None or body is model:
        raise TypeError(
            f"cannot find the decoder of {type(model).__name__}; expected attribute {model.base_model_prefix!r}"
        )
    return body


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, the same as used during generation."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def completion_hidden_states(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts: bool = True
) -> torch.Tensor:
    """Final hidden states at the positions that predict each completion token, [N, T, H].

    With `share_prompts`, each distinct prompt in the batch goes through the
    model once and its keys/values are reused by all its completions (a group
    of G completions shares one prompt), exactly as in generation. Gradients
    flow through the shared prompt pass, so the result and its gradient equal
    the plain computation; the cost of the prompt part drops by G.
    """
    body = _decoder(model)
    T = completion_ids.shape[1]
    unique, inverse = torch.unique(
        torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True
    )
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    # checkpointed layers run without a cache, so they take the plain path
    checkpointing = bool(getattr(model, flag, False)) and model.training
    if not share_prompts or unique.shape[0] == prompt_ids.shape[0] or checkpointing:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        hidden = body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        ).last_hidden_state
        Lp = prompt_ids.shape[1]
        # the hidden state at position j predicts token j + 1
        return hidden[:, Lp - 1 : Lp + T - 1]
    Lp = prompt_ids.shape[1]
    u_ids, u_mask = unique[:, :Lp], unique[:, Lp:]
    out = body(
        input_ids=u_ids,
        attention_mask=u_mask,
        position_ids=position_ids_from_mask(u_mask),
        use_cache=True,
    )
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    cache.batch_select_indices(inverse)
    last_prompt_hidden = out.last_hidden_state[:, -1][inverse]
    if T == 1:
        return last_prompt_hidden[:, None]
    positions = prompt_mask.sum(-1, keepdim=True) + torch.arange(T - 1, device=prompt_mask.device)
    out = body(
        input_ids=completion_ids[:, : T - 1],
        attention_mask=torch.cat([prompt_mask, completion_mask[:, : T - 1]], dim=1),
        position_ids=positions,
        use_cache=True,
        **{cache_argument(body): cache},
    )
    return torch.cat([last_prompt_hidden[:, None], out.last_hidden_state], dim=1)


def cache_argument(model) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache`; accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    vocab_block: int | None = None,
    share_prompts: bool = True,
    kernels: OutputLayerKernels = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(o_t | q, o_<t) and entropy for every completion token.

    prompt_ids/mask [N, Lp] (left-padded), completion_ids/mask [N, T]
    (right-padded) -> logp [N, T], entropy [N, T], zero where the mask is 0.
    Logits are divided by the sampling temperature, as TRL does, so that the
    ratio compares the distribution the tokens were drawn from.

    A model sharded with FSDP2 carries this computation as its own method
    (`FSDP_METHOD`, registered as a forward method by grpo.backends.distributed), so that
    FSDP gathers the parameters it reads outside the decoder layers' forward passes
    (embedding, final norm, output weight) and reduces their gradients.
    """
    # FSDP: the model's registered method; else the computation itself, with the model
    compute = getattr(model, FSDP_METHOD, None) or functools.partial(_completion_logprobs, model)
    return compute(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        share_prompts=share_prompts,
        kernels=kernels,
    )


FSDP_METHOD = "grpo_completion_logprobs"


def sharded_by_fsdp(model) -> bool:
    """Whether FSDP shards `model`'s parameters (grpo.backends.distributed registered its logprobs
    as `FSDP_METHOD`): its weights are whole only inside FSDP's gathers, so nothing may read them
    outside a forward pass or keep copies of them."""
    return getattr(model, FSDP_METHOD, None) is not None


def _completion_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    *,
    temperature,
    chunk_size,
    vocab_block,
    share_prompts,
    kernels,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = completion_hidden_states(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts
    )
    keep = completion_mask.bool()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    logp_flat, entropy_flat = token_logprobs_from_hidden(
        hidden[keep],
        model.get_output_embeddings(),
        completion_ids[keep],
        temperature=temperature,
        softcap=softcap,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        kernels=kernels,
    )
    logp = torch.zeros(completion_ids.shape, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros(completion_ids.shape, dtype=torch.float32, device=hidden.device)
    logp = logp.masked_scatter(keep, logp_flat)
    entropy = entropy.masked_scatter(keep, entropy_flat)
    return logp, entropy


def reference_logprobs(
    model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0
) -> torch.Tensor:
    """Plain full-logits computation: the definition the chunked path must match (tests, small models)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits
    Lp, T = prompt_ids.shape[1], completion_ids.shape[1]
    logits = logits[:, Lp - 1 : Lp + T - 1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp * completion_mask
