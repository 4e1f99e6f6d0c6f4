"""Checkpoints written atomically: a crash mid-write never replaces a good one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def atomic_directory_write(target: Path, write) -> Path:
    """Call write(tmp_dir), then move tmp_dir to `target` in one rename.

    A previous `target` is kept until the new one is complete."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(
    directory: Path,
    model,
    tokenizer,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    state: dict[str, Any] | None = None,
) -> Path:
    """Model + tokenizer (loadable with from_pretrained), optimizer, scheduler and trainer state."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if optimizer is not None:
            torch.save(
                {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None},
                tmp / "optimizer.pt",
            )
        (tmp / "trainer_state.json").write_text(json.dumps(state or {}, indent=2))

    return atomic_directory_write(Path(directory), write)
