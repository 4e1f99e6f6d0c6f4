"""The seam between the backends and the device layers: what makes one kind of device fast.

A device layer (grpo.cpu on a CPU with cpu.enabled, grpo.cuda on a CUDA device, none elsewhere)
is chosen once per run by `device_layer`, and only the backends hold it. They install it on the
prepared model and hand what it provides to the parts that take it: the output layer's kernels
to the log-probabilities, the decoding to the `hf` engine, the tidying after each update to the
loop. Those parts know the interfaces below, never the layers: the layers are imported here
alone, when chosen, and they use only the public interfaces of grpo.rollout and grpo.models
(tests/backends/test_device_layer.py checks both).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from grpo.config.errors import ConfigError
from grpo.config.schema import Config
from grpo.models.logprobs import OutputLayerKernels
from grpo.rollout.base import DecodingLoop

Decoding = Callable | DecodingLoop | None
"""What the `hf` engine decodes with (grpo.rollout.hf.TransformersEngine's `decoding`):
`decoding(model, rows, max_length)`, a context yielding grpo.rollout.base.DecodingSteps for the
engine's own loop; a grpo.rollout.base.DecodingLoop that replaces the loop; or None, the engine's
loop with transformers' modules."""


class DeviceLayer(Protocol):
    def install(self, model: torch.nn.Module, swap_modules: bool = True) -> None:
        """Its mechanisms on the prepared model (after LoRA wrapped it); `swap_modules` False
        (FSDP's shards) leaves the model's modules as they are."""

    def output_layer_kernels(self, weight_grad_in_place: bool) -> OutputLayerKernels:
        """How grpo.models.logprobs computes the output layer's tiles on this device."""

    decoding: Decoding
    """How the `hf` engine decodes on this device."""

    def after_update(self) -> None:
        """Called after each update, before the next rollout."""


def device_layer(cfg: Config, device: torch.device) -> DeviceLayer | None:
    """The device layer of a run on `device`: grpo.cpu's CPULayer on a CPU with cpu.enabled,
    grpo.cuda's CUDALayer on a CUDA device, else None (plain PyTorch). Each is imported only here,
    and only when chosen."""
    mode = cfg.rollout.cuda_decoding
    if device.type == "cuda":
        from grpo.cuda.layer import CUDALayer

        # FSDP's shards are whole only inside its gathers: no copy to decode from
        return CUDALayer(mode if cfg.training.sharding == "none" else "eager")
    if mode == "graphs":
        raise ConfigError(
            f"rollout.cuda_decoding=graphs captures CUDA graphs, but this run is on {device.type}; "
            "set rollout.cuda_decoding=auto (it applies only on CUDA) or training.device=cuda"
        )
    if device.type == "cpu" and cfg.cpu.enabled:
        from grpo.cpu.layer import CPULayer

        return CPULayer(cfg.cpu)
    return None


def before_torch_allocates(cfg: Config) -> None:
    """What a program must set before torch's first allocation, for the device layer it will
    use: transparent huge pages for the CPU layer's tensors (cpu.enabled). A program calls it
    at its start (grpo's CLI does); `import grpo` does not, as a library must not set its
    caller's environment."""
    if cfg.cpu.enabled:
        from grpo.cpu.memory import use_huge_pages

        use_huge_pages()
