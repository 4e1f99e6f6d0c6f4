"""Where the device- and process-specific mechanisms live, behind one small interface.

The training loop (grpo.trainer) never asks which device or how many
processes: it asks its backend to prepare the model, build the optimizer,
open the compute autocast, say where the output layer's weight gradient goes,
clip gradients, count over all ranks, and tidy up after an update. Today
there is one backend, a single process on one device (`single.SingleProcess`,
with the CPU mechanisms inside it); a distributed backend (torchrun data
parallelism, FSDP2) implements the same methods and is picked here at start-up.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

import torch

from grpo.config import Config, ConfigError


class Backend(Protocol):
    device: torch.device
    world_size: int
    rank: int

    @property
    def is_main(self) -> bool:
        """Whether this process writes the run directory and the console."""

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model placed and set up for training here (kernels, checkpointing, wrappers)."""

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters, as training.* configures it."""

    def autocast(self) -> contextlib.AbstractContextManager:
        """The compute precision context of generation, logprobs and the loss."""

    def output_grad_sink(self, model: torch.nn.Module) -> torch.Tensor | None:
        """A tensor the tiled output layer adds its weight gradient into (None: autograd's .grad)."""

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip all gradients to a global norm of max_norm (0: no clipping); the norm before clipping."""

    def sum(self, value: float) -> float:
        """`value` summed over all ranks (the global normalisers of the loss)."""

    def after_update(self) -> None:
        """Called after each update, before the next rollout."""


def create_backend(cfg: Config) -> Backend:
    """The backend for this process, chosen at start-up."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise ConfigError(
            f"WORLD_SIZE={world_size}: several processes (torchrun) are not supported yet; "
            "run a single process (`grpo train CONFIG`)"
        )
    from grpo.backends.single import SingleProcess

    return SingleProcess(cfg)
