"""Weights streamed from the trainer to a generation server: a gloo group, buckets.

The trainer (rank 0 of the group) opens a TCP store; the server joins it (as rank 1; a vLLM server's
workers as ranks 1 .. its world size, grpo.serve.vllm_gloo) when told to
(`init_weight_transfer_engine`, the same handshake as vLLM's NCCL engine: `master_address`,
`master_port`, `rank_offset`, `world_size`). A push is announced by its metadata (`names`,
`dtype_names`, `shapes`: vLLM's update_info) and sent as a sequence of broadcasts of packed
buckets of at most `bucket_bytes` each: the tensors in the announced order, each at an offset
aligned to ALIGN bytes, a tensor larger than a bucket sent alone. Both sides derive the same
buckets from the metadata (`plan_buckets`), so nothing but the tensors' bytes crosses the group,
and neither side holds more than one bucket (or one large tensor) at a time.

Every collective of the group is bounded by the timeout it was opened with (gloo raises when a
peer does not answer in time), so a stalled or dead peer ends a push with an error, never a hang.
`checksum` is the digest of named tensors that the server reports and a test compares with the
trainer's (`weights_checksum`).
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

ALIGN = 64
"""Bytes each tensor's slot in a bucket is aligned to (any dtype's view of it is then aligned)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a push may carry, by the names vLLM's update_info uses (`dtype_names`)."""

MAX_DIMS = 8
"""Most dimensions of a pushed tensor."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorMeta:
    """A pushed tensor's name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPES[self.dtype].itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def update_info(metas: list[TensorMeta], bucket_bytes: int, version: int) -> dict:
    """The announcement of a push (vLLM's update_info: names, dtype_names, shapes; packed, with
    its bucket size; and the version the weights will hold once it lands)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "packed": True,
        "packed_buffer_size_bytes": bucket_bytes,
        "weights_version": version,
    }


@dataclass(frozen=True)
class Bucket:
    """One broadcast: the tensors `indices` (into the metadata) at `offsets`, `size` bytes."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """The tensors in order, packed greedily into buckets of at most `bucket_bytes` (each slot
    aligned to ALIGN); a tensor that does not fit an empty bucket gets one of its own.
    Example: sizes [40, 40, 100] with bucket_bytes 128 -> buckets [0, 1] (offsets 0, 64) and [2]."""
    buckets, indices, offsets, used = [], [], [], 0
    for i, meta in enumerate(metas):
        size = meta.nbytes
        start = _aligned(used)
        if indices and start + size > bucket_bytes:
            buckets.append(Bucket(tuple(indices), tuple(offsets), used))
            indices, offsets, start = [], [], 0
        indices.append(i)
        offsets.append(start)
        used = start + size
    if indices:
        buckets.append(Bucket(tuple(indices), tuple(offsets), used))
    return buckets


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's contents as a flat uint8 tensor (a view where it is contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class Scratch:
    """One bucket's buffer, kept from push to push (a fresh one each time costs its pages again)."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8, device="cpu")

    def take(self, size: int) -> torch.Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size, dtype=torch.uint8, device="cpu")
        return self.buffer[:size]


def send(
    group,
    weights: Iterable[tuple[str, torch.Tensor]],
    metas: list[TensorMeta],
    bucket_bytes: int,
    scratch: Scratch | None = None,
) -> int:
    """Broadcast `weights` (the tensors `metas` announced, in that order) bucket by bucket, packed
    in `scratch`; the bytes sent. A tensor that is not the one announced raises ValueError
    before it is sent."""
    iterator: Iterator[tuple[str, torch.Tensor]] = iter(weights)
    scratch = scratch or Scratch()
    sent = 0
    for bucket in plan_buckets(metas, bucket_bytes):
        staged = []
        for i in bucket.indices:
            name, tensor = next(iterator)
            if TensorMeta.of(name, tensor) != metas[i]:
                raise ValueError(
                    f"weight push: {name} is not the tensor announced ({metas[i]}); the policy changed shape"
                )
            staged.append(as_bytes(tensor).cpu())
        if len(staged) == 1 and bucket.size == staged[0].numel():
            buffer = staged[0]  # alone in its bucket: sent as it is, no copy
        else:  # the alignment's padding bytes are sent as they are: nothing reads them
            buffer = scratch.take(bucket.size)
            for offset, data in zip(bucket.offsets, staged):
                buffer[offset : offset + data.numel()] = data
        _broadcast(group, buffer)
        sent += sum(data.numel() for data in staged)
    return sent


def receive(
    group,
    metas: list[TensorMeta],
    bucket_bytes: int,
    load: Callable[[str, torch.Tensor], None],
    scratch: Scratch | None = None,
) -> int:
    """Receive the buckets of a push announced by `metas` into `scratch`, calling `load(name,
    tensor)` for each tensor as its bucket lands (the tensor is a view of the bucket: copy it);
    the bytes received."""
    scratch = scratch or Scratch()
    received = 0
    for bucket in plan_buckets(metas, bucket_bytes):
        buffer = scratch.take(bucket.size)
        _broadcast(group, buffer)
        for i, offset in zip(bucket.indices, bucket.offsets):
            meta = metas[i]
            data = buffer[offset : offset + meta.nbytes]
            load(meta.name, data.view(DTYPES[meta.dtype]).reshape(meta.shape))
            received += meta.nbytes
    return received


def open_store(host: str, port: int, timeout: float, world_size: int = 2):
    """The trainer's side of the rendezvous: a TCP store it hosts on `port` (0: a free one);
    its port is `store.port`."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        world_size=world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def join_store(host: str, port: int, timeout: float, world_size: int = 2):
    """A server's side of the rendezvous: the trainer's store, reached within `timeout`."""
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        world_size=world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def open_group(store, rank: int, timeout: float, world_size: int = 2):
    """The gloo group of the trainer (rank 0) and a server's `world_size - 1` processes over
    `store` (this process is `rank`), each collective bounded by `timeout` seconds. It returns
    once every rank has joined."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("grpo-weights", store)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, datetime.timedelta(seconds=timeout))


def checksum(weights: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """{"digest": sha256 over every tensor's name, dtype, shape and bytes, in the order of their
    names, "tensors": name -> the sha256 of its bytes}: what the server reports, and what a test
    computes from the trainer's weights to compare (the same digest whatever order they came in)."""
    tensors, described = {}, {}
    for name, tensor in weights:
        tensors[name] = hashlib.sha256(as_bytes(tensor).cpu().numpy().tobytes()).hexdigest()
        described[name] = f"{name}:{dtype_name(tensor.dtype)}:{list(tensor.shape)}:"
    total = hashlib.sha256()
    for name in sorted(tensors):
        total.update(described[name].encode())
        total.update(tensors[name].encode())
    return {"algorithm": "sha256", "digest": total.hexdigest(), "tensors": tensors}
