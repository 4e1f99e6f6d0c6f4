"""A run's checkpoints, from the parts of the run (grpo.run.checkpoint writes the files).

`state_dict` is everything besides the policy's weights that continues the run exactly
(`build_parts(restore=...)`, or a checkpoint's `train_state.pt` through `resume=`): the train
state (each rank's own random streams under torchrun), the reward failures over every rank,
the skipped updates, the reference (when it has moved from the starting model), the critic and
the health monitor's history.
Rank 0 writes; every rank waits for the checkpoint to be whole and ends with rank 0's failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.run import checkpoint
from grpo.training.metrics import sum_counts
from grpo.training.update import TrainingDiverged, check_finite_weights

if TYPE_CHECKING:
    from grpo.training.build import RunParts


def state_dict(run: RunParts) -> dict[str, Any]:
    """Everything besides the policy's weights that continues this run exactly (`restore=`)."""
    backend = run.backend
    train = run.state.state_dict()
    if backend.world_size > 1:  # each rank's own random streams (dropout, reward functions' draws)
        train["rng"] = {"per_rank": backend.all_gather_object(train["rng"])}
    return {
        "world_size": backend.world_size,
        "train": train,
        "reward_failures": sum_counts(backend.all_gather_object(dict(run.rewards.failures))),
        "skips": {"consecutive": run.skips.consecutive, "total": run.skips.total},
        "reference": run.reference.state_dict(),
        "critic": run.critic.state_dict() if run.critic is not None else None,
        # the health checks' history, so a resumed run's checks fire (and stop it) where they would have
        "health": run.health.state_dict() if run.health is not None else None,
    }


def save(run: RunParts, directory: Path) -> Path:
    """A checkpoint (grpo.run.checkpoint) of this step, to resume from or load with from_pretrained
    (with LoRA: the adapter only, for PeftModel.from_pretrained or `grpo export --merge`)."""
    # a checkpoint with NaN weights is never written
    check_finite_weights(run.model, f"write {directory}")
    state = state_dict(run)  # on every rank: it gathers what each rank holds
    a = run.cfg.algorithm
    if not (a.ref_sync_steps and run.state.step >= a.ref_sync_steps):
        state["reference"] = (
            None  # still a copy of the starting model, which a resumed run copies again
        )
    model = run.backend.savable_model(run.model)  # FSDP: gathered whole on rank 0
    failed = None
    if run.backend.is_main:  # the ranks' weights are the same: rank 0 writes them
        try:
            checkpoint.save_checkpoint(
                directory, model, run.tokenizer, state, run.cfg, step=run.state.step
            )
        except (
            checkpoint.SaveFailed
        ) as error:  # a full disk: the run ends, its earlier checkpoints intact
            failed = error
    # also the barrier: no rank goes on (or resumes) before the checkpoint is whole, and every
    # rank ends with rank 0's failure
    said = run.backend.all_gather_object(None if failed is None else str(failed))[0]
    if failed is not None:
        raise failed
    if said is not None:
        raise checkpoint.SaveFailed(said)
    return directory


def save_final(run: RunParts, saved: Path | None) -> Path:
    """final/: when this step's checkpoint was just written (`saved`: save_steps divides
    max_steps), the same files under a second name (checkpoint.link_checkpoint: nothing written
    twice); else a checkpoint of its own."""
    final = run.log.dir / checkpoint.FINAL
    latest = run.log.dir / f"checkpoint-{run.state.step}"
    if saved == latest:
        linked = run.backend.is_main and checkpoint.link_checkpoint(latest, final) is not None
        if run.backend.all_gather_object(linked)[0]:  # rank 0's answer, for every rank
            return final
    return save(run, final)


def save_last_good(run: RunParts) -> tuple[Path | None, str]:
    """After a divergence: a checkpoint of the state before the failed step, if its weights are
    still finite (skipped updates leave them as they were); it (or None), and what was done, for
    the message."""
    directory = run.log.dir / f"checkpoint-{run.state.step}"
    try:
        save(run, directory)
    except TrainingDiverged:
        return None, (
            "the weights are no longer finite, so nothing was saved; the latest checkpoint holds the "
            "last good state"
        )
    return directory, (
        f"the last good state is saved in {directory} (resume from it with --resume after changing "
        "the cause)"
    )
