"""grpo: train language models with GRPO from verifiable rewards."""

__version__ = "0.1.0"
