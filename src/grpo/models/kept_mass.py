"""The probability mass that top-k / top-p / min-p sampling keeps, per completion token, under a
policy: what puts logprobs an engine reports over the kept tokens only back on the whole
vocabulary, where the trainer takes its own.

vLLM, asked for `processed_logprobs` while it filters, reports each sampled token's logprob
under the filtered distribution, renormalised over the tokens the filters kept:

    processed(x) = log p(x) - log M,      M = the sum of p over the kept tokens (x among them)

with p = softmax(logits / temperature). The trainer's logprob is log p(x) over the whole
vocabulary, so their difference carries log M, which is not a change of policy (it is what
TRL 1.17 corrects). `processed + log M`, with M under the policy the update starts from, makes
the importance ratio exp(old - processed - log M) the ratio of the two filtered distributions,
the trainer's and the sampler's, both renormalised over their kept tokens: what the rollout
correction and the rollout/logprob_diff metrics compare.

The filters are applied as vLLM's sampler applies them: the temperature, then min_p (tokens
whose probability is at least min_p times the most likely one's), then top_k (the k largest
logits, ties kept), then top_p over what is left, renormalised (each token whose more likely
tokens' mass is below top_p). The sampled token always counts as kept: the sampler kept it,
and the trainer's rounding may put it a hair outside.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

ROW_ELEMENTS = 1 << 24
"""Logits computed at once (rows x vocabulary): 64 MiB in float32, whatever the vocabulary."""


class Filters(Protocol):
    """The sampling settings the filters read (grpo.rollout.SamplingParams has them): top_k 0,
    top_p 1 and min_p 0 filter nothing."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


def kept_logmass_of_logits(
    logits: torch.Tensor, tokens: torch.Tensor, filters: Filters
) -> torch.Tensor:
    """log M for each row of `logits` [n, V] (float32 or wider), whose sampled token is
    `tokens` [n]: the log of the probability mass the filters keep (<= 0)."""
    logp = torch.log_softmax(logits.float() / filters.temperature, dim=-1)
    keep = torch.ones_like(logp, dtype=torch.bool)
    if filters.min_p > 0.0:
        keep &= logp >= math.log(filters.min_p) + logp.max(dim=-1, keepdim=True).values
    if 0 < filters.top_k < logp.shape[-1]:
        kth = logp.topk(filters.top_k, dim=-1).values[:, -1:]
        keep &= logp >= kth
    if filters.top_p < 1.0:
        left = torch.softmax(logp.masked_fill(~keep, -math.inf), dim=-1)
        ordered, order = left.sort(dim=-1, descending=True)
        above = ordered.cumsum(dim=-1) - ordered  # the mass of the more likely tokens
        keep &= torch.zeros_like(keep).scatter(-1, order, above < filters.top_p)
    rows = torch.arange(len(tokens), device=tokens.device)
    keep[rows, tokens] = True
    return torch.logsumexp(logp.masked_fill(~keep, -math.inf), dim=-1)


def kept_logmass(
    hidden: torch.Tensor,
    output_layer: torch.nn.Module,
    tokens: torch.Tensor,
    filters: Filters,
    softcap: float | None = None,
) -> torch.Tensor:
    """log M [n] for final hidden states `hidden` [n, H] predicting `tokens` [n], through the
    output layer (and the model's final logit soft-capping, as Gemma's), a bounded number of
    rows at a time."""
    vocab = output_layer.weight.shape[0]
    step = max(1, ROW_ELEMENTS // vocab)
    out = []
    for start in range(0, hidden.shape[0], step):
        logits = output_layer(hidden[start : start + step]).float()
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        out.append(kept_logmass_of_logits(logits, tokens[start : start + step], filters))
    if not out:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)
