"""Generation engines behind one interface (grpo.rollout.base.RolloutEngine).

An engine's `generate(prompts, G, params, seeds)` returns a `Rollout`: for
each prompt, G completions as token ids with a mask and a truncated flag. The
transformers engine (`hf.py`, `rollout.engine: hf`) is the default; engines are
named in grpo.registry.ROLLOUT_ENGINES and built with `create_engine`.
"""

from grpo.rollout.base import DecodingSteps, RolloutEngine, create_engine
from grpo.rollout.hf import StopStrings, TransformersEngine, generate
from grpo.rollout.types import Rollout, SamplingParams

__all__ = [
    "DecodingSteps",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "StopStrings",
    "TransformersEngine",
    "create_engine",
    "generate",
]
