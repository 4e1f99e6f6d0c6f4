"""A decoding loop whose every token step has the same shapes, so that one captured CUDA graph
can replay it (grpo.cuda.graphs); run eagerly, it is the same loop on any device (the CPU tests).

The `hf` engine's own loop (grpo.rollout.hf.generate) shrinks the batch as completions finish and
grows the attention mask by one column a step, and it reads the device several times a token
(is any row alive, are all, which rows finished). Here, for N = P x G rows of one rollout:

- every buffer is allocated once per shape: the key/value buffer `FixedKV` of
  [N, kv heads, prompt slots + max_new_tokens, head dim] per layer, the tokens, lengths, flags;
- each prompt is prefilled once, with transformers' own forward and cache exactly as the engine
  prefills it, and its keys and values are copied to its G rows (prefix sharing kept), into the
  last prompt slots (left padding: the slots before a prompt are masked);
- a finished row is masked, not removed: it keeps computing a token a step, which nothing
  records, so the batch, and with it every tensor's shape and address, stays the same;
- the token step samples inside itself, with grpo.rollout.hf's own sampling functions, from
  each completion's precomputed noise (grpo.rollout.hf.prompt_noise), so a group's tokens still
  depend on its prompt's seed alone;
- the host reads the device only every `check_every` steps (`run`): whether any row is alive,
  whether a live row's scores were not finite, and the new tokens when stop strings are set; a
  stop string found there ends its completion at the token where it appeared, as the engine would.

Why the tokens are the engine's: a row's arithmetic never depends on the other rows' values;
the attention of a step covers the same keys (prompt tokens and the tokens generated so far),
the masked slots contributing exp(-inf) = 0 to its softmax; the sampler is the engine's, fed
the same numbers. The attention is summed over more (masked) slots and over a batch that never
shrinks, so on some kernels the logits differ from the engine's in their last bits: greedy
tokens are the same except at a tie (tests/cuda/test_fixed_shape.py measures both).

Supported (`unsupported_reason`): decoder-only models whose attention layers write their keys
and values through the cache's `update` and take a prepared 4D mask (Llama, Qwen2, Qwen3,
Gemma 3), with sdpa or eager attention, a sliding window no shorter than the rollout, and no
attention soft-capping.
"""

from __future__ import annotations

import inspect

import torch

from grpo.models import cache_argument, position_ids_from_mask
from grpo.rollout import (
    NonFiniteProbabilities,
    Rollout,
    SamplingParams,
    StopStrings,
    TransformersSteps,
    completed_rollout,
    left_pad,
    penalise_repetitions,
    prompt_noise,
    prompt_seeds,
    prompt_tokens_seen,
    sample_unchecked,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text")
"""config.model_type of the models whose forward passes this loop was checked against the engine's."""
ATTENTION = ("sdpa", "eager")
"""Attention implementations that read a prepared 4D mask (and that a CUDA graph can capture)."""
CHECK_EVERY = 8
"""Token steps between two reads of the device (stop checks)."""


def unsupported_reason(model, max_length: int) -> str | None:
    """Why the fixed-shape loop cannot decode `model` for rollouts of `max_length` positions
    (prompt + completion), or None."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"architecture {kind!r} (the loop knows {', '.join(ARCHITECTURES)})"
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ATTENTION:
        return (
            f"attention implementation {attention!r} (the loop prepares masks for sdpa and eager)"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or bool(
        getattr(config, "use_sliding_window", False)
    )
    # a window the rollout never reaches past is full attention (transformers' windows count
    # cache slots, padding included, as the engine's dynamic cache holds them)
    if sliding and window is not None and window < max_length:
        return f"a sliding window of {window} positions, shorter than the rollout's {max_length}"
    return None


class FixedKV:
    """Keys and values of every layer in buffers of fixed shape [N, kv heads, slots, head dim],
    as transformers' attention layers call a cache: `update(keys, values, layer)` writes the new
    token's at slot `slot` (a one-element device tensor the loop advances) and returns the whole
    buffers, whose unwritten and padding slots the step's mask hides."""

    is_compileable = True

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slot: torch.Tensor):
        self.keys, self.values, self.slot = keys, values, slot

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.slot, key_states)
        values.index_copy_(2, self.slot, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2]

    def __len__(self) -> int:
        return len(self.keys)


def cached_keys_values(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [rows, kv heads, positions, head dim] of every layer of transformers'
    dynamic cache after a prefill (its `layers` in transformers 5, `key_cache` before)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))


class FixedShapeLoop:
    """The buffers and the token step of one shape: `rows` completions, `prompt_slots` slots for
    the (left-padded) prompts, `params` (its max_new_tokens and sampling settings), decoding
    `model` (a model nothing else changes while the loop holds it: grpo.cuda.weights).

    Per rollout: `start` (the prefill, eager: transformers' forward and cache), then `run` with
    a function that advances one token step: `step` itself (eager) or the replay of a graph
    that captured it, then `finish`. `step` only writes into the buffers, never reads the
    device on the host, and never changes a Python attribute, so replaying it is running it."""

    def __init__(
        self,
        model,
        rows: int,
        prompt_slots: int,
        params: SamplingParams,
        eos_token_ids,
        pad_token_id: int,
        check_every: int = CHECK_EVERY,
    ):
        self.model, self.rows, self.prompt_slots, self.params = model, rows, prompt_slots, params
        self.pad_token_id, self.check_every = pad_token_id, check_every
        device = next(model.parameters()).device
        self.device = device
        T = params.max_new_tokens
        self.slots = prompt_slots + T
        vocab = model.get_output_embeddings().weight.shape[0]
        self.vocab = vocab
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
        self.eos_columns = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.eos_columns[self.eos] = True
        self.slot_index = torch.arange(self.slots, device=device)
        self.cache_argument = cache_argument(model)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.eager_mask = (
            getattr(model.config, "_attn_implementation", None) or "eager"
        ) == "eager"
        # transformers builds an eager mask in the dtype of the embeddings
        self.mask_dtype = model.get_input_embeddings().weight.dtype
        sampled = params.temperature > 0

        def buffer(*shape, dtype=torch.long, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        # the state one token step reads and writes
        self.t = buffer(1)  # the step: the token being sampled
        self.slot = buffer(1)  # the cache slot of the token being fed
        self.input_ids = buffer(rows, 1)
        self.positions = buffer(rows, 1)
        # [rows, vocab] in the model's output dtype, allocated by the first prefill
        self.logits: torch.Tensor | None = None
        self.tokens = buffer(rows, T, fill=pad_token_id)
        self.logprobs = buffer(rows, T, dtype=torch.float32) if sampled else None
        self.noise = buffer(rows, T, 2, dtype=torch.float32) if sampled else None
        self.alive = buffer(rows, dtype=torch.bool, fill=True)
        self.done = buffer(rows, dtype=torch.bool)
        self.lengths = buffer(rows)
        self.first_bad = buffer(rows, fill=T)  # the first step a live row's scores were not finite
        self.seen = (
            buffer(rows, vocab, dtype=torch.bool) if params.repetition_penalty != 1.0 else None
        )
        self.prompt_allowed = buffer(rows, self.slots, dtype=torch.bool)
        self.kv: FixedKV | None = None  # allocated by the first prefill (its heads and dims)

    # -- per rollout ---------------------------------------------------------------------

    def start(
        self, prompts: list[list[int]], num_generations: int, seeds
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill a rollout of `prompts` x `num_generations` (`prefill`), with each completion's
        noise drawn from its prompt's seed as the engine draws it; -> the rows' prompt ids and mask."""
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        full_ids = prompt_ids.repeat_interleave(num_generations, 0)
        full_mask = prompt_mask.repeat_interleave(num_generations, 0)
        noise = None
        if self.params.temperature > 0:
            noise = prompt_noise(
                prompt_seeds(seeds, len(prompts)),
                num_generations,
                self.params.max_new_tokens,
                self.device,
            )
        self.prefill(prompt_ids, prompt_mask, num_generations, full_ids, full_mask, noise)
        return full_ids, full_mask

    def finish(self, full_ids: torch.Tensor, full_mask: torch.Tensor) -> Rollout:
        """The Rollout of the decoded rows (the engine's assembly, from copies of the buffers)."""
        tokens, lengths, done, logprobs = self.rollout_parts()
        return completed_rollout(
            full_ids, full_mask, tokens, lengths, done, logprobs, self.pad_token_id
        )

    @torch.no_grad()
    def prefill(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        num_generations: int,
        full_ids: torch.Tensor,
        full_mask: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> None:
        """Each prompt once through transformers' forward and dynamic cache (what the engine's
        prefix sharing computes), its keys, values and next-token logits copied to its G rows,
        and every per-rollout buffer reset. Eager, and it reads the device: once per rollout."""
        G, Lp = num_generations, prompt_ids.shape[1]
        if Lp > self.prompt_slots or prompt_ids.shape[0] * G != self.rows:
            raise ValueError(
                f"a loop for {self.rows} rows and {self.prompt_slots} prompt slots cannot take "
                f"{prompt_ids.shape[0]} x {G} rows of {Lp} tokens"
            )
        steps = TransformersSteps(self.model)
        logits = steps(prompt_ids, prompt_mask, position_ids_from_mask(prompt_mask))
        start = self.prompt_slots - Lp  # the prompt's slots end where the completion's begin
        layers = cached_keys_values(steps.cache)
        if self.kv is None:
            self.kv = FixedKV(
                [self._kv_buffer(k) for k, _ in layers],
                [self._kv_buffer(v) for _, v in layers],
                self.slot,
            )
        for (k, v), keys, values in zip(layers, self.kv.keys, self.kv.values):
            # every slot the prompt does not fill is zeroed, the completion's too: a masked slot
            # gets probability 0, but a NaN or inf left there by an earlier rollout would still
            # reach the output (0 x NaN), in this shape's every later rollout
            keys[:, :, :start].zero_()
            values[:, :, :start].zero_()
            keys[:, :, self.prompt_slots :].zero_()
            values[:, :, self.prompt_slots :].zero_()
            keys[:, :, start : self.prompt_slots].copy_(k.repeat_interleave(G, 0))
            values[:, :, start : self.prompt_slots].copy_(v.repeat_interleave(G, 0))
        if self.logits is None:
            self.logits = torch.empty(self.rows, self.vocab, dtype=logits.dtype, device=self.device)
        self.logits.copy_(logits.repeat_interleave(G, 0))
        self.prompt_allowed.zero_()
        self.prompt_allowed[:, start : self.prompt_slots] = full_mask.bool()
        self.positions.copy_(full_mask.sum(-1, keepdim=True))
        self.t.zero_()
        self.tokens.fill_(self.pad_token_id)
        self.alive.fill_(True)
        self.done.fill_(False)
        self.lengths.zero_()
        self.first_bad.fill_(self.params.max_new_tokens)
        if self.logprobs is not None:
            self.logprobs.zero_()
            self.noise.copy_(noise)
        if self.seen is not None:
            self.seen.copy_(prompt_tokens_seen(full_ids, full_mask, self.vocab))

    def _kv_buffer(self, like: torch.Tensor) -> torch.Tensor:
        _, heads, _, dim = like.shape
        return torch.zeros(self.rows, heads, self.slots, dim, dtype=like.dtype, device=self.device)

    # -- one token step: what a graph captures -------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Sample token t of every row from the logits at hand, record it for the live rows,
        then feed it: the next logits. Only device work, into the same buffers every step."""
        p, t = self.params, self.t
        logits = self.logits
        if self.seen is not None:
            logits = penalise_repetitions(logits, self.seen, p.repetition_penalty)
        if p.min_new_tokens:  # as the engine: no EOS before min_new_tokens
            logits = logits.masked_fill(self.eos_columns & (t < p.min_new_tokens), float("-inf"))
        uniforms = self.noise.index_select(1, t).squeeze(1) if self.noise is not None else None
        new, new_logprobs, finite = sample_unchecked(logits, p, uniforms=uniforms)
        alive = self.alive
        self.first_bad.copy_(
            torch.where(alive & ~finite, torch.minimum(self.first_bad, t), self.first_bad)
        )
        self.tokens.index_copy_(1, t, torch.where(alive, new, self.pad_token_id).unsqueeze(1))
        if self.logprobs is not None:
            self.logprobs.index_copy_(1, t, torch.where(alive, new_logprobs, 0.0).unsqueeze(1))
        if self.seen is not None:  # a finished row's marks are never read again
            self.seen.scatter_(1, new.unsqueeze(1), True)
        self.lengths.add_(alive.long())
        if not p.ignore_eos:
            finished = alive & (new.unsqueeze(1) == self.eos).any(-1)
            self.done.logical_or_(finished)
            self.alive.logical_and_(~finished)
        # feed token t at slot prompt_slots + t; it sees the prompt and tokens 0..t
        self.input_ids.copy_(new.unsqueeze(1))
        self.slot.copy_(t + self.prompt_slots)
        allowed = self.prompt_allowed | (
            (self.slot_index >= self.prompt_slots) & (self.slot_index <= self.slot)
        )
        self.logits.copy_(self._forward(allowed[:, None, None, :]))
        self.positions.add_(1)
        self.t.add_(1)

    def _forward(self, allowed: torch.Tensor) -> torch.Tensor:
        if (
            self.eager_mask
        ):  # eager attention adds it: 0 where allowed, the dtype's minimum elsewhere
            dtype = self.mask_dtype
            mask = torch.where(
                allowed, torch.zeros((), dtype=dtype, device=self.device), torch.finfo(dtype).min
            )
        else:
            mask = allowed
        kwargs = {self.cache_argument: self.kv}
        if self.takes_cache_position:
            kwargs["cache_position"] = self.slot
        out = self.model(
            input_ids=self.input_ids,
            attention_mask=mask,
            position_ids=self.positions,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return out.logits[:, -1, :]

    # -- the loop ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the state a token step changes (not the keys and values: a step writes
        only its own slot, which the next step over it rewrites)."""
        return {name: t.clone() for name, t in self._state().items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in self._state().items():
            t.copy_(saved[name])

    def _state(self) -> dict[str, torch.Tensor]:
        names = (
            "t",
            "slot",
            "input_ids",
            "positions",
            "logits",
            "tokens",
            "logprobs",
            "alive",
            "done",
            "lengths",
            "first_bad",
            "seen",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def run(self, advance, stop: StopStrings | None, read=None) -> None:
        """Decode the prefilled rollout: `advance()` (one token step) `check_every` times, then
        one read of the device (`read(tensor)` -> a CPU copy; counted by the tests): which rows
        are alive, their lengths, the first step each went non-finite, and with stop strings the
        new tokens, which are searched for them here, on the host."""
        read = read or (lambda x: x.cpu())
        T, p = self.params.max_new_tokens, self.params
        stops = stop is not None and not p.ignore_eos
        host_tokens = torch.full((self.rows, T), self.pad_token_id, dtype=torch.long, device="cpu")
        live = list(range(self.rows))  # rows alive when the chunk began
        t0 = 0
        while t0 < T and live:
            t1 = min(t0 + self.check_every, T)
            for _ in range(t1 - t0):
                advance()
            parts = [self.alive.long()[:, None], self.lengths[:, None], self.first_bad[:, None]]
            if stops:
                parts.append(self.tokens[:, t0:t1])
            status = read(torch.cat(parts, dim=1))
            alive, lengths, first_bad = status[:, 0].bool(), status[:, 1].clone(), status[:, 2]
            ended = (
                self._stop_strings(stop, status, host_tokens, live, lengths, t0, t1)
                if stops
                else {}
            )
            for row, length in ended.items():
                lengths[row], alive[row] = length, False
            if bool((first_bad < lengths).any()):  # a live row's scores were not finite
                raise NonFiniteProbabilities()
            if ended:
                rows = torch.tensor(list(ended), dtype=torch.long, device=self.device)
                self.lengths.index_copy_(
                    0,
                    rows,
                    torch.tensor(list(ended.values()), dtype=torch.long, device=self.device),
                )
                self.done.index_fill_(0, rows, True)
                self.alive.index_fill_(0, rows, False)
            live = alive.nonzero().squeeze(-1).tolist()
            t0 = t1

    @staticmethod
    def _stop_strings(stop, status, host_tokens, live, lengths, t0, t1) -> dict[int, int]:
        """{row: length} of the rows a stop string ends in this chunk, each at the first token of
        the chunk whose text (with the tokens before) contains one, as the engine checks a row
        after every token it samples while it is alive."""
        host_tokens[:, t0:t1] = status[:, 3:]
        ended: dict[int, int] = {}
        for t in range(t0, t1):
            rows = [r for r in live if r not in ended and t < int(lengths[r])]
            if not rows:
                continue
            hit = stop(host_tokens[rows, : t + 1])
            for r, h in zip(rows, hit.tolist()):
                if h:
                    ended[r] = t + 1
        return ended

    def rollout_parts(self):
        """(tokens, lengths, done, logprobs) of the decoded rollout, copies of the buffers."""
        logprobs = self.logprobs.clone() if self.logprobs is not None else None
        return self.tokens.clone(), self.lengths.clone(), self.done.clone(), logprobs


def prompt_slots_for(width: int, bucket: int) -> int:
    """Prompt slots for prompts of `width` tokens: `width` rounded up to a multiple of `bucket`,
    so that rollouts whose longest prompts differ a little share one loop (and one graph)."""
    return -(-max(width, 1) // bucket) * bucket


@torch.no_grad()
def decode_eagerly(
    model,
    prompts: list[list[int]],
    num_generations: int,
    params: SamplingParams,
    *,
    eos_token_ids,
    pad_token_id: int,
    seeds=None,
    stop: StopStrings | None = None,
    bucket: int = 1,
    check_every: int = CHECK_EVERY,
) -> Rollout:
    """One rollout through a fixed-shape loop run eagerly: the CPU-runnable twin of the captured
    loop (grpo.cuda.graphs), with grpo.rollout.hf.generate's arguments and result."""
    width = max((len(p) for p in prompts), default=0)
    loop = FixedShapeLoop(
        model,
        len(prompts) * num_generations,
        prompt_slots_for(width, bucket),
        params,
        eos_token_ids,
        pad_token_id,
        check_every,
    )
    full_ids, full_mask = loop.start(prompts, num_generations, seeds)
    loop.run(loop.step, stop)
    return loop.finish(full_ids, full_mask)
