"""grpo: train language models with GRPO from verifiable rewards."""

__version__ = "0.1.0"

_TRL_NAMES = ("GRPOConfig", "GRPOTrainer")


def __getattr__(name: str):
    # `from grpo import GRPOConfig, GRPOTrainer` (TRL's names, grpo.trl_api), imported on first
    # use so that `import grpo` stays light (no torch) for the CLI and reward workers
    if name in _TRL_NAMES:
        from grpo import trl_api

        return getattr(trl_api, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


__all__ = ["__version__", *_TRL_NAMES]
