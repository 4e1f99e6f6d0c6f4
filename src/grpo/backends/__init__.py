"""Where the device- and process-specific mechanisms live, behind one small interface.

The training loop (grpo.training.trainer) never asks which device or how many
processes: it asks its backend to prepare the model, build the optimizer,
open the compute autocast, hand out the output layer's kernels and the engine's
decoding steps, clip gradients, count and gather over all ranks, and tidy up
after an update. There are two: a single process on one device
(`single.SingleProcess`) and data parallelism over torchrun's processes
(`distributed.DataParallel`, the same plus the collectives), picked here at
start-up from WORLD_SIZE. Both install the run's device layer (grpo.backends.device_layer:
the CPU speed layer grpo.cpu, or grpo.cuda on a CUDA device), the only place those are reached
from.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Protocol

import torch

from grpo.backends.launcher import launcher_settings
from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.logprobs import OutputLayerKernels
from grpo.rollout.base import DecodingLoop


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

    def output_layer_kernels(self) -> OutputLayerKernels:
        """How the tiled output layer computes here (grpo.models.logprobs.OutputLayerKernels)."""

    decoding: Callable | DecodingLoop | None
    """How the `hf` engine decodes (grpo.backends.device_layer.Decoding): `decoding(model, rows,
    max_length)`, a context yielding decoding steps for the engine's own loop, or a
    grpo.rollout.base.DecodingLoop in its place; None: transformers' modules."""

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip all gradients to a global norm of max_norm (0: no clipping); the norm before clipping."""

    def sum(self, value: float) -> float:
        """`value` summed over all ranks (the global normalisers of the loss)."""

    def reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """Each value summed over all ranks (`*_max` keys: the largest)."""

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on some rank (the same answer on every rank)."""

    def all_gather_object(self, value) -> list:
        """Every rank's `value`, in rank order."""

    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """Every rank's rows concatenated in rank order, and the slice that holds this rank's."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the gradients over all ranks (after a pass's backward, before clipping)."""

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank."""

    def barrier(self) -> None:
        """Wait for every rank."""

    def generation(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Around every rollout and evaluation: the model whole for generating (FSDP gathers its shards)."""

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """What saves and loads the optimizer's state in checkpoints (`state_dict`, `load_state_dict`)."""

    def load_weights(self, saved, model: torch.nn.Module) -> None:
        """A checkpoint's (grpo.run.checkpoint.Checkpoint) weights into the prepared model."""

    def passes_needed(self, count: int) -> int:
        """How many forward (and backward) passes this rank must run for `count` of its own: the
        busiest rank's count when each pass is a collective (FSDP), else `count`."""

    def idle_pass(self, model: torch.nn.Module, grad: bool) -> None:
        """A pass that changes nothing (no rows, zero gradient) but joins the others' collectives."""

    def savable_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The model to write into a checkpoint, on the rank that writes (FSDP: an unsharded copy on rank 0)."""

    def after_update(self) -> None:
        """Called after each update, before the next rollout."""


def world_size() -> int:
    """Processes in this run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; start with torchrun"
        ) from None


def create_backend(cfg: Config) -> Backend:
    """The backend for this process, chosen at start-up: data parallel under torchrun or
    `accelerate launch` (WORLD_SIZE > 1), else one process. Under `accelerate launch` its
    config's distributed type sets training.sharding (grpo.backends.launcher), in `cfg` itself,
    so the run directory's config says how the run trained."""
    for key, value in launcher_settings().items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    if world_size() > 1:
        from grpo.backends.distributed import DataParallel

        return DataParallel(cfg)
    if cfg.training.sharding != "none":
        raise ConfigError(
            f"training.sharding={cfg.training.sharding} shards over torchrun's processes: start with "
            "`torchrun --nproc_per_node N -m grpo train CONFIG` (or `accelerate launch` with "
            "num_processes N > 1), or set training.sharding=none"
        )
    from grpo.backends.single import SingleProcess

    return SingleProcess(cfg)


def leave_process_group() -> None:
    """After a run under torchrun: every rank waits for the others, then leaves the process group,
    so that gloo's or NCCL's threads are stopped before the interpreter exits (left running, they
    can abort a finished process at exit: "terminate called without an active exception"). Nothing
    without torchrun."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
