"""Generation engines behind one interface (grpo.rollout.base.RolloutEngine).

An engine's `generate(prompts, G, params, seeds)` returns a `Rollout`: for
each prompt, G completions as token ids with a mask and a truncated flag. The
transformers engine (`hf.py`, `rollout.engine: hf`) is the default; engines are
named in grpo.registry.ROLLOUT_ENGINES and built with `create_engine`.

The names exported here are also the interface the device layers (grpo.cpu, grpo.cuda) build
on, which import them from here, never from the modules: the decoding interfaces a backend hands
the `hf` engine (`DecodingSteps`, `DecodingLoop`), transformers' steps (`TransformersSteps`), and
the engine's own pieces a decoding loop of another shape reuses so that it samples the very same
tokens (the noise, the sampler, the repetition penalty, the stop strings, the Rollout's assembly).
"""

from grpo.rollout.base import DecodingLoop, DecodingSteps, RolloutEngine, create_engine
from grpo.rollout.hf import (
    NonFiniteProbabilities,
    StopStrings,
    TransformersEngine,
    TransformersSteps,
    completed_rollout,
    generate,
    left_pad,
    penalise_repetitions,
    prompt_noise,
    prompt_tokens_seen,
    sample_unchecked,
)
from grpo.rollout.types import Rollout, SamplingParams, prompt_seeds

__all__ = [
    "DecodingLoop",
    "DecodingSteps",
    "NonFiniteProbabilities",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "StopStrings",
    "TransformersEngine",
    "TransformersSteps",
    "completed_rollout",
    "create_engine",
    "generate",
    "left_pad",
    "penalise_repetitions",
    "prompt_noise",
    "prompt_seeds",
    "prompt_tokens_seen",
    "sample_unchecked",
]
