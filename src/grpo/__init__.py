"""grpo: train language models with GRPO from verifiable rewards."""

__version__ = "0.1.0"

_TRL_NAMES = {
    "GRPOConfig": "grpo.trl.config",
    "GRPOTrainer": "grpo.trl.trainer",
    "AsyncGRPOConfig": "grpo.trl.async_grpo",
    "AsyncGRPOTrainer": "grpo.trl.async_grpo",
}
"""TRL's names and the modules of grpo.trl that define them."""


def __getattr__(name: str):
    # `from grpo import GRPOConfig, GRPOTrainer` (TRL's names, grpo.trl; AsyncGRPOConfig and
    # AsyncGRPOTrainer, TRL's experimental asynchronous trainer's), imported on first
    # use so that `import grpo` stays light (no torch) for the CLI and reward workers
    if name in _TRL_NAMES:
        import importlib

        return getattr(importlib.import_module(_TRL_NAMES[name]), name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


__all__ = ["__version__", *_TRL_NAMES]
