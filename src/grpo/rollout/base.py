"""The rollout engine interface: what the trainer and the evaluation generate with.

An engine turns tokenised prompts into a `Rollout` (G completions each, token
ids, masks, truncated flags), and is told when the policy's weights change.
Engines are named in grpo.registry.ROLLOUT_ENGINES (`rollout.engine`) and
imported only when chosen, so one that needs vLLM costs nothing otherwise; a
new engine is one module with one class.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from grpo.rollout.types import Rollout, SamplingParams, Seeds


class RolloutEngine(Protocol):
    """What the trainer and the evaluation generate with (see the module's docstring)."""

    eos_token_ids: list[int]
    pad_token_id: int
    device: torch.device
    """Where it generates."""

    def generate(
        self,
        prompts: list[list[int]],
        num_generations: int,
        params: SamplingParams,
        seeds: Seeds = None,
    ) -> Rollout:
        """`num_generations` completions of each prompt (token ids), group-major. `seeds`: one
        sampling seed per prompt, or a torch.Generator to draw them from
        (grpo.rollout.types.prompt_seeds); a prompt's completions depend on its seed only."""

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """The policy changed (an optimizer step, a restore): generate from its new weights."""

    def sleep(self) -> None:
        """Free what generation holds (caches, weight copies) while the update runs."""

    def wake(self) -> None:
        """Undo `sleep` before the next generate."""


class DecodingSteps(Protocol):
    """One way of running the model's forward pass while decoding, inside the `hf` engine's own
    loop (grpo.rollout.hf.TransformersSteps: transformers' modules and cache; a device layer may
    hand the engine others, grpo.cpu's fused steps). A backend hands them over as
    `decoding(model, rows, max_length)`, a context that yields them for one rollout."""

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """input_ids [R, Lq] after everything cached so far -> next-token logits [R, V]."""

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat every cached row `repeats` times (a prompt's cache for its G completions)."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the cached rows `rows` (finished completions leave the batch)."""


@runtime_checkable
class DecodingLoop(Protocol):
    """A whole decoding loop that a backend's device layer hands the `hf` engine in place of the
    engine's own (grpo.cuda's fixed-shape loop, replayed as CUDA graphs): the arguments and the
    Rollout of grpo.rollout.hf.generate, the same tokens under the same seeds. It may decode some
    rollouts with grpo.rollout.hf.generate itself (a model or a setting it does not cover). The
    engine calls it inside its no-grad, eval-mode, compute-precision context."""

    def generate(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        num_generations: int,
        params: SamplingParams,
        *,
        eos_token_ids,
        pad_token_id: int,
        seeds: Seeds = None,
        stop=None,
    ) -> Rollout:
        """`num_generations` completions of each prompt, as grpo.rollout.hf.generate."""


def preflight(cfg) -> None:
    """What the configured engine checks before the policy is loaded (an engine class's optional
    `preflight(cfg)`: the `server` engine's server answers), so that a run that cannot generate
    fails in seconds, not after the model loads."""
    from grpo.registry import ROLLOUT_ENGINES

    check = getattr(ROLLOUT_ENGINES.get(cfg.rollout.engine), "preflight", None)
    if check is not None:
        check(cfg)


def create_engine(name: str, model, tokenizer, cfg, decoding=None) -> RolloutEngine:
    """The engine registered as `name` (rollout.engine), built for `model`. `decoding`: how the
    backend's device layer decodes for an engine that runs the policy module itself
    (`Backend.decoding`: a `DecodingSteps` context or a `DecodingLoop`; None: the engine's own)."""
    from grpo.registry import ROLLOUT_ENGINES

    return ROLLOUT_ENGINES.get(name)(model, tokenizer, cfg, decoding)
