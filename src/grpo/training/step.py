"""One GRPO step, its phases in the order of the algorithm (docs/architecture.md is the map):

    generate    the rollout source's next batch                     grpo.training.source
    rewards     each completion scored; the loss mask               grpo.training.scoring
    filter      DAPO: more rounds until enough groups vary          grpo.training.collect
    pause       the source told the weights change now              grpo.training.source
    reference   pi_old (num_iterations > 1) and pi_ref logprobs     grpo.training.reference
    values      the critic's values                                 grpo.training.critic (with a critic)
    advantages  once, over the final batch                          grpo.training.advantages
    update      num_iterations optimizer passes                     grpo.training.update
    critic      the critic's own passes                             grpo.training.critic (with a critic)
    sync        the source told of the new weights; the reference's refresh

Each phase is a part built once (grpo.training.build) holding only what it reads, called here
as a bound method; each is timed under its name (time/<phase> in metrics.jsonl). The step's
metrics, counters and logs are the loop's (grpo.training.trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo.run import faults
from grpo.training.advantages import Advantages
from grpo.training.batching import GenerationBatch
from grpo.training.collect import Collector
from grpo.training.critic import CriticPhase
from grpo.training.metrics import PhaseTimer
from grpo.training.reference import ReferencePhase
from grpo.training.source import RolloutSource
from grpo.training.update import PolicyUpdate


@dataclass
class Phases:
    """A run's phases, built once (grpo.training.build.build_phases)."""

    source: RolloutSource
    """Where the completions come from; the collector pulls from it, the sync tells it."""
    collect: Collector
    reference: ReferencePhase
    advantages: Advantages
    update: PolicyUpdate
    critic: CriticPhase | None


def train_step(p: Phases, step: int, timer: PhaseTimer) -> tuple[dict[str, float], GenerationBatch]:
    """Step `step` (0-based) of GRPO: the update's statistics and the step's generation batch."""
    batch = p.collect(step, timer)  # generate -> rewards (-> filter)
    faults.reached("step")
    stats = update(p, batch, timer)  # reference -> (values) -> advantages -> update (-> critic)
    with timer("sync"):
        p.source.policy_changed(p.update.model)
        p.reference.after_step(step + 1)
    return stats, batch


def update(p: Phases, batch: GenerationBatch, timer: PhaseTimer) -> dict[str, float]:
    """The update half of a step on a scored batch, without the sync. The source is paused
    first: the weights change from here on (and what generation holds is the update's)."""
    with timer("pause"):  # generating ahead, the wait for the push; vLLM's sleep in-process
        p.source.pause()
    with timer("reference"):
        old_logp, ref_logp = p.reference(batch)
    values = None
    if p.critic is not None:
        with timer("values"):
            values = p.critic.values(batch)
    with timer("advantages"):
        advantages = p.advantages(batch, values)
    with timer("update"):
        stats = p.update(batch, advantages, old_logp, ref_logp)
    if p.critic is not None:
        with timer("critic"):
            stats.update(p.critic.update(batch, values))
    return stats
