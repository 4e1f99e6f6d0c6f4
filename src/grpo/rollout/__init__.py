"""Generation engines behind one interface (grpo.rollout.base.RolloutEngine).

An engine's `generate(prompts, G, params, seeds)` returns a `Rollout`: for
each prompt, G completions as token ids with a mask and a truncated flag. The
transformers engine (`hf.py`, `rollout.engine: hf`) is the default; engines are
named in grpo.registry.ROLLOUT_ENGINES and built with `create_engine`.

The names exported here are also the interface the device layers (grpo.cpu) build on, which
import them from here, never from the modules: the decoding interfaces a backend hands the `hf`
engine (`DecodingSteps`, `DecodingLoop`) and transformers' steps (`TransformersSteps`).
"""

from grpo.rollout.base import DecodingLoop, DecodingSteps, RolloutEngine, create_engine
from grpo.rollout.hf import StopStrings, TransformersEngine, TransformersSteps, generate
from grpo.rollout.types import Rollout, SamplingParams

__all__ = [
    "DecodingLoop",
    "DecodingSteps",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "StopStrings",
    "TransformersEngine",
    "TransformersSteps",
    "create_engine",
    "generate",
]
