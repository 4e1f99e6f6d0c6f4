"""Generation with a transformers model and its KV cache.

Two things make this cheaper than `model.generate(num_return_sequences=G)`:

- each prompt is prefilled once and its KV cache is copied to its G
  completions (prefix sharing), instead of prefilling G copies;
- rows that have produced EOS leave the batch (the cache is compacted), so a
  group costs what its actual lengths cost, not G x the longest.

Both are exact: under greedy decoding they give token-for-token the same
completions as the plain path (tests/rollout/test_hf.py).

Each step is the model's own forward pass with transformers' cache (`plain_decoding`),
or whatever decoding steps the backend hands the engine: on the CPU, grpo.cpu's fused
steps, the same computation in fewer, larger operations (tests/cpu/test_fused_decoding.py).
A backend may also hand it a whole loop (grpo.rollout.base.DecodingLoop: on CUDA, grpo.cuda's
fixed-shape loop), which reuses this module's sampling so that it draws the same tokens.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from grpo.models import logprobs
from grpo.models.precision import bf16_autocast, uses_bf16
from grpo.rollout.base import DecodingLoop
from grpo.rollout.types import Rollout, SamplingParams, Seeds, prompt_seeds


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as (ids, mask) [n, longest] on the host, padded on the left (each prompt's
    last token in the last column, where decoding continues)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(sequences), width), dtype=torch.long, device="cpu")
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long, device="cpu")
            mask[i, width - len(seq) :] = 1
    return ids, mask


_NON_FINITE = (
    "the model's next-token probabilities are NaN or inf, so no token can be sampled: its weights or "
    "activations are not finite. In training this means the updates diverged (lower training.learning_rate, "
    "keep training.max_grad_norm > 0); for a loaded model, its weights hold NaN or inf (load another checkpoint)"
)


class NonFiniteProbabilities(ValueError):
    """The model's next-token scores hold NaN or inf: its weights (or activations) are not finite.
    Raised with no argument, its message says what that means and what to do."""

    def __init__(self, message: str = _NON_FINITE):
        super().__init__(message)


# Vocabulary entries per block of the two-level inverse-CDF sampler.
CDF_BLOCK = 1024


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pick one token per row from next-token logits [B, V] -> [B]."""
    return sample_with_logprobs(logits, params, generator)[0]


def sample_with_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row from next-token logits [B, V]: (tokens [B], their logprobs [B]).
    The draw uses `uniforms` [B, 2] in [0, 1) when given (`sample_from`), else numbers from `generator`.

    The logprob is the token's under softmax(logits / temperature), before top-k, top-p and
    min-p, which is what the update computes (grpo.models.logprobs), so the two can be compared
    for the rollout correction. None for greedy decoding (evaluation), which nothing compares.
    A repetition penalty is applied to `logits` by the caller (`penalise_repetitions`), so the
    logprob is then the penalised distribution's, which the update does not apply: the
    mismatch metrics show the penalty, and a rollout correction weighs it out.
    Raises NonFiniteProbabilities when a row's scores are not finite (`sample_unchecked`
    is the same draw without that check).
    """
    tokens, logprobs, finite = sample_unchecked(logits, params, generator, uniforms)
    if not bool(finite.all()):
        raise NonFiniteProbabilities(_NON_FINITE)
    return tokens, logprobs


def sample_unchecked(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`sample_with_logprobs`'s draw, the same tokens and logprobs, with no check that reads the
    device: (tokens [B], logprobs [B] or None, finite [B] bool: whether the row's scores could be
    sampled at all). Nothing in it waits for the device, so it can run inside a captured
    decoding step (grpo.cuda) whose caller looks at `finite` when it reads the device anyway. A
    row that is not finite gets some token in range, never one past the vocabulary."""
    if params.temperature == 0:
        best, index = logits.max(dim=-1)
        return index, None, ~torch.isnan(best)  # max and argmax pick a NaN when a row has one
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    filtered = (
        bool(params.top_k and params.top_k < scores.shape[-1])
        or params.top_p < 1.0
        or params.min_p > 0.0
    )
    if not filtered:
        probs = torch.softmax(scores, dim=-1)
        tokens, finite = sample_from_unchecked(probs, generator, uniforms)
        # the probabilities at hand are the unfiltered ones: no second pass over the vocabulary
        return tokens, torch.log(probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)), finite
    log_total = torch.logsumexp(scores, dim=-1)
    # filters copies: `scores` stays whole
    tokens, finite = _sample_filtered(scores, params, generator, uniforms)
    return tokens, scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_total, finite


def _sample_filtered(
    scores: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row from temperature-scaled scores [B, V] under top-k, top-p and min-p,
    applied in that order (transformers' and vLLM's order), and whether each row was finite."""
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    if params.min_p > 0.0:
        # the most likely token always stays: its probability is the row's maximum
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return sample_from_unchecked(probs, generator, uniforms)


def penalise_repetitions(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, transformers' and vLLM's form): the logit of
    every token already present (`seen` [B, V] bool: in the prompt or generated) is divided by
    `penalty` when positive and multiplied by it otherwise, so penalty > 1 makes a repeat less
    likely. Example: penalty 2, seen logits [3, -1] -> [1.5, -2]; unseen ones are unchanged."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def sample_from(
    weights: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """One index per row of `weights` [B, V] (non-negative, each row with a positive sum),
    drawn with probability proportional to its weight, from two uniform numbers per row:
    `uniforms` [B, 2] when given, else drawn from `generator`.

    Inverse-CDF sampling in two levels: a block of CDF_BLOCK entries by the
    blocks' totals, then an entry of that block by its weights, each with its
    own uniform number. That is one reduction over the vocabulary instead of a
    cumulative sum over it (a sequential scan) or torch.multinomial, which draws a
    random number per vocabulary entry (measured: docs/performance.md). A zero-weight entry is
    never drawn. Raises NonFiniteProbabilities for a row whose weights do not sum to a
    positive finite number (`sample_from_unchecked` is the same draw without that check).
    """
    index, finite = sample_from_unchecked(weights, generator, uniforms)
    if not bool(finite.all()):
        raise NonFiniteProbabilities(_NON_FINITE)
    return index


def sample_from_unchecked(
    weights: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_from`'s draw with no check that reads the device: (index [B], finite [B] bool,
    whether the row's weights sum to a positive finite number). The index of a row that is not
    finite is some entry in range (its CDF cannot be searched), never one past the end."""
    B, V = weights.shape
    block = min(CDF_BLOCK, V)
    whole = V // block * block
    totals = weights[:, :whole].reshape(B, -1, block).sum(-1)
    if whole < V:
        totals = torch.cat([totals, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    block_cdf = totals.cumsum(-1)
    # one NaN or inf weight makes its row's total non-finite; searching such a CDF gives an index out of range
    total = block_cdf[:, -1]
    finite = torch.isfinite(total) & (total > 0)
    u = (
        uniforms
        if uniforms is not None
        else torch.rand(B, 2, generator=generator, device=weights.device)
    )
    b = first_exceeding(block_cdf, u[:, :1])
    # [B, block]: the chosen block's entries
    index = b * block + torch.arange(block, device=weights.device)
    inside = index < V
    local_cdf = (weights.gather(1, index.clamp(max=V - 1)) * inside).cumsum(-1)
    drawn = (b * block + first_exceeding(local_cdf, u[:, 1:])).squeeze(-1)
    return drawn.clamp(max=V - 1), finite


def first_exceeding(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, 1] index of the first entry of each row of `cdf` [B, n] (non-decreasing) strictly
    above u x its last entry, for u [B, 1] in [0, 1): always an entry where the CDF steps up,
    i.e. one with positive weight. The target is also capped just below the total, so
    the index stays in range even if u x total were rounded up to it."""
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)


def prompt_noise(
    seeds: list[int], num_generations: int, max_new_tokens: int, device
) -> torch.Tensor:
    """[P x G, max_new_tokens, 2]: the uniform numbers each completion's tokens are drawn with
    (`sample_from`), from its prompt's seed alone. Drawn up front on the CPU: 2 numbers a token,
    a few kilobytes a rollout, and the same on any device."""
    parts = [
        torch.rand(
            num_generations,
            max_new_tokens,
            2,
            generator=torch.Generator().manual_seed(s),
            device="cpu",
        )
        for s in seeds
    ]
    return (
        torch.cat(parts).to(device) if parts else torch.zeros(0, max_new_tokens, 2, device=device)
    )


class TransformersSteps:
    """The model's own forward pass and transformers' KV cache, as grpo.rollout.base.DecodingSteps:
    `steps(input_ids, attention_mask, position_ids)` -> last-position logits [R, V]."""

    def __init__(self, model):
        self.model, self.cache, self.cache_argument = model, None, logprobs.cache_argument(model)

    def __call__(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: self.cache},
        )
        self.cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits[:, -1, :]

    @property
    def can_edit_batch(self) -> bool:
        """Whether the cache can repeat and drop rows: every layer of transformers' caches can,
        but the recurrent state of hybrid models' linear-attention layers (NemotronH,
        Qwen3-Next, ...) has neither operation."""
        layers = getattr(self.cache, "layers", [])
        return all(
            hasattr(layer, "batch_repeat_interleave") and hasattr(layer, "batch_select_indices")
            for layer in layers
        )

    def reset(self) -> None:
        self.cache = None

    def repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)


class StopStrings:
    """Ends a completion once its text contains one of `strings` (e.g. "\\n\\n" for
    few-shot prompts, where a base model would go on to invent the next example).
    Only the last `window` tokens are decoded at each step."""

    def __init__(self, tokenizer, strings: list[str], window: int = 8):
        self.tokenizer, self.strings = tokenizer, [s for s in strings if s]
        longest = max((len(s) for s in self.strings), default=1)
        self.window = max(window, longest + 2)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n, t] generated so far -> [n] bool."""
        tails = self.tokenizer.batch_decode(
            tokens[:, -self.window :].tolist(), skip_special_tokens=True
        )
        return torch.tensor(
            [any(s in tail for s in self.strings) for tail in tails], device=tokens.device
        )


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    num_generations: int,
    params: SamplingParams,
    *,
    eos_token_ids: list[int] | tuple[int, ...],
    pad_token_id: int,
    seeds: Seeds = None,
    share_prefix: bool = True,
    compact: bool = True,
    stop: StopStrings | None = None,
    decoding=None,
) -> Rollout:
    """Sample `num_generations` completions for each tokenised prompt.

    prompts: P lists of token ids. Returns a Rollout with N = P x G rows,
    group-major. `seeds`: one per prompt (or a generator to draw them from,
    grpo.rollout.types.prompt_seeds); a prompt's G completions depend on its seed
    and not on the batch around it. `share_prefix` and `compact` only change the cost.
    `decoding(model, rows, max_length)`: a context that yields the decoding steps
    (grpo.rollout.base.DecodingSteps) of one rollout; None: `plain_decoding`.
    """
    rows = len(prompts) * num_generations
    max_length = max((len(p) for p in prompts), default=0) + params.max_new_tokens
    with (decoding or plain_decoding)(model, rows, max_length) as steps:
        return _generate(
            steps,
            model,
            prompts,
            num_generations,
            params,
            eos_token_ids,
            pad_token_id,
            seeds,
            share_prefix,
            compact,
            stop,
        )


@contextlib.contextmanager
def plain_decoding(model, rows: int, max_length: int):
    """transformers' modules and cache (TransformersSteps), whatever the rows and length."""
    yield TransformersSteps(model)


def _generate(
    steps,
    model,
    prompts,
    num_generations,
    params,
    eos_token_ids,
    pad_token_id,
    seeds,
    share_prefix,
    compact,
    stop,
) -> Rollout:
    device = next(model.parameters()).device
    G = num_generations
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    full_ids = prompt_ids.repeat_interleave(G, 0)
    full_mask = prompt_mask.repeat_interleave(G, 0)
    N, Lp = full_ids.shape
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device, dtype=torch.long)

    # skip left padding, as in the loss pass
    positions = logprobs.position_ids_from_mask(prompt_mask)
    logits = None
    if share_prefix:
        logits = steps(prompt_ids, prompt_mask, positions)
        editable = getattr(steps, "can_edit_batch", True)
        if editable:
            steps.repeat_interleave(G)
            logits = logits.repeat_interleave(G, 0)
        else:
            # a cache whose rows cannot be repeated: prefill every row, and never compact
            steps.reset()
            logits, compact = None, False
    if logits is None:
        logits = steps(full_ids, full_mask, positions.repeat_interleave(G, 0))

    noise = (
        prompt_noise(prompt_seeds(seeds, len(prompts)), G, params.max_new_tokens, device)
        if params.temperature > 0
        else None
    )
    tokens = torch.full((N, params.max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    token_logprobs = (
        torch.zeros(N, params.max_new_tokens, device=device) if params.temperature > 0 else None
    )
    done = torch.zeros(N, dtype=torch.bool, device=device)
    lengths = torch.zeros(N, dtype=torch.long, device=device)
    # the tokens each row holds so far, prompt included (its padding excluded), for the penalty
    seen = (
        prompt_tokens_seen(full_ids, full_mask, logits.shape[-1])
        if params.repetition_penalty != 1.0
        else None
    )
    active = torch.arange(N, device=device)  # batch row of each cache row
    alive = torch.ones(N, dtype=torch.bool, device=device)  # cache rows still generating
    attn = full_mask.clone()  # [cache rows, Lp + t]
    next_pos = full_mask.sum(-1)  # position id of each cache row's next token

    for t in range(params.max_new_tokens):
        if seen is not None:
            logits = penalise_repetitions(logits, seen[active], params.repetition_penalty)
        if t < params.min_new_tokens:  # as transformers' min_new_tokens: no EOS yet
            logits = logits.index_fill(-1, eos, float("-inf"))
        new, new_logprobs = sample_with_logprobs(
            logits, params, uniforms=noise[active, t] if noise is not None else None
        )
        rows = active[alive]
        tokens[rows, t] = new[alive]
        if seen is not None:
            seen[rows, new[alive]] = True
        if token_logprobs is not None:
            token_logprobs[rows, t] = new_logprobs[alive]
        lengths[rows] += 1
        if not params.ignore_eos:
            finished = alive & torch.isin(new, eos)
            if stop is not None:
                live = alive.nonzero().squeeze(-1)
                finished[live] |= stop(tokens[active[live], : t + 1])
            done[active[finished]] = True
            alive = alive & ~finished
        if t == params.max_new_tokens - 1 or not bool(alive.any()):
            break
        if compact and not bool(alive.all()) and getattr(steps, "can_edit_batch", True):
            keep = alive.nonzero().squeeze(-1)
            steps.select(keep)
            active, new, attn, next_pos, alive = (
                active[keep],
                new[keep],
                attn[keep],
                next_pos[keep],
                alive[keep],
            )
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        logits = steps(new.unsqueeze(-1), attn, next_pos.unsqueeze(-1))
        next_pos = next_pos + 1

    return completed_rollout(
        full_ids, full_mask, tokens, lengths, done, token_logprobs, pad_token_id
    )


def prompt_tokens_seen(full_ids: torch.Tensor, full_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] bool: the tokens each row's prompt holds (its padding excluded), where the
    repetition penalty (`penalise_repetitions`) starts from."""
    seen = torch.zeros(full_ids.shape[0], vocab, dtype=torch.bool, device=full_ids.device)
    row, column = full_mask.nonzero(as_tuple=True)
    seen[row, full_ids[row, column]] = True
    return seen


def completed_rollout(
    full_ids: torch.Tensor,
    full_mask: torch.Tensor,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    done: torch.Tensor,
    token_logprobs: torch.Tensor | None,
    pad_token_id: int,
) -> Rollout:
    """The Rollout of a finished decoding loop: `tokens` [N, max_new_tokens] sampled (anything
    past a row's length is ignored), `lengths` [N] of each completion, `done` [N] (ended by EOS or
    a stop string: not truncated), `token_logprobs` [N, max_new_tokens] or None (greedy); the
    completions cut to the longest, padded with `pad_token_id`."""
    N = tokens.shape[0]
    width = int(lengths.max().item()) if N else 0
    tokens = tokens[:, :width]
    steps = torch.arange(width, device=tokens.device).unsqueeze(0)
    completion_mask = (steps < lengths.unsqueeze(1)).long()
    tokens = tokens.masked_fill(completion_mask == 0, pad_token_id)
    if token_logprobs is not None:
        token_logprobs = token_logprobs[:, :width] * completion_mask
    return Rollout(
        prompt_ids=full_ids,
        prompt_mask=full_mask,
        completion_ids=tokens,
        completion_mask=completion_mask,
        truncated=~done,
        sampling_logprobs=token_logprobs,
    )


def generate_with(
    generate_fn,
    prompts: list[list[int]],
    num_generations: int,
    params: SamplingParams,
    *,
    eos_token_ids,
    pad_token_id: int,
    seeds: Seeds = None,
    stop: StopStrings | None = None,
    device=None,
) -> Rollout:
    """Sampling with a `generate` that replaced the model's own on the model object (a wrapper
    around generation, or a stand-in such as TRL's tests write): one call with each prompt
    repeated `num_generations` times, left-padded, and transformers' generation arguments,
    returning the prompts followed by the completions. A completion ends at its first EOS (or
    stop string), within params.max_new_tokens; one without is truncated. The call draws from
    torch's generator seeded with the first prompt's seed, so a completion here depends on the
    whole call, not on its prompt's seed alone; no sampling logprobs are reported."""
    seeds = prompt_seeds(seeds, len(prompts))
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    ids, mask = left_pad(rows, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    sampled = params.temperature > 0
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=params.max_new_tokens,
        do_sample=sampled,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_ids),
    )
    if params.min_new_tokens:
        kwargs["min_new_tokens"] = params.min_new_tokens
    if sampled:
        kwargs.update(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p or None,
            repetition_penalty=params.repetition_penalty,
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeds[0] if seeds else 0)
        out = generate_fn(**kwargs)
    out = getattr(out, "sequences", out)
    tails = out[:, ids.shape[1] :][:, : params.max_new_tokens].cpu().tolist()
    eos = set(eos_token_ids)
    completions, truncated = [], []
    for tail in tails:
        end = next((t + 1 for t, token in enumerate(tail) if token in eos), None)
        if stop is not None:
            cut = next(
                (
                    t + 1
                    for t in range(end or len(tail))
                    if bool(stop(torch.tensor([tail[: t + 1]], device="cpu"))[0])
                ),
                None,
            )
            end = cut if cut is not None else end
        finished = end is not None and not params.ignore_eos
        completions.append(tail[:end] if finished else tail)
        truncated.append(not finished)
    width = max((len(c) for c in completions), default=0)
    tokens = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device="cpu")
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")
    for i, c in enumerate(completions):
        tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long, device="cpu")
        completion_mask[i, : len(c)] = 1
    return Rollout(
        prompt_ids=ids,
        prompt_mask=mask,
        completion_ids=tokens.to(ids.device),
        completion_mask=completion_mask.to(ids.device),
        truncated=torch.tensor(truncated, device=ids.device),
    )


class TransformersEngine:
    """The `hf` rollout engine: generation with the policy module itself (no copy), with
    prefix sharing and compaction, in the compute precision of training.bf16.

    `decoding`: what the backend's device layer hands it (grpo.backends): decoding steps for
    its own loop (on the CPU, grpo.cpu.layer.CPULayer.decoding), or a whole loop
    (grpo.rollout.base.DecodingLoop: on CUDA, grpo.cuda's); None: its own loop with
    transformers' modules (`plain_decoding`). A model whose `generate` was replaced on the
    object itself is sampled with that (`generate_with`).
    Because it decodes from the policy's own parameters (any decoding steps read them,
    or pack their copies, at the start of each rollout), an optimizer step needs no
    weight transfer: `sync_weights` has nothing to do, and neither have `sleep`/`wake`
    (every cache lives only for one `generate`).
    """

    def __init__(self, model, tokenizer, cfg, decoding=None):
        from grpo.models.loading import generation_token_ids

        self.model = model
        self.eos_token_ids, self.pad_token_id = generation_token_ids(model, tokenizer)
        r = cfg.rollout
        self.stop = StopStrings(tokenizer, r.stop_strings) if r.stop_strings else None
        self.bf16 = uses_bf16(cfg.training.bf16, self.device)
        self.decoding = decoding or plain_decoding

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts, num_generations, params, seeds: Seeds = None) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), bf16_autocast(self.device, self.bf16):
                replaced = vars(self.model).get("generate")
                if callable(replaced):  # generate_with: the replacement samples
                    sampler = functools.partial(generate_with, replaced, device=self.device)
                elif isinstance(self.decoding, DecodingLoop):
                    sampler = functools.partial(self.decoding.generate, self.model)
                else:
                    sampler = functools.partial(generate, self.model, decoding=self.decoding)
                return sampler(
                    prompts,
                    num_generations,
                    params,
                    eos_token_ids=self.eos_token_ids,
                    pad_token_id=self.pad_token_id,
                    seeds=seeds,
                    stop=self.stop,
                )
        finally:
            self.model.train(was_training)

    def sync_weights(self, policy) -> None:
        if policy is not self.model:
            raise ValueError(
                "the hf engine generates with the policy module it was built with; build a new engine for another"
            )

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass
