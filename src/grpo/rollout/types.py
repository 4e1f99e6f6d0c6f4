from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

SEED_BOUND = 2**62
"""Per-prompt sampling seeds are drawn below this (vLLM adds a completion's index to its
request's seed; the hf engine seeds a CPU generator with it)."""

Seeds = Sequence[int] | torch.Generator | None
"""What an engine's `generate` samples with: one seed per prompt, a generator to draw them from,
or None (drawn from torch's global generator)."""


def prompt_seeds(seeds: Seeds, num_prompts: int) -> list[int]:
    """One sampling seed per prompt. A prompt's completions depend on its seed alone, never on
    which other prompts share its batch, so a group sampled on any rank of a data-parallel run,
    or in a batch of any size, comes out the same as in one process."""
    if seeds is None or isinstance(seeds, torch.Generator):
        generator = seeds
        device = generator.device if generator is not None else "cpu"
        return torch.randint(
            0, SEED_BOUND, (num_prompts,), generator=generator, device=device
        ).tolist()
    seeds = [int(s) for s in seeds]
    if len(seeds) != num_prompts:
        raise ValueError(f"{len(seeds)} sampling seeds for {num_prompts} prompts: one per prompt")
    return seeds


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    ignore_eos: bool = False
    """Generate exactly max_new_tokens tokens (benchmarks)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the most likely token's (0: off)."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on every token already in the prompt or the completion: its logit is
    divided by this when positive, multiplied when negative (1: off)."""
    min_new_tokens: int = 0
    """No EOS among the first min_new_tokens tokens (their EOS logits are -inf; 0: off)."""


@dataclass
class Rollout:
    """G completions for each of P prompts, N = P x G rows, group-major
    (rows i*G .. i*G+G-1 belong to prompt i)."""

    prompt_ids: torch.Tensor
    """[N, Lp] left-padded prompt tokens."""
    prompt_mask: torch.Tensor
    """[N, Lp] 1 for real prompt tokens."""
    completion_ids: torch.Tensor
    """[N, T] right-padded completion tokens."""
    completion_mask: torch.Tensor
    """[N, T] 1 for generated tokens up to and including the first EOS."""
    truncated: torch.Tensor
    """[N] bool: True when no EOS came within max_new_tokens."""
    sampling_logprobs: torch.Tensor | None = None
    """[N, T] float32: each completion token's logprob under the distribution the engine sampled
    it from (softmax of logits / temperature, after the repetition penalty and before the
    top-k/top-p/min-p filters), 0 at padding; None when the engine does not report them
    (greedy decoding). The update compares them with its own."""
    tool_mask: torch.Tensor | None = None
    """[N, T] 1 for tokens the engine appended rather than sampled (tool results in a multi-turn
    completion, grpo.rollout.multiturn), which the loss leaves out; None: every token was sampled."""
    messages: list[list[dict]] | None = None
    """[N] with tools: each completion as TRL's messages (assistant turns with their tool_calls,
    then the tool results), what reward functions get for conversational prompts; None otherwise."""

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def to(self, device: torch.device | str) -> "Rollout":
        """The same rollout with its tensors on `device` (no copy of those there already): what
        an engine or a rollout_func assembled on the host reaches the update on the model's."""

        def moved(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device)  # no copy where it is already

        return Rollout(
            moved(self.prompt_ids),
            moved(self.prompt_mask),
            moved(self.completion_ids),
            moved(self.completion_mask),
            moved(self.truncated),
            moved(self.sampling_logprobs),
            moved(self.tool_mask),
            self.messages,
        )

    def select(self, rows: torch.Tensor) -> "Rollout":
        return Rollout(
            self.prompt_ids[rows],
            self.prompt_mask[rows],
            self.completion_ids[rows],
            self.completion_mask[rows],
            self.truncated[rows],
            None if self.sampling_logprobs is None else self.sampling_logprobs[rows],
            None if self.tool_mask is None else self.tool_mask[rows],
            None if self.messages is None else [self.messages[i] for i in rows.tolist()],
        )

    @staticmethod
    def concat(parts: list["Rollout"], pad_token_id: int) -> "Rollout":
        """Stack rollouts whose prompt and completion widths may differ."""
        lp = max(p.prompt_ids.shape[1] for p in parts)
        lc = max(p.completion_ids.shape[1] for p in parts)

        def left(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width - x.shape[1], 0), value=value)

        def right(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

        return Rollout(
            torch.cat([left(p.prompt_ids, lp, pad_token_id) for p in parts]),
            torch.cat([left(p.prompt_mask, lp, 0) for p in parts]),
            torch.cat([right(p.completion_ids, lc, pad_token_id) for p in parts]),
            torch.cat([right(p.completion_mask, lc, 0) for p in parts]),
            torch.cat([p.truncated for p in parts]),
            # kept only when every part has them (an engine reports them for all its rollouts or none)
            torch.cat([right(p.sampling_logprobs, lc, 0) for p in parts])
            if all(p.sampling_logprobs is not None for p in parts)
            else None,
            # kept when any part has one (a part without one sampled every token)
            torch.cat(
                [
                    right(
                        p.tool_mask
                        if p.tool_mask is not None
                        else torch.zeros_like(p.completion_mask),
                        lc,
                        0,
                    )
                    for p in parts
                ]
            )
            if any(p.tool_mask is not None for p in parts)
            else None,
            [m for p in parts for m in p.messages]
            if all(p.messages is not None for p in parts)
            else None,
        )
