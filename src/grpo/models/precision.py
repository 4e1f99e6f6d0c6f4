"""The compute precision of generation, log-probabilities and the loss."""

from __future__ import annotations

import contextlib

import torch


def bf16_autocast(device: torch.device, enabled: bool):
    """bf16 autocast on `device` when enabled (fp32 master weights stay as they are)."""
    return (
        torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()
    )
