"""Grouped-query attention on the CPU without copying keys and values per query head.

Models such as Gemma 3 and Qwen2.5 share each key/value head among several
query heads. transformers' `sdpa` attention then either copies every
key/value head once per query head (`repeat_kv`, when the batch has an
attention mask and more than one query token: the loss pass) or asks torch to
broadcast them (`enable_gqa`, without a mask), which on the CPU runs torch's
flash kernel once per query head: for a single decoded token that is mostly
overhead. Here the query heads that share a key/value head are laid out as
more queries of that head, [batch, key/value heads, group x queries, head
dim], with the mask repeated to match, so attention is one product per
key/value head and nothing is copied. The results are the same (tests);
measured: docs/performance.md.

transformers already folds single-token queries this way when the batch has a
mask; equal-length prompts (the benchmark, the demo) have none.

`use_grouped_attention(model)` switches a model that uses `sdpa` to it. It
registers under its own name with transformers' attention and mask
interfaces (the mask is sdpa's), so other models in the process are not
affected, and everything else (CUDA, no grouping, several queries without a
mask, dropout, soft-capping, per-head masks) goes to transformers' own sdpa
function unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "grpo_sdpa"


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers' attention-function signature; returns ([batch, queries, heads, head dim], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    if (
        groups == 1
        or query.device.type != "cpu"
        # causal without a mask: torch's is_causal path
        or (q_length > 1 and attention_mask is None)
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
        or (attention_mask is not None and attention_mask.shape[1] != 1)  # a mask per head
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return grouped_attention(query, key, value, attention_mask, scaling), None


def grouped_attention(query, key, value, mask, scale) -> torch.Tensor:
    """Attention of query [B, H, Lq, D] over key/value [B, Hkv, Lk, D] (H a multiple of Hkv)
    with a boolean or additive mask [B, 1, Lq, Lk] (or None), the query heads of a
    key/value head laid out as more of its queries; returns [B, Lq, H, D], contiguous."""
    batch, heads, q_length, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # query head h uses key/value head h // groups: consecutive heads form a group, and
    # their queries follow one another ([groups, queries] within a key/value head)
    grouped = query.reshape(batch, kv_heads, groups * q_length, head_dim)
    if mask is not None and q_length > 1:  # each head of a group sees its queries' mask rows
        mask = (
            mask[:, :, None]
            .expand(-1, -1, groups, -1, -1)
            .reshape(mask.shape[0], 1, groups * q_length, -1)
        )
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    out = out.reshape(batch, heads, q_length, value.shape[-1])
    return out.transpose(1, 2).contiguous()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_sdpa_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Switch `model` from transformers' sdpa attention to grouped_sdpa_attention, in place.
    Returns whether it did (models with another attention implementation are left alone)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True
