"""The compute precision of generation, log-probabilities and the loss."""

from __future__ import annotations

import contextlib

import torch


def uses_bf16(setting: bool | str, device: torch.device) -> bool:
    """Whether training.bf16 (`setting`: true, false or auto) computes in bf16 on `device`: auto
    is on for a CUDA device that supports bf16, off elsewhere (the CPU computes float32 unless
    asked)."""
    if setting == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return bool(setting)


def bf16_autocast(device: torch.device, enabled: bool):
    """bf16 autocast on `device` when enabled (fp32 master weights stay as they are)."""
    return (
        torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()
    )
