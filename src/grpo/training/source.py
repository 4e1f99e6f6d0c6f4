"""Where a step's completions come from: a rollout source.

The step pulls each batch of completions from a source and tells it when the policy changed;
it does not know which source it has:

    next_batch(step)       the step's prompts drawn and their completions generated (Generated)
    pause()                the update runs now: free what generation holds
    policy_changed(model)  the optimizer stepped: generate from the new weights from now on

`InProcessSource` generates in the training process with the run's engine (`hf`, or vLLM
colocated), its tools, environments or rollout_func (grpo.training.sampling.Sampler). A
source that generates elsewhere (a server, or ahead of training) implements the same three
methods; docs/architecture.md says where it plugs in.

Every rank draws the same prompts and per-prompt seeds from the train state's sampler and
generator (so a checkpoint carries where the draw is), and keeps its own share of the groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.rollout.hf import NonFiniteProbabilities
from grpo.rollout.types import SamplingParams, prompt_seeds
from grpo.tasks.data import PromptSampler, Row
from grpo.training.sampling import Generated, Sampler
from grpo.training.update import TrainingDiverged


class RolloutSource(Protocol):
    """What the step pulls its completions from (see the module's docstring)."""

    num_generations: int
    """G: completions per prompt."""

    def next_batch(self, step: int) -> Generated:
        """The next prompts (this rank's share of the groups) with their completions."""

    def pause(self) -> None:
        """The update runs now: free what generation holds (caches, weight copies)."""

    def policy_changed(self, model: torch.nn.Module) -> None:
        """The policy's weights changed: the batches after this one come from them."""


@dataclass
class PromptDraw:
    """The step's prompts and sampling seeds: `num_prompts` over every rank, from the train
    state's prompt sampler and seed generator, of which this rank keeps `shard`."""

    rows: list[Row]
    sampler: PromptSampler
    generator: torch.Generator
    num_prompts: int
    shard: slice

    def __call__(self) -> tuple[list[Row], list[int]]:
        rows = self.sampler.take(self.rows, self.num_prompts)[self.shard]
        seeds = prompt_seeds(self.generator, self.num_prompts)[self.shard]
        return rows, seeds


@dataclass
class InProcessSource:
    """Generation in the training process (see the module's docstring): the prompts drawn
    (`draw`), G completions of each by `sample` at `params`, inside the backend's generation
    context (FSDP: the policy whole) for `model`."""

    draw: PromptDraw
    sample: Sampler
    params: SamplingParams
    num_generations: int
    backend: object
    model: torch.nn.Module

    @property
    def engine(self):
        return self.sample.engine

    def next_batch(self, step: int) -> Generated:
        rows, seeds = self.draw()
        with self.backend.generation(self.model):
            try:
                return self.sample(rows, self.num_generations, self.params, seeds)
            except (
                NonFiniteProbabilities
            ) as error:  # e.g. a learning rate so high the weights blew up
                raise TrainingDiverged(f"generation at step {step}: {error}") from error

    def pause(self) -> None:
        # the engine's memory (vLLM's weights and KV cache on CUDA) is the update's now
        self.sample.engine.sleep()

    def policy_changed(self, model: torch.nn.Module) -> None:
        self.sample.engine.sync_weights(model)  # waking it if asleep
