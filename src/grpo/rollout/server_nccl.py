"""A push to a vLLM server on GPUs over vLLM's NCCL weight-transfer engine, the trainer's side
being vLLM's own (`WeightTransferTrainerFactory`'s `nccl` engine): vllm must be importable in the
trainer's process, and the policy on a CUDA device. **No GPU has run this**: the CPU tests drive
the gloo engine, whose HTTP sequence this shares.

vLLM's trainer engine opens the group (a TCP rendezvous the trainer hosts, then an NCCL
communicator on the trainer's current CUDA device: rank 0, the server's workers 1 .. its world
size) while asking the server to join (`/init_weight_transfer_engine`), and a push is
`/start_weight_update`, `/update_weights` (names, dtype_names, shapes: vLLM's fields only) beside
the packed broadcasts of the weights (in buckets of rollout.server.bucket_mb), then
`/finish_weight_update` with the version. NCCL has no timeout of its own: the push runs in a
thread that is waited for rollout.server.weight_sync_timeout, past which it is abandoned (the
group with it) and the push ends in TimedOut, never a hang.
"""

from __future__ import annotations

import socket
import threading

from grpo.config.errors import ConfigError
from grpo.rollout.server_http import TimedOut


def check_available(model) -> None:
    """vLLM's NCCL trainer engine can run here, or a ConfigError naming the fix."""
    device = next(model.parameters()).device
    fix = (
        "or start the server with gloo: `grpo serve MODEL --engine vllm -- --weight-transfer-config "
        '\'{"backend": "gloo"}\'`'
    )
    if device.type != "cuda":
        raise ConfigError(
            f"rollout.engine: server: the vLLM server transfers weights over NCCL, which needs the policy on "
            f"a CUDA device (it is on {device}); train on a GPU, {fix}"
        )
    try:
        from vllm.distributed.weight_transfer.factory import (  # noqa: F401
            WeightTransferTrainerFactory,
        )
    except Exception as error:  # noqa: BLE001 (ImportError, or a broken install)
        raise ConfigError(
            "rollout.engine: server: the vLLM server transfers weights over NCCL, whose trainer side is "
            f"vLLM's: install vllm in the trainer's environment ({type(error).__name__}: {error}), {fix}"
        ) from None


class _Client:
    """vLLM's VLLMWeightSyncClient over the server engine's bounded HTTP exchanges."""

    def __init__(self, post):
        self.post = post
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {"is_checkpoint_format": True})

    def update_weights(self, update_info) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else str(self.version)
        self.post("/finish_weight_update", {"weight_version": version})


def _source(engine):
    """vLLM's WeightSource over what the engine pushes (its metadata, then its tensors)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from grpo.rollout.weight_transfer import DTYPES

    class PolicySource(WeightSource):
        def metadata(self):
            return [ParamMeta(m.name, DTYPES[m.dtype], m.shape) for m in engine.metas]

        def __iter__(self):
            return iter(engine._weights())

    return PolicySource()


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _bounded(what: str, work, seconds: float):
    """`work()` in a thread, waited for `seconds`; its result, its error, or TimedOut."""
    done: list = []
    failed: list[BaseException] = []

    def run():
        try:
            done.append(work())
        except BaseException as error:  # noqa: BLE001 (re-raised in the caller's thread)
            failed.append(error)

    thread = threading.Thread(target=run, name=f"grpo-nccl-{what}", daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    if failed:
        raise failed[0]
    if thread.is_alive():
        raise TimedOut(
            f"the NCCL {what} did not finish within {seconds:g} s",
            "rollout.server.weight_sync_timeout",
        )
    return done[0] if done else None


class NCCLPush:
    """The NCCL group with one server, and pushes through it (see the module's docstring)."""

    def __init__(self, engine, world: int, address: str):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        s = engine.settings
        self.client = _Client(engine._post)
        port = s.group_port or _free_port(address)
        info = NCCLTrainerInitInfo(
            master_address=address,
            master_port=port,
            world_size=world,
            rank=0,
            packed=True,
            packed_buffer_size_bytes=engine.bucket_bytes,
        )
        self.transfer = _bounded(
            "group's start",
            lambda: WeightTransferTrainerFactory.trainer_init(
                info, client=self.client, source=_source(engine)
            ),
            s.weight_sync_timeout,
        )
        self.timeout = s.weight_sync_timeout

    def push(self, version: int, nbytes: int) -> int:
        """One push as `version`; the bytes sent."""
        self.client.version = version
        _bounded("push", self.transfer.send_weights, self.timeout)
        return nbytes

    def close(self) -> None:
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            try:
                transfer.shutdown()
            except Exception:  # noqa: BLE001 (a group a failed push left broken)
                pass
