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

`training.sharding: fsdp` shards the parameters, gradients and AdamW's state
with FSDP2: `fully_shard` on each decoder layer and on the whole model (its
embedding, final norm and output layer). FSDP then sums the gradients itself
(reduce-scatter, as a mean, which `reduce_gradients` turns into the sum the
globally normalised loss needs); the logprobs run as the model's registered FSDP
forward method (grpo.models.logprobs.FSDP_METHOD), because they read the output
weight outside any module's forward (each call one pass of the decoder: no
prompt sharing, so every micro-batch costs every rank the same collectives);
for generation every shard is gathered
once and kept whole until the rollout ends (`generation`), so that ranks whose
completions end at different steps never wait on each other's all-gathers.
The mechanisms that touch `.grad` or swap modules (the output layer's in-place
gradient, the sparse embedding gradient, the CPU layer's oneDNN linears and
fused decoding) are off under FSDP; the CPU layer's compiled kernels stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import types
from typing import Any

import torch
import torch.distributed as dist

from grpo.backends.device_layer import device_layer
from grpo.backends.single import (
    SingleProcess,
    adamw,
    enable_checkpointing,
    resolve_device,
)
from grpo.config.errors import ConfigError
from grpo.config.schema import Config, validate
from grpo.models.precision import uses_bf16

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
        # the batch's split over the ranks, before any process waits on another
        validate(cfg, self.world_size)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if resolve_device(cfg.training.device).type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"LOCAL_RANK={self.local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                    "start at most one process per GPU (torchrun --nproc_per_node)"
                )
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.fsdp = cfg.training.sharding == "fsdp"
        self.bf16 = uses_bf16(cfg.training.bf16, self.device)
        self.layer = device_layer(cfg, self.device)
        init_process_group(self.device.type)
        # on the CPU the collectives run on CPU tensors; with NCCL they must live on the GPU
        self._comm_device = self.device if self.device.type == "cuda" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.fsdp:
            model = super().prepare_model(model)
            self.broadcast_module(model)
            return model
        model = model.to(self.device)
        enable_checkpointing(model, self.cfg.training.gradient_checkpointing)
        self.broadcast_module(model)  # every rank shards the same weights
        model = shard_with_fsdp(model)
        if (
            self.layer is not None
        ):  # its compiled kernels only: the shards' modules stay as FSDP wraps them
            self.layer.install(model, swap_modules=False)
        return model

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if not self.fsdp:
            return super().make_optimizer(model)
        # over the shards; FSDP allocates their gradients
        return adamw(model, self.cfg.training, self.device)

    def output_layer_kernels(self):
        kernels = super().output_layer_kernels()
        # FSDP allocates and reduces the shards' gradients itself: autograd's gradient, not in place
        return dataclasses.replace(kernels, weight_grad_in_place=False) if self.fsdp else kernels

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        if not self.fsdp:
            return super().clip_grad_norm(model, max_norm)
        # the norm over every rank's shards (DTensors); an infinite maximum measures without clipping
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm > 0 else float("inf")
        )
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @contextlib.contextmanager
    def generation(self, model: torch.nn.Module):
        if not self.fsdp:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        # whole until the rollout ends: no collective per decoding step
        model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            model.set_reshard_after_forward(True)
            for unit in units:
                unit.reshard()

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        return FullOptimizerState(model, optimizer) if self.fsdp else optimizer

    def load_weights(self, saved, model: torch.nn.Module) -> None:
        if not self.fsdp:
            return saved.load_weights(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # every rank reads the whole checkpoint and keeps its shards
        set_model_state_dict(
            model,
            saved.weights(model),
            options=StateDictOptions(full_state_dict=True, strict=False),
        )

    def passes_needed(self, count: int) -> int:
        if not self.fsdp:
            return count
        return max(self.all_gather_object(count))

    def idle_pass(self, model: torch.nn.Module, grad: bool) -> None:
        """One token through the model, and a backward of zero times it: the same all-gathers
        and reduce-scatters as a real micro-batch, without changing a gradient."""
        from grpo.models.logprobs import completion_logprobs

        one = torch.ones(1, 1, dtype=torch.long, device=self.device)
        with contextlib.nullcontext() if grad else torch.no_grad(), self.autocast():
            logp, _ = completion_logprobs(model, one, one, one, one)
        if grad:
            (logp.sum() * 0.0).backward()

    def savable_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        if not self.fsdp:
            return model
        return unsharded_copy(model)

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
        """Sum every trainable parameter's gradient over the ranks (a missing one counts as zeros).
        Under FSDP its backward has reduce-scattered them already, as a mean: times the world
        size, a sum (FSDP's own switch to a sum needs a reduction gloo lacks)."""
        if self.fsdp:
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(self.world_size)
            return
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
        values = torch.tensor(
            [sums.get(k, m) for k, m in zip(keys, missing)],
            dtype=torch.float64,
            device=self._comm_device,
        )
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


def shard_with_fsdp(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over the decoder layers and the whole model, gradients summed (not averaged), and
    grpo's logprobs registered as a forward method (grpo.models.logprobs.FSDP_METHOD)."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from grpo.models.logprobs import FSDP_METHOD, _completion_logprobs

    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ConfigError(
            f"training.sharding=fsdp: {type(model).__name__} has no decoder layers at "
            f"{model.base_model_prefix}.layers to shard; set training.sharding=none"
        )
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)

    def logprobs(self, *args, share_prompts: bool = True, **kwargs):
        # one decoder pass per call, whatever the rows (shared prompts would make it two for some
        # micro-batches and one for others, and the ranks' all-gathers would no longer pair up)
        return _completion_logprobs(self, *args, share_prompts=False, **kwargs)

    setattr(model, FSDP_METHOD, types.MethodType(logprobs, model))
    register_fsdp_forward_method(model, FSDP_METHOD)
    return model


class FullOptimizerState:
    """An FSDP optimizer's state as checkpoints hold it: whole (every shard gathered, keyed by
    parameter name), so that it does not depend on how the ranks split the parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            self.model,
            self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True)
        )


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module | None:
    """On rank 0, the FSDP model's weights gathered into a plain (unsharded, CPU) model of its
    transformers class, to save with save_pretrained; None on the other ranks. Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return None
    cls = next(
        c
        for c in type(model).__mro__[1:]
        if not issubclass(c, FSDPModule) and issubclass(c, torch.nn.Module)
    )
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(state, assign=True, strict=False)
    plain.tie_weights()
    missing = [name for name, p in plain.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(
            f"the gathered FSDP state has no {missing[:3]}: cannot write the checkpoint"
        )
    return plain


def close() -> None:
    """Leave the process group (the end of a torchrun process's run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
