"""grpo: train language models with GRPO from verifiable rewards."""

import os

__version__ = "0.1.0"

# Large CPU tensors (logit tiles, activations, gradients) are allocated and freed
# every step; backing them with transparent huge pages cuts the page
# faults of re-allocating them. PyTorch reads this once, at its first allocation,
# so it only takes effect when grpo is imported before torch allocates anything.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
