"""What a launcher's configuration says about how to train, read from the environment it sets.

`accelerate launch` starts the same processes as torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT: grpo's DataParallel reads those) and writes the user's accelerate
config into ACCELERATE_* variables. A TRL user's accelerate config chooses the distributed type;
grpo maps the one it implements and refuses the others by name, before any model is loaded:

    distributed_type MULTI_CPU / MULTI_GPU (DDP)   grpo's data parallelism (nothing to set)
    distributed_type FSDP                          training.sharding=fsdp (grpo's FSDP2)
    distributed_type DEEPSPEED                     refused: grpo shards with FSDP2 itself
    mixed_precision fp16                           refused: grpo trains in fp32 or bf16
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from grpo.config.errors import ConfigError

_TRUE = ("1", "true", "yes")


def _set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in _TRUE


def launcher_settings(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The grpo settings the launcher's configuration stands for ({key: value}; empty outside
    `accelerate launch` or for plain data parallelism); a configuration grpo would silently run
    otherwise is refused with one line naming the fix."""
    if _set(environ, "ACCELERATE_USE_DEEPSPEED"):
        raise ConfigError(
            "accelerate launch with a DeepSpeed config (distributed_type: DEEPSPEED): grpo shards "
            "with FSDP2 itself; use an accelerate config with distributed_type: FSDP (or "
            "`torchrun --nproc_per_node N -m grpo train CONFIG training.sharding=fsdp`)"
        )
    if environ.get("ACCELERATE_MIXED_PRECISION", "").strip().lower() == "fp16":
        raise ConfigError(
            "accelerate launch with mixed_precision: fp16: grpo trains in fp32 or bf16 (fp16 needs "
            "loss scaling it does not do); set mixed_precision: bf16 or no in the accelerate config"
        )
    if _set(environ, "ACCELERATE_USE_FSDP"):
        return {"training.sharding": "fsdp"}
    return {}
