"""Per-token log-probabilities (and entropy) of completion tokens.

The output layer is most of a small model's FLOPs and memory: Gemma-3-270M
has a 262,144-token vocabulary, so batch x tokens x vocabulary logits would be
gigabytes. Here the logits exist only one chunk of completion tokens at a
time, in the forward pass and again in the backward pass (recomputed rather
than stored), and only at completion positions. The result equals the plain
`log_softmax(model(...).logits)` computation to float tolerance, gradients
included (tests/test_logprobs.py).
"""

from __future__ import annotations

import torch


def _logits(h: torch.Tensor, weight: torch.Tensor, bias, softcap, temperature) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tempered float32 logits of one chunk, and tanh(u / softcap) when soft-capping
    (the backward needs it). `weight` and `h` are already in the compute dtype."""
    z = (h @ weight.t()).float()
    if bias is not None:
        z += bias
    tanh = None
    if softcap:
        tanh = torch.tanh(z / softcap)
        z = tanh * softcap
    if temperature != 1.0:
        z /= temperature
    return z, tanh


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log p(target) and entropy for rows of hidden states, chunk by chunk.

    hidden [n, H], weight [V, H], bias [V] or None, targets [n] -> logp [n], entropy [n].
    Entropy is returned for logging and carries no gradient. The [chunk, V]
    logits are the only large temporaries; ops are in place where possible
    because on CPU each pass over them costs as much as a small matmul.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, chunk_size, compute_dtype):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.float() if bias is not None else None
            for start in range(0, n, chunk_size):
                end = min(start + chunk_size, n)
                z, _ = _logits(hidden[start:end].to(compute_dtype), w, b, softcap, temperature)
                chunk_lse = torch.logsumexp(z, dim=-1)
                lse[start:end] = chunk_lse
                logp[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - chunk_lse
                # H = lse - sum_v p_v z_v
                p = torch.sub(z, chunk_lse[:, None]).exp_()
                entropy[start:end] = chunk_lse - p.mul_(z).sum(-1)
        # the cast weight is kept for the backward rather than cast again (it is vocabulary-sized)
        ctx.save_for_backward(hidden, weight, w, bias, targets, lse)
        ctx.settings = (temperature, softcap, chunk_size, compute_dtype)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, w, bias, targets, lse = ctx.saved_tensors
        temperature, softcap, chunk_size, compute_dtype = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # float32 [V, H]; allocated by the first chunk's product, not zero-filled
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            b = bias.float() if bias is not None else None
            for start in range(0, hidden.shape[0], chunk_size):
                end = min(start + chunk_size, hidden.shape[0])
                h = hidden[start:end].to(compute_dtype)
                z, tanh = _logits(h, w, b, softcap, temperature)
                g = grad_logp[start:end].float()
                # d logp / dz = onehot(target) - softmax(z), softmax from the saved lse
                gz = z.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])
                gz.scatter_add_(-1, targets[start:end, None], g[:, None])
                if temperature != 1.0:
                    gz /= temperature
                if softcap:
                    gz.mul_(1.0 - tanh * tanh)
                if need_b:
                    grad_b += gz.sum(0)
                gz = gz.to(compute_dtype)
                if need_h:
                    grad_h[start:end] = (gz @ w).to(hidden.dtype)
                if need_w:
                    if grad_w is None:
                        grad_w = (gz.t() @ h).float()
                    elif compute_dtype == torch.float32:
                        grad_w.addmm_(gz.t(), h)  # in place: no second vocabulary-sized buffer
                    else:
                        grad_w += gz.t() @ h
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    output_layer: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [n] of `targets` and entropy [n] from final hidden states [n, H]."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, output_layer.weight.dtype)
    return _ChunkedTokenLogprobs.apply(
        hidden, output_layer.weight, output_layer.bias, targets, float(temperature), softcap, int(chunk_size), compute_dtype
    )


def _decoder(model) -> torch.nn.Module:
    """The transformer body of a *ForCausalLM model (everything but the output layer)."""
    body = getattr(model, model.base_model_prefix, None)
    if body is None or body is model:
        raise TypeError(f"cannot find the decoder of {type(model).__name__}; expected attribute {model.base_model_prefix!r}")
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
    unique, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    # checkpointed layers run without a cache, so they take the plain path
    checkpointing = bool(getattr(model, flag, False)) and model.training
    if not share_prompts or unique.shape[0] == prompt_ids.shape[0] or checkpointing:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
        ).last_hidden_state
        Lp = prompt_ids.shape[1]
        # the hidden state at position j predicts token j + 1
        return hidden[:, Lp - 1 : Lp + T - 1]
    Lp = prompt_ids.shape[1]
    u_ids, u_mask = unique[:, :Lp], unique[:, Lp:]
    out = body(input_ids=u_ids, attention_mask=u_mask, position_ids=position_ids_from_mask(u_mask), use_cache=True)
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
    chunk_size: int = 128,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(o_t | q, o_<t) and entropy for every completion token.

    prompt_ids/mask [N, Lp] (left-padded), completion_ids/mask [N, T]
    (right-padded) -> logp [N, T], entropy [N, T], zero where the mask is 0.
    Logits are divided by the sampling temperature, as TRL does, so that the
    ratio compares the distribution the tokens were drawn from.
    """
    hidden = completion_hidden_states(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)
    keep = completion_mask.bool()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    logp_flat, entropy_flat = token_logprobs_from_hidden(
        hidden[keep],
        model.get_output_embeddings(),
        completion_ids[keep],
        temperature=temperature,
        softcap=softcap,
        chunk_size=chunk_size,
    )
    logp = torch.zeros(completion_ids.shape, dtype=torch.float32, device=hidden.device)
    entropy = torch.zeros(completion_ids.shape, dtype=torch.float32, device=hidden.device)
    logp = logp.masked_scatter(keep, logp_flat)
    entropy = entropy.masked_scatter(keep, entropy_flat)
    return logp, entropy


def reference_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0) -> torch.Tensor:
    """Plain full-logits computation: the definition the chunked path must match (tests, small models)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits
    Lp, T = prompt_ids.shape[1], completion_ids.shape[1]
    logits = logits[:, Lp - 1 : Lp + T - 1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    return logp * completion_mask
