"""One GRPO step, its phases in the order of the algorithm (docs/architecture.md is the map):

    generate    G completions of each of the step's prompts       grpo.training.collect, .sampling
    rewards     each completion scored; the loss mask               grpo.training.scoring
    filter      DAPO: more rounds until enough groups vary          dynamic_sampling only
    reference   pi_old (num_iterations > 1) and pi_ref logprobs     grpo.training.update.batch_logprobs
    values      the critic's values                                 with a critic
    advantages  once, over the final batch                          the registered estimator
    update      num_iterations optimizer passes                     grpo.training.update.policy_update
    critic      the critic's own passes                             with a critic
    sync        the engine takes the new weights; the reference refresh

`train_step` is the step over a run's parts (grpo.training.build.RunParts): `collect_batch`
(generate -> rewards -> filter), `update` (reference -> values -> advantages -> update ->
critic), the sync. Each phase is timed under its name (time/<phase> in metrics.jsonl); the
step's metrics, counters and logs are the loop's (grpo.training.trainer).

The advantages are the registered estimator's (algorithm.advantage_estimator) through the
registered multi-objective aggregation (algorithm.multi_objective_aggregation), on every
rank's completions (whole groups each, in rank order: what one process would see), then
this rank's rows; an estimator that `needs_values` also gets the critic's values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.algorithm import AdvantageInputs
from grpo.run import faults
from grpo.training.batching import GenerationBatch
from grpo.training.collect import collect_batch
from grpo.training.critic import batch_values, critic_update
from grpo.training.metrics import PhaseTimer
from grpo.training.update import batch_logprobs, policy_update

if TYPE_CHECKING:
    from grpo.training.build import RunParts


def train_step(run: RunParts, timer: PhaseTimer) -> tuple[dict[str, float], GenerationBatch]:
    """One GRPO step; the update's statistics and the step's generation batch."""
    batch = collect_batch(run, timer)  # generate -> rewards (-> filter)
    faults.reached("step")
    run.engine.sleep()  # the engine's memory (vLLM's weights and KV cache on CUDA) is the update's now
    stats = update(run, batch, timer)  # reference -> (values) -> advantages -> update (-> critic)
    with timer("sync"):
        sync(run)
    return stats, batch


def update(run: RunParts, batch: GenerationBatch, timer: PhaseTimer | None = None) -> dict:
    """Old and reference logprobs, (with a critic: its values), the batch's advantages, then
    num_iterations optimizer passes over `batch` (with a critic: its own passes after)."""
    cfg, timer = run.cfg, timer or PhaseTimer()
    with timer("reference"):
        old_logp, ref_logp = reference_logprobs(run, batch)
    values = None
    if run.critic is not None:
        with timer("values"):
            values = batch_values(run.critic.model, batch, cfg, run.backend)
    with timer("advantages"):
        batch.advantages = advantages(run, batch, values)
    with timer("update"):
        s = run.state
        stats = policy_update(
            run.model,
            s.optimizer,
            s.scheduler,
            batch,
            old_logp,
            ref_logp,
            cfg,
            run.backend,
            run.skips,
            s.entropy,
        )
    if run.critic is not None:
        with timer("critic"):
            stats.update(critic_update(run.critic, batch, values, cfg, run.backend))
    return stats


def reference_logprobs(run: RunParts, batch: GenerationBatch) -> tuple:
    """log pi_old [N, T] (only with num_iterations > 1: else the update's own, detached) and
    log pi_ref [N, T] (only with a reference: beta > 0), without gradients."""
    cfg, backend = run.cfg, run.backend
    old_logp = (
        batch_logprobs(run.model, batch, cfg, backend) if cfg.algorithm.num_iterations > 1 else None
    )
    ref_logp = None
    if run.reference.enabled:
        with run.reference.module() as reference:
            ref_logp = batch_logprobs(reference, batch, cfg, backend)
    return old_logp, ref_logp


def advantages(run: RunParts, batch: GenerationBatch, values: torch.Tensor | None) -> torch.Tensor:
    """The step's advantages, computed once over its final batch: [N], or [N, T] per token."""
    inputs, mine = advantage_inputs(run, batch, values)
    everyone = run.aggregation(inputs, run.estimator)
    if everyone.dim() == 1:
        return everyone[mine]
    return everyone[mine, : batch.rollout.completion_ids.shape[1]]


def advantage_inputs(
    run: RunParts, batch: GenerationBatch, values: torch.Tensor | None
) -> tuple[AdvantageInputs, slice]:
    """The estimator's inputs, of every rank's completions (per-token tensors padded to the
    widest rank's), and the rows of them that are this rank's."""
    a, backend = run.cfg.algorithm, run.backend
    rewards, mine = backend.gather_rows(batch.rewards)
    per_token = {}
    if values is not None:
        tensors = {
            "values": values,
            "completion_mask": batch.rollout.completion_mask,
            "loss_mask": batch.loss_mask,
        }
        widest = max(backend.all_gather_object(values.shape[1]))
        per_token = {
            name: backend.gather_rows(_padded(tensor, widest))[0]
            for name, tensor in tensors.items()
        }
    inputs = AdvantageInputs(
        rewards,
        run.cfg.rollout.num_generations,
        a.scale_rewards,
        rewards_per_func=backend.gather_rows(batch.rewards_per_func)[0],
        reward_weights=run.rewards.weights,
        gamma=a.gamma,
        lam=a.lam,
        whiten=a.whiten_advantages,
        **per_token,
    )
    return inputs, mine


def _padded(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T] right-padded with zeros to [N, width] (a narrower rank's tokens)."""
    missing = width - tensor.shape[1]
    return torch.nn.functional.pad(tensor, (0, missing)) if missing else tensor


def sync(run: RunParts) -> None:
    """The engine takes the new weights (waking it if asleep), the step is counted, and every
    ref_sync_steps the reference is refreshed from the policy."""
    a = run.cfg.algorithm
    run.engine.sync_weights(run.model)
    run.state.step += 1
    if a.ref_sync_steps and run.state.step % a.ref_sync_steps == 0:
        run.reference.sync(run.model, a.ref_sync_alpha)
