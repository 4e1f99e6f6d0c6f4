"""Trains each config named on the command line, one after another, in this torchrun process
(tests/backends/test_distributed.py starts it once for all its cases: a torchrun launch costs seconds)."""

import sys

from grpo.backends import leave_process_group
from grpo.config import loading as config
from grpo.training.trainer import Trainer

if __name__ == "__main__":
    for path in sys.argv[1:]:
        Trainer.from_config(config.load(path)).train()
    leave_process_group()
