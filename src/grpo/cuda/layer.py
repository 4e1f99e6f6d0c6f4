"""The one seam between the CUDA device layer and the rest of grpo.

A backend running on a CUDA device builds one `CUDALayer` (grpo.backends.device_layer) and asks it:

    install(model)          nothing yet: the prepared model trains as it is
    output_layer_kernels()  plain PyTorch tiles (grpo.models.OutputLayerKernels' defaults)
    decoding                the `hf` engine's decoding loop: the fixed-shape loop from a bf16
                            copy of the weights, replayed as CUDA graphs behind a self-check
                            (grpo.cuda.graphs; rollout.cuda_decoding)
    after_update()          nothing: the decoding copy is refreshed at the start of each rollout

Nothing else in grpo imports grpo.cuda; it uses only the public interfaces of grpo.rollout and
grpo.models. Its GPU speed is unmeasured (docs/scaling.md).
"""

from __future__ import annotations

import torch

from grpo.cuda.graphs import GraphedDecoding
from grpo.models import OutputLayerKernels


class CUDALayer:
    """The CUDA device layer of one run (see the module's docstring); `decoding_mode` is
    rollout.cuda_decoding: auto, eager or graphs."""

    def __init__(self, decoding_mode: str):
        self.decoding = GraphedDecoding(decoding_mode)
        """The grpo.rollout.base.DecodingLoop the backend hands the `hf` engine."""

    def install(self, model: torch.nn.Module, swap_modules: bool = True) -> None:
        """Nothing to put on the model: the decoding loop copies its weights at each rollout."""

    def output_layer_kernels(self, weight_grad_in_place: bool) -> OutputLayerKernels:
        return OutputLayerKernels(weight_grad_in_place=weight_grad_in_place)

    def after_update(self) -> None:
        """Nothing: the decoding copy is rewritten from the policy when the next rollout starts."""
