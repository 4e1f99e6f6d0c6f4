"""A step's scored generation batch: generate -> rewards (-> filter), in rounds.

Each round takes the next prompts (every rank draws the same prompts and per-prompt seeds,
and keeps its own share of the groups: `RunParts.shard`), generates G completions of each
(grpo.training.sampling) and scores them (grpo.training.scoring). Without dynamic sampling
one round is the batch; with it (DAPO), rounds go on until enough groups over every rank
have reward spread (or algorithm.max_sampling_rounds), and the filter keeps those groups,
as one process would keep them (grpo.training.batching.keep_groups_with_spread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.rollout.hf import NonFiniteProbabilities
from grpo.rollout.types import prompt_seeds
from grpo.training.batching import GenerationBatch, groups_with_spread, keep_groups_with_spread
from grpo.training.metrics import PhaseTimer
from grpo.training.sampling import generate
from grpo.training.scoring import score
from grpo.training.update import TrainingDiverged

if TYPE_CHECKING:
    from grpo.training.build import RunParts


def collect_batch(run: RunParts, timer: PhaseTimer | None = None) -> GenerationBatch:
    """A scored generation batch: the next prompts' rollouts and rewards; with dynamic
    sampling (DAPO), more rounds until enough groups have reward spread."""
    a, G, timer = run.cfg.algorithm, run.cfg.rollout.num_generations, timer or PhaseTimer()
    rounds: list[GenerationBatch] = []
    while not rounds or (
        a.dynamic_sampling
        and run.backend.sum(sum(int(groups_with_spread(b, G).sum()) for b in rounds))
        < run.num_prompts
        and len(rounds) < a.max_sampling_rounds
    ):
        rows = run.state.sampler.take(run.task.train_rows, run.num_prompts)[run.shard]
        seeds = prompt_seeds(run.state.generator, run.num_prompts)[run.shard]
        with timer("generate"), run.backend.generation(run.model):
            try:
                rollout, context = generate(run, rows, G, run.sampling, seeds)
            except (
                NonFiniteProbabilities
            ) as error:  # e.g. a learning rate so high the weights blew up
                raise TrainingDiverged(f"generation at step {run.state.step}: {error}") from error
        with timer("rewards"):
            rounds.append(score(run, rows, rollout, **context))
    if not a.dynamic_sampling:
        return rounds[0]
    with timer("filter"):
        return _keep_groups_with_spread(run, rounds)


def _keep_groups_with_spread(run: RunParts, rounds: list[GenerationBatch]) -> GenerationBatch:
    """DAPO's filter over the rounds: every rank's flags, so that the groups kept are those one
    process would keep."""
    G = run.cfg.rollout.num_generations
    spread = [
        [
            flag
            for flags in run.backend.all_gather_object(groups_with_spread(b, G).tolist())
            for flag in flags
        ]
        for b in rounds
    ]
    return keep_groups_with_spread(
        rounds, run.num_prompts, G, run.engine.pad_token_id, spread, run.shard.start
    )
