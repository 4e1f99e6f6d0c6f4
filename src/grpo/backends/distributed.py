"""Data parallelism over `torchrun` processes: gloo on the CPU, NCCL on GPUs.

    torchrun --nproc_per_node N -m grpo train CONFIG

Every rank holds the whole model and draws the same prompts and sampling seeds
(the sampler and the seed generator advance identically everywhere); it keeps
its own contiguous share of the step's groups, generates and scores them, and
runs the update on them. What crosses ranks, and why it makes N ranks compute
the update of one process on the same global batch:

- the rewards, all-gathered before the advantage estimator: "batch" scaling,
  RLOO and REINFORCE++ see the whole batch, and a group never straddles ranks;
- dynamic sampling's spread flags, so every rank keeps the groups one process
  would keep (`keep_groups_with_spread` in the global order of the rounds);
- the loss's normalisers (token and sequence counts, `sum`): they are global;
- the gradients, summed once per optimizer pass after the last backward
  (`reduce_gradients`), before clipping, so every rank clips the same global
  norm and takes the same AdamW step; the weights never need a broadcast after
  the first one.

Reducing after the backward passes, rather than in DistributedDataParallel's
hooks during them, is what keeps the single-process CPU mechanisms exact here:
the tiled output layer adds its weight gradient straight into `.grad` (outside
autograd, where DDP's hooks would not see it) and the tied embedding's sparse
rows land in that same dense `.grad`, so by the time the reduction runs every
gradient is one dense tensor per parameter. It also lets ranks run different
numbers of micro-batches (dynamic sampling can keep more groups on one rank
than another) without a collective that waits forever. The price is that the
reduction does not overlap the backward pass.

Only rank 0 writes the run directory and the console (`is_main`); every rank
reads the checkpoint it resumes from.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from grpo.backends.single import SingleProcess
from grpo.config import Config, ConfigError, validate

# gradients are reduced in flat buckets of at most this many elements (a float32 bucket: 256 MB)
BUCKET_ELEMENTS = 64 * 1024 * 1024


def init_process_group(device_type: str) -> None:
    """The default process group from torchrun's environment (once per process)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    # long enough for an evaluation or a checkpoint write on rank 0 while the others wait
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=60))


class DataParallel(SingleProcess):
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        validate(cfg, self.world_size)  # the batch's split over the ranks, before any process waits on another
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = cfg.training.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("training.device: cuda requested but no CUDA device is available; use training.device=cpu")
            if self.local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"LOCAL_RANK={self.local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                    "start at most one process per GPU (torchrun --nproc_per_node)"
                )
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        init_process_group(self.device.type)
        # on the CPU the collectives run on CPU tensors; with NCCL they must live on the GPU
        self._comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = super().prepare_model(model)
        self.broadcast_module(model)
        return model

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (a model loaded or initialised anywhere
        else starts identical)."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.device.type == self._comm_device.type:
                    dist.broadcast(tensor.data, src=0)
                else:
                    copy = tensor.data.to(self._comm_device)
                    dist.broadcast(copy, src=0)
                    tensor.data.copy_(copy)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum every trainable parameter's gradient over the ranks (a missing one counts as zeros)."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        for grads in by_kind.values():
            bucket: list[torch.Tensor] = []
            size = 0
            for g in grads:
                bucket.append(g)
                size += g.numel()
                if size >= BUCKET_ELEMENTS:
                    self._reduce_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self._reduce_bucket(bucket)

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self._comm_device)
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return float(t.item())

    def reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks; keys ending in `_max` take the largest. A key some
        rank lacks (it ran no micro-batch that reports it) counts as 0 there, or as -inf for a max."""
        keys = sorted(set().union(*self.all_gather_object(sorted(sums))))
        if not keys:
            return {}
        is_max = torch.tensor([k.endswith("_max") for k in keys], device=self._comm_device)
        missing = [float("-inf") if k.endswith("_max") else 0.0 for k in keys]
        values = torch.tensor([sums.get(k, m) for k, m in zip(keys, missing)], dtype=torch.float64, device=self._comm_device)
        total = values.clone()
        dist.all_reduce(total)
        largest = values.clone()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        merged = torch.where(is_max, largest, total)
        return dict(zip(keys, merged.tolist()))

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (a stop signal seen by some ranks only)."""
        return self.sum(float(bool(flag))) > 0

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (small, picklable things: flags, counts, texts)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def gather_rows(self, tensor: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """The ranks' tensors concatenated along dim 0 in rank order (their lengths may differ),
        and the slice of it that is this rank's."""
        parts = self.all_gather_object(tensor.detach().cpu())
        start = sum(len(p) for p in parts[: self.rank])
        return torch.cat(parts).to(tensor.device), slice(start, start + len(tensor))

    def barrier(self) -> None:
        dist.barrier()


def close() -> None:
    """Leave the process group (the end of a torchrun process's run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
