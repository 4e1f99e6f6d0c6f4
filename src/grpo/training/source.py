"""Where a step's completions come from: a rollout source.

The step pulls each batch of completions from a source and tells it when the policy changed;
it does not know which source it has:

    next_batch(step)       the step's prompts drawn and their completions generated (Generated)
    pause()                the update runs now: the weights change from here on; free what
                           generation holds
    policy_changed(model)  the optimizer stepped: generate from the new weights from now on

and, for the loop around the step: `take_metrics()` (the source's own metrics of the step, its
engine's among them: the server engine's pushes),
`state_dict()` (what a checkpoint holds of it), `evaluation_engine` (the engine held-out
evaluation generates with) and `close()` (at the end of training).

`InProcessSource` generates in the training process with the run's engine (`hf`, or vLLM
colocated, or the `server` engine), its tools, environments or rollout_func
(grpo.training.sampling.Sampler). `grpo.training.ahead.AheadSource` generates ahead of training
on a server (rollout.max_staleness > 0); grpo.training.build.build_phases chooses.

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
from grpo.training.state import DrawnAt
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

    def take_metrics(self) -> dict[str, float]:
        """The source's metrics since the last call (the step's); {} for none."""

    def state_dict(self) -> dict | None:
        """What a checkpoint holds of the source (plain types and tensors), or None."""

    @property
    def evaluation_engine(self):
        """The engine held-out evaluation generates with (the trainer's weights)."""

    def close(self) -> None:
        """Training is over: stop what the source runs."""


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
        """This rank's share of the next prompts, and their seeds."""
        indices, seeds = self.indices()
        return [self.rows[i] for i in indices][self.shard], seeds[self.shard]

    def indices(self) -> tuple[list[int], list[int]]:
        """The next prompts of every rank, as indices into `rows`, and their seeds."""
        indices = [self.sampler.next_index() for _ in range(self.num_prompts)]
        return indices, prompt_seeds(self.generator, self.num_prompts)


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
        drawn = DrawnAt.of(step, self.draw.sampler)
        with self.backend.generation(self.model):
            try:
                generated = self.sample(rows, self.num_generations, self.params, seeds)
            except (
                NonFiniteProbabilities
            ) as error:  # e.g. a learning rate so high the weights blew up
                raise TrainingDiverged(f"generation at step {step}: {error}") from error
        generated.drawn = drawn
        return generated

    def pause(self) -> None:
        # the engine's memory (vLLM's weights and KV cache on CUDA) is the update's now
        self.sample.engine.sleep()

    def policy_changed(self, model: torch.nn.Module) -> None:
        self.sample.engine.sync_weights(model)  # waking it if asleep

    def take_metrics(self) -> dict[str, float]:
        """The engine's since the last step (the server engine's pushes: time/weight_sync,
        weight_sync/bytes); none for an engine that measures nothing."""
        take = getattr(self.sample.engine, "take_metrics", None)
        return take() if take is not None else {}

    def state_dict(self) -> None:
        return None  # the train state holds where the draw is: nothing is generated ahead

    @property
    def evaluation_engine(self):
        return self.sample.engine

    def close(self) -> None:
        pass
