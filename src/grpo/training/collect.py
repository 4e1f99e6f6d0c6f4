"""A step's scored generation batch: the rollout source's completions, scored, in rounds.

Each round pulls the next batch from the rollout source (grpo.training.source: every rank
draws the same prompts and per-prompt seeds and keeps its own share of the groups) and scores
it (grpo.training.scoring). Without dynamic sampling one round is the batch; with it (DAPO),
rounds go on until enough groups over every rank have reward spread (or
algorithm.max_sampling_rounds), and the filter keeps those groups, as one process would keep
them (grpo.training.batching.keep_groups_with_spread).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.training.batching import GenerationBatch, groups_with_spread, keep_groups_with_spread
from grpo.training.metrics import PhaseTimer
from grpo.training.scoring import Scoring
from grpo.training.source import RolloutSource


@dataclass
class Collector:
    """The generate, rewards and filter phases: `source` and `scoring`, with DAPO's dynamic
    sampling (`dynamic_sampling`, at most `max_rounds` rounds) over the `num_prompts` groups of
    every rank, of which this rank's start at `shard_start`; `pad_token_id` pads the groups
    kept from rounds of different widths."""

    source: RolloutSource
    scoring: Scoring
    backend: object
    num_prompts: int
    shard_start: int
    dynamic_sampling: bool
    max_rounds: int
    pad_token_id: int

    def __call__(self, step: int, timer: PhaseTimer | None = None) -> GenerationBatch:
        """A scored generation batch: the next prompts' rollouts and rewards; with dynamic
        sampling (DAPO), more rounds until enough groups have reward spread."""
        timer = timer or PhaseTimer()
        rounds: list[GenerationBatch] = []
        while not rounds or (self.dynamic_sampling and self._more_rounds(rounds)):
            with timer("generate"):
                generated = self.source.next_batch(step)
            with timer("rewards"):
                rounds.append(self.scoring(generated))
        if not self.dynamic_sampling:
            return rounds[0]
        with timer("filter"):
            return self._keep_groups_with_spread(rounds)

    def _more_rounds(self, rounds: list[GenerationBatch]) -> bool:
        G = self.source.num_generations
        with_spread = self.backend.sum(sum(int(groups_with_spread(b, G).sum()) for b in rounds))
        return with_spread < self.num_prompts and len(rounds) < self.max_rounds

    def _keep_groups_with_spread(self, rounds: list[GenerationBatch]) -> GenerationBatch:
        """DAPO's filter over the rounds: every rank's flags, so that the groups kept are those
        one process would keep."""
        G = self.source.num_generations
        spread = [
            [
                flag
                for flags in self.backend.all_gather_object(groups_with_spread(b, G).tolist())
                for flag in flags
            ]
            for b in rounds
        ]
        return keep_groups_with_spread(
            rounds, self.num_prompts, G, self.pad_token_id, spread, self.shard_start
        )
