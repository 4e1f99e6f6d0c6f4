"""Decoding steps for Gemma 3 and Llama-family models in fewer, larger operations.

A decoding step through transformers' modules runs some 60 operations per
layer on tensors of one token per row: separate query, key and value
products, RMS norms of seven element-wise operations each, a key/value cache
that grows by concatenation, mask and cache bookkeeping. On the CPU each
operation costs microseconds of overhead whatever its size, which for a
small model is most of the step. `FusedDecoder` computes the same steps from
the same weights with one product for query/key/value and one for gate/up
(oneDNN-packed bf16 copies of the weights, as `grpo.cpu.kernels` makes for
decoding), `F.rms_norm`, and a cache allocated once per rollout and written
in place. It reuses the model's own embedding, rotary-embedding and
activation modules, and mirrors where transformers rounds to bf16 under
autocast, so its logits equal transformers' to rounding (tests compare every
step, and greedy completions, for Llama, Qwen2, Qwen3 and Gemma 3 with a
sliding window). Measured: docs/performance.md.

In float32 it decodes from the layers' own weights, without copies: a product
per layer through oneDNN (grpo.cpu.kernels; torch would send these to MKL), the
output layer computed transposed (`kernels.tall_linear_nt`).

The transformers engine uses it for CPU rollouts where it applies
(`cpu.decoding: auto` and `fused_decoding_applies`: bf16, or float32
without a LoRA adapter); every other case (CUDA, other architectures, a float32
LoRA run, `cpu.decoding: plain`) decodes through transformers' modules.

With a LoRA adapter (grpo.models.lora) the decoder packs each adapted layer's merged
weight, W + scale * B @ A, computed when it is built (at the start of each
rollout, when the packed copies are made anyway) from the layer's current
adapter; the model itself is left untouched, and decoding costs what it costs
without an adapter. (In float32 nothing is packed, so the merged weights would
be extra copies of the model: `auto` decodes such a run through transformers'
modules, and `cpu.decoding: fused` is the user's choice of speed over that
memory.)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# the same in the four architectures
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from grpo.cpu import kernels
from grpo.cpu.attention import grouped_attention
from grpo.models import adapter_sublayers, merged_linear, plain_lora_linear, sharded_by_fsdp

# config.model_type -> RMS-norm style: Gemma scales by (1 + w) and rounds after;
# the Llama family rounds to the input dtype, then scales by w
NORM_STYLES = {"gemma3_text": "gemma", "llama": "llama", "qwen2": "llama", "qwen3": "llama"}


def unsupported_reason(model) -> str | None:
    """Why `model` cannot use FusedDecoder, or None."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in NORM_STYLES:
        return f"architecture {kind!r}"
    if sharded_by_fsdp(model):  # its weights are whole only inside FSDP's gathers
        return "parameters sharded by FSDP"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout in training mode"
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "unexpected module layout"
    for layer in body.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        # a LoRA layer computes its merged weight when it is plain LoRA (no DoRA or other variant)
        if (
            attn is None
            or mlp is None
            or not all(plain_lora_linear(getattr(attn, n, None)) for n in names)
        ):
            return "unexpected module layout (or a LoRA variant)"
        if not all(
            plain_lora_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return "unexpected MLP layout (or a LoRA variant)"
        if attn.o_proj.bias is not None or any(
            getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")
        ):
            return "output or MLP biases"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return "unexpected output layer"
    return None


def fused_decoding_applies(model, compute_dtype: torch.dtype) -> bool:
    """FusedDecoder is the faster path for decoding `model` in `compute_dtype`: a supported
    architecture on the CPU with float32 weights switched to grpo's CPU kernels, and either
    bf16, where oneDNN can pack weights (see grpo.cpu.kernels), or float32 through oneDNN
    without a LoRA adapter (its merged weights would be copies of the whole model, which
    transformers' modules decode without)."""
    if unsupported_reason(model) is not None:
        return False
    adapters = adapter_sublayers(model)  # merged into their layer's weight, never used alone
    if compute_dtype == torch.bfloat16:
        if not kernels.packing_available():
            return False
    elif compute_dtype != torch.float32 or adapters or not kernels.onednn_available():
        return False
    return all(
        isinstance(m, kernels.CPULinear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.float32
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and id(m) not in adapters
    )


class _Product:
    """x @ W.T (+ b) of layers that read the same input, their outputs side by side, from
    fixed weights: one oneDNN-packed bf16 copy of the layers' stacked weights (grpo.cpu.kernels;
    the fast path, under bf16 autocast), or the layers' own weights in their dtype, one
    product each (float32 decoding: no copy; oneDNN for float32 on the CPU, and the output
    layer (`tall`) computed transposed, grpo.cpu.kernels.tall_linear_nt).
    A LoRA layer contributes its merged weight W + scale * B @ A (grpo.models.merged_linear)."""

    def __init__(self, layers: list, dtype: torch.dtype, rows: int, pack: bool, tall: bool = False):
        self.dtype, self.tall = dtype, tall
        merged = [merged_linear(m) for m in layers]
        if pack:
            self.pieces = kernels.pack_weight(*_stacked(merged), dtype, rows)
            self.parts = None
        else:
            self.pieces = None
            self.parts = [(w.to(dtype), b.to(dtype) if b is not None else None) for w, b in merged]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.pieces is not None:
            return kernels.packed_product(x, self.pieces)
        outs = [self._one(x, w, b) for w, b in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _one(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if bias is not None:
            return kernels.linear(x, weight, bias)
        return kernels.tall_linear_nt(x, weight) if self.tall else kernels.linear_nt(x, weight)


def _stacked(merged: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) pairs of layers that read the same input, stacked: one product for all
    (one layer's own weight as it is: packing copies it a piece at a time)."""
    if len(merged) == 1:
        return merged[0]
    weight = torch.cat([w for w, _ in merged])
    if all(b is None for _, b in merged):
        return weight, None
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in merged])
    return weight, bias


class _Norm:
    """transformers' RMS norm of one module, as one F.rms_norm call plus its dtype rounding."""

    def __init__(self, module: torch.nn.Module, style: str):
        self.style = style
        self.eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
        w = module.weight.detach().float()
        self.weight = 1.0 + w if style == "gemma" else w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.style == "gemma":  # (norm(x) * (1 + w)) in float32, then back to x's dtype
            return F.rms_norm(x.float(), shape, self.weight, self.eps).to(x.dtype)
        if x.dtype == torch.float32:  # w * norm(x)
            return F.rms_norm(x, shape, self.weight, self.eps)
        # w * round(norm(x))
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


@dataclass
class _Layer:
    qkv: _Product
    o: _Product
    gate_up: _Product
    down: _Product
    input_norm: _Norm
    post_attention_norm: _Norm
    pre_mlp_norm: _Norm | None  # Gemma's sandwich norms; None for the Llama family
    post_mlp_norm: _Norm | None
    q_norm: _Norm | None
    k_norm: _Norm | None
    act: torch.nn.Module
    scaling: float
    layer_type: str
    window: int | None
    index: int  # of its cache tensors


class FusedDecoder:
    """The model's forward pass for decoding, with its own key/value cache.

    Call it like the model with a cache: `decoder(input_ids [R, Lq], attention_mask
    [R, cached + Lq], position_ids [R, Lq])` -> next-token logits [R, V] at the last
    query. The first call fills the cache (prefill, causal), later ones append;
    `repeat_interleave(G)` and `select(rows)` reshape the cache's batch like
    transformers' cache methods. `max_length` bounds cached + new tokens.

    `pack`: bf16 products from oneDNN-packed weights (the fast path, under bf16
    autocast); False computes in the weights' dtype from the weights themselves
    (float32 decoding, and the tests' checks of the math). The packed weights are
    copies made with the decoder: the model's weights must not change while it is
    in use.
    """

    def __init__(self, model, rows: int, max_length: int, pack: bool = True):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"FusedDecoder does not support this model ({reason}); decode through transformers instead"
            )
        config = model.config
        style = NORM_STYLES[config.model_type]
        self.body = getattr(model, model.base_model_prefix)
        self.dtype = torch.bfloat16 if pack else model.get_output_embeddings().weight.dtype
        self.max_length = max_length
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self._rope_takes_layer_type = (
            "layer_type" in inspect.signature(self.body.rotary_emb.forward).parameters
        )
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(
            self.body.layers
        )

        def product(*layers):
            return _Product(list(layers), self.dtype, rows, pack)

        with torch.no_grad():
            self.layers = []
            for layer, layer_type in zip(self.body.layers, layer_types):
                a, m = layer.self_attn, layer.mlp
                sandwich = style == "gemma"  # norms after attention and MLP too
                self.layers.append(
                    _Layer(
                        qkv=product(a.q_proj, a.k_proj, a.v_proj),
                        o=product(a.o_proj),
                        gate_up=product(m.gate_proj, m.up_proj),
                        down=product(m.down_proj),
                        input_norm=_Norm(layer.input_layernorm, style),
                        post_attention_norm=_Norm(layer.post_attention_layernorm, style),
                        pre_mlp_norm=_Norm(layer.pre_feedforward_layernorm, style)
                        if sandwich
                        else None,
                        post_mlp_norm=_Norm(layer.post_feedforward_layernorm, style)
                        if sandwich
                        else None,
                        q_norm=_Norm(a.q_norm, style) if hasattr(a, "q_norm") else None,
                        k_norm=_Norm(a.k_norm, style) if hasattr(a, "k_norm") else None,
                        act=m.act_fn,
                        scaling=float(a.scaling),
                        layer_type=layer_type,
                        window=getattr(
                            a, "sliding_window", None
                        ),  # what transformers' attention is given
                        index=len(self.layers),
                    )
                )
            self.final_norm = _Norm(self.body.norm, style)
            head = model.get_output_embeddings()
            self.head = _Product([head], self.dtype, rows, pack, tall=True)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0  # cache slots filled (the same for every row)

    # -- cache layout, as transformers' Cache methods --------------------------------

    def repeat_interleave(self, repeats: int) -> None:
        self.keys = [k.repeat_interleave(repeats, 0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, 0) for v in self.values]

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]

    # -- the forward pass ---------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        R, Lq = input_ids.shape
        start, end = self.length, self.length + Lq
        if end > self.max_length:
            raise ValueError(f"FusedDecoder cache holds {self.max_length} tokens, asked for {end}")
        if attention_mask.shape != (R, end):
            raise ValueError(
                f"attention_mask must be [rows, cached + new] = {(R, end)}, got {tuple(attention_mask.shape)}"
            )
        if not self.keys:
            shape = (R, self.kv_heads, self.max_length, self.head_dim)
            device = input_ids.device
            self.keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]
            self.values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in self.layers]
        # autocast off: every cast below is explicit, where transformers' modules round under autocast
        with torch.autocast(input_ids.device.type, enabled=False):
            h = self.body.embed_tokens(input_ids)
            rope = {}
            masks = {}
            for layer in self.layers:
                if layer.layer_type not in rope:
                    args = (layer.layer_type,) if self._rope_takes_layer_type else ()
                    rope[layer.layer_type] = self.body.rotary_emb(h, position_ids, *args)
                if layer.window not in masks:
                    masks[layer.window] = self._mask(attention_mask, start, Lq, layer.window)
                h = self._layer(layer, h, rope[layer.layer_type], masks[layer.window], start, end)
            self.length = end
            logits = self.head(self.final_norm(h[:, -1]))
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _mask(
        self, attention_mask: torch.Tensor, start: int, Lq: int, window: int | None
    ) -> torch.Tensor | None:
        """Boolean [R, 1, Lq, cached + Lq]: real (unpadded) keys at or before each query's
        slot, within the sliding window if any; None when that is every key."""
        end = start + Lq
        if Lq == 1 and (window is None or end <= window) and bool(attention_mask.all()):
            return None
        device = attention_mask.device
        q_slot = torch.arange(start, end, device=device)[:, None]
        k_slot = torch.arange(end, device=device)[None, :]
        allowed = k_slot <= q_slot
        if window is not None:
            allowed = allowed & (k_slot > q_slot - window)
        allowed = attention_mask.bool()[:, None, None, :] & allowed
        # a padding query has no real key to see; letting it see itself keeps its
        # (never used) output finite, so no NaN reaches the values other rows read
        return allowed | (k_slot == q_slot)

    def _layer(self, layer: _Layer, h, rope, mask, start: int, end: int) -> torch.Tensor:
        R, Lq, _ = h.shape
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        residual = h
        qkv = layer.qkv(layer.input_norm(h))
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(R, Lq, Hq, D), k.view(R, Lq, Hkv, D), v.view(R, Lq, Hkv, D)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        # transformers' rotary embedding on float32 copies (what its bf16 x float32 products compute)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=2)
        cached_keys, cached_values = self.keys[layer.index], self.values[layer.index]
        cached_keys[:, :, start:end] = k.transpose(1, 2)
        cached_values[:, :, start:end] = v.transpose(1, 2)
        keys, values = cached_keys[:, :, :end], cached_values[:, :, :end]
        out = grouped_attention(q.to(self.dtype).transpose(1, 2), keys, values, mask, layer.scaling)
        out = layer.o(out.view(R, Lq, Hq * D))
        if layer.pre_mlp_norm is not None:  # Gemma: norm after attention, then the residual
            h = residual + layer.post_attention_norm(out)
            x = layer.pre_mlp_norm(h)
        else:  # Llama family: the residual, then the norm before the MLP
            h = residual + out
            x = layer.post_attention_norm(h)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        y = layer.down(layer.act(gate) * up)
        if layer.post_mlp_norm is not None:
            y = layer.post_mlp_norm(y)
        return h + y
