"""Generation engines behind one small interface.

`generate(model, prompts, num_generations, params)` returns a `Rollout`: for
each prompt, G completions as token ids with a mask and a truncated flag. The
transformers engine (`hf.py`) is the default; other engines (vLLM) return the
same `Rollout`.
"""

from grpo.rollout.types import Rollout, SamplingParams
from grpo.rollout.hf import StopStrings, generate

__all__ = ["Rollout", "SamplingParams", "StopStrings", "generate"]
