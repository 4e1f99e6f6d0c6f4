"""A run's checkpoints, from the parts of the run (grpo.run.checkpoint writes the files).

`Saver.state_dict` is everything besides the policy's weights that continues the run exactly
(`build_parts(restore=...)`, or a checkpoint's `train_state.pt` through `resume=`): the train
state (each rank's own random streams under torchrun), the reward failures over every rank,
the skipped updates, the reference (when it has moved from the starting model), the critic,
the health monitor's history and the batches generated ahead of training.
Rank 0 writes; every rank waits for the checkpoint to be whole and ends with rank 0's failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.config.schema import Config
from grpo.run import checkpoint
from grpo.training.metrics import sum_counts
from grpo.training.update import Skips, TrainingDiverged, check_finite_weights


@dataclass
class Saver:
    """What a checkpoint holds, and where it goes: the policy and its tokenizer, the train
    state, the reward set (its failure counts), the skipped updates, the reference and the
    critic (None without), the backend (who writes, every rank's share), the run directory, and
    the whole config (a checkpoint carries it: a resumed run is checked against it)."""

    cfg: Config
    backend: Any
    run_dir: Path
    model: torch.nn.Module
    tokenizer: Any
    state: Any
    rewards: Any
    skips: Skips
    reference: Any
    critic: Any
    health: Any = None
    """The health monitor (grpo.health.monitor), whose history a checkpoint carries."""
    source: Any = None
    """The rollout source (grpo.training.source), whose batches generated ahead a checkpoint carries."""

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the policy's weights that continues this run exactly (`restore=`)."""
        backend = self.backend
        train = self.state.state_dict()
        if (
            backend.world_size > 1
        ):  # each rank's own random streams (dropout, reward functions' draws)
            train["rng"] = {"per_rank": backend.all_gather_object(train["rng"])}
        return {
            "world_size": backend.world_size,
            "train": train,
            "reward_failures": sum_counts(backend.all_gather_object(dict(self.rewards.failures))),
            "skips": {"consecutive": self.skips.consecutive, "total": self.skips.total},
            "reference": self.reference.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            # the health checks' history, so a resumed run's checks fire (and stop it) where they would have
            "health": self.health.state_dict() if self.health is not None else None,
            # the batches generated ahead of training (rollout.max_staleness), once generated
            "rollout_source": self.source.state_dict() if self.source is not None else None,
        }

    def save(self, directory: Path) -> Path:
        """A checkpoint (grpo.run.checkpoint) of this step, to resume from or load with
        from_pretrained (with LoRA: the adapter only, for PeftModel.from_pretrained or
        `grpo export --merge`)."""
        # a checkpoint with NaN weights is never written
        check_finite_weights(self.model, f"write {directory}")
        state = self.state_dict()  # on every rank: it gathers what each rank holds
        a, step, backend = self.cfg.algorithm, self.state.step, self.backend
        if not (a.ref_sync_steps and step >= a.ref_sync_steps):
            # still a copy of the starting model, which a resumed run copies again
            state["reference"] = None
        model = backend.savable_model(self.model)  # FSDP: gathered whole on rank 0
        failed = None
        if backend.is_main:  # the ranks' weights are the same: rank 0 writes them
            try:
                checkpoint.save_checkpoint(
                    directory, model, self.tokenizer, state, self.cfg, step=step
                )
            except (
                checkpoint.SaveFailed
            ) as error:  # a full disk: the run ends, its earlier checkpoints intact
                failed = error
        # also the barrier: no rank goes on (or resumes) before the checkpoint is whole, and every
        # rank ends with rank 0's failure
        said = backend.all_gather_object(None if failed is None else str(failed))[0]
        if failed is not None:
            raise failed
        if said is not None:
            raise checkpoint.SaveFailed(said)
        return directory

    def save_final(self, saved: Path | None) -> Path:
        """final/: when this step's checkpoint was just written (`saved`: save_steps divides
        max_steps), the same files under a second name (checkpoint.link_checkpoint: nothing
        written twice); else a checkpoint of its own."""
        final = self.run_dir / checkpoint.FINAL
        latest = self.run_dir / f"checkpoint-{self.state.step}"
        if saved == latest:
            linked = self.backend.is_main and checkpoint.link_checkpoint(latest, final) is not None
            if self.backend.all_gather_object(linked)[0]:  # rank 0's answer, for every rank
                return final
        return self.save(final)

    def save_last_good(self) -> tuple[Path | None, str]:
        """After a divergence: a checkpoint of the state before the failed step, if its weights
        are still finite (skipped updates leave them as they were); it (or None), and what was
        done, for the message."""
        directory = self.run_dir / f"checkpoint-{self.state.step}"
        try:
            self.save(directory)
        except TrainingDiverged:
            return None, (
                "the weights are no longer finite, so nothing was saved; the latest checkpoint holds "
                "the last good state"
            )
        return directory, (
            f"the last good state is saved in {directory} (resume from it with --resume after "
            "changing the cause)"
        )
