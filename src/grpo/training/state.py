"""TrainState: everything that changes as a run trains, apart from the weights.

The step and token counters, the optimizer and the learning-rate schedule,
the prompt sampler's position, the entropy bonus's coefficient (which the
adaptive controller moves), and every random stream a step draws from
(Python's, NumPy's, torch's CPU and CUDA generators, and the generator that
samples completions). `state_dict()` captures them all; building a TrainState
with `restore=` that dict continues the run exactly: the same next prompts,
the same next samples, the same next update (tests/training/test_state.py). A fresh run seeds
Python's, NumPy's and torch's global streams with training.seed, as TRL's set_seed does; the
reward calls draw from seeds of their own (`reward_seed`), derived from the state restored here.

State is restored through set-up: the optimizer and the sampler get their
saved state as they are built, before anything uses them.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from grpo import algorithm
from grpo.config.schema import Config
from grpo.tasks.data import PromptSampler


def _numpy():
    try:
        import numpy
    except ImportError:  # numpy is optional; nothing here needs it
        return None
    return numpy


def capture_rng() -> dict[str, Any]:
    """The global random streams: Python's, NumPy's (when installed), torch's CPU and CUDA.

    Only tensors and plain containers of numbers and strings, so that a checkpoint's train state
    loads with `torch.load(weights_only=True)`: NumPy's key array is kept as a list of ints."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = _numpy()
    if numpy is not None:
        name, key, position, has_gauss, cached_gaussian = numpy.random.get_state(legacy=True)
        state["numpy"] = [
            str(name),
            [int(k) for k in key],
            int(position),
            int(has_gauss),
            float(cached_gaussian),
        ]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        name, key, position, has_gauss, cached_gaussian = state["numpy"]
        numpy.random.set_state(
            (name, numpy.asarray(key, dtype=numpy.uint32), position, has_gauss, cached_gaussian)
        )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_global_streams(seed: int) -> None:
    """training.seed into the process's global random streams, as TRL's set_seed puts its seed:
    Python's `random`, NumPy's global stream (when installed), torch's CPU and CUDA generators.
    A resumed run then sets them to the checkpoint's (`restore_rng`)."""
    random.seed(seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(seed)
    torch.manual_seed(seed)  # every CUDA device's too


@dataclass(frozen=True)
class DrawnAt:
    """Where a batch's prompts were drawn: the step it is for, and the prompt order's epoch and
    position right after its draw. A batch's reward seed and `trainer_state` are derived from it,
    so they do not depend on when the batch is scored (a source that generates ahead has drawn
    later batches by then)."""

    step: int
    epoch: int
    position: int

    @classmethod
    def of(cls, step: int, sampler: PromptSampler) -> "DrawnAt":
        return cls(int(step), int(sampler.epoch), int(sampler.position))


def reward_seed(
    state: "TrainState", cfg: Config, rank: int = 0, drawn: DrawnAt | None = None
) -> int:
    """The seed a batch's reward calls draw from (grpo.rewards.reward_set.RewardSet.score): derived
    from training.seed, the step, the prompt order's position after the batch's draw (which moves
    with each round of a step's dynamic sampling; `drawn`, or the state's now) and the rank, all of
    which a resumed run restores, so a reward that draws from `random` or `numpy.random` draws the
    same numbers in a fresh run, a resumed one and the uninterrupted one."""
    at = drawn if drawn is not None else DrawnAt.of(state.step, state.sampler)
    key = f"grpo-rewards:{cfg.training.seed}:{at.step}:{at.epoch}:{at.position}:{rank}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient as the run has moved it (algorithm.use_adaptive_entropy),
    and the entropy of the last optimizer pass, which decides whether the next pass applies it
    (grpo.algorithm.entropy). Plain floats, so a checkpoint still loads with weights_only=True."""

    coef: float
    last_entropy: float = math.inf
    """inf before the first measured pass: the first pass applies no adaptive bonus (as TRL)."""

    def state_dict(self) -> dict[str, float]:
        return {"coef": float(self.coef), "last_entropy": float(self.last_entropy)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])


@dataclass
class TrainState:
    step: int
    """Generation batches trained on (each is num_iterations optimizer steps)."""
    tokens_seen: int
    """Prompt and completion tokens of every batch so far."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: PromptSampler
    generator: torch.Generator
    """Draws the per-prompt sampling seeds (grpo.rollout.types.prompt_seeds), on the CPU."""
    optimizer_state: Any = None
    """What saves and loads the optimizer's state (`state_dict`, `load_state_dict`): the optimizer
    itself, or the backend's stand-in for it (FSDP: the state of every shard, gathered)."""
    entropy: EntropyControl | None = None
    """The entropy bonus's coefficient (algorithm.entropy_coef at step 0)."""

    @classmethod
    def create(
        cls,
        cfg: Config,
        optimizer: torch.optim.Optimizer,
        num_rows: int,
        restore: dict[str, Any] | None = None,
        optimizer_state: Any = None,
    ) -> "TrainState":
        """A run's state at step 0 (seeded from `cfg`), or at the step `restore` was saved at.
        `optimizer_state`: see the field (default: the optimizer)."""
        t = cfg.training
        total_updates = t.max_steps * cfg.algorithm.num_iterations
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda i: algorithm.lr_multiplier(
                t.lr_scheduler_type, i, total_updates, t.warmup_steps
            ),
        )
        seed_global_streams(t.seed)
        # host-side: the seeds are host integers, drawn without a device sync, and a run on any
        # device draws the same ones (its checkpoint's generator state too)
        generator = torch.Generator(device="cpu").manual_seed(t.seed)
        sampler = PromptSampler(
            num_rows,
            cfg.data.seed,
            state=restore["sampler"] if restore else None,
            shuffle=cfg.data.shuffle,
        )
        state = cls(0, 0, optimizer, scheduler, sampler, generator, optimizer_state or optimizer)
        state.entropy = EntropyControl(cfg.algorithm.entropy_coef)
        if restore is not None:
            # a checkpoint of an earlier version has none: it starts from the config's coefficient
            if restore.get("entropy"):
                state.entropy.load_state_dict(restore["entropy"])
            state.optimizer_state.load_state_dict(restore["optimizer"])
            scheduler.load_state_dict(restore["scheduler"])
            generator.set_state(restore["generator"])
            restore_rng(restore["rng"])
            state.step, state.tokens_seen = restore["step"], restore["tokens_seen"]
        return state

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "optimizer": self.optimizer_state.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "generator": self.generator.get_state(),
            "rng": capture_rng(),
            "entropy": self.entropy.state_dict() if self.entropy is not None else None,
        }


def trainer_state(
    state: TrainState, num_iterations: int, max_steps: int, drawn: DrawnAt | None = None
) -> SimpleNamespace:
    """What TRL passes reward functions as `trainer_state`, under its attribute names: optimizer
    steps (a grpo step is num_iterations of them) and the fractional epoch (where the scored
    batch's prompts were drawn, `drawn`, or the prompt order's position now). A SimpleNamespace,
    so it pickles to reward functions in worker processes."""
    mu, sampler = num_iterations, state.sampler
    epoch, position = (drawn.epoch, drawn.position) if drawn else (sampler.epoch, sampler.position)
    return SimpleNamespace(
        global_step=state.step * mu,
        max_steps=max_steps * mu,
        epoch=epoch + position / sampler.num_rows,
    )
