"""The `hf` engine's decoding on CUDA: the fixed-shape loop (grpo.cuda.fixed_shape) from the bf16
copy of the weights (grpo.cuda.weights), its token step captured once as a CUDA graph and
replayed for every token, behind a self-check; anything it cannot trust decodes as before.

`GraphedDecoding` is the grpo.rollout.base.DecodingLoop the CUDA layer hands the engine
(`rollout.cuda_decoding`):

- `eager`: the engine's own loop, transformers' modules under autocast, as before;
- `auto`: the captured loop where it applies, from a shape's second rollout on (its first is the
  engine's: a shape that never recurs, as a multi-turn run's later turns mostly do not, is never
  captured), else the engine's own loop, with one warning that names the reason, after which the
  whole run decodes the engine's way;
- `graphs`: the captured loop, and an error instead of the fallback.

A graph is captured per shape (rows, prompt slots, max new tokens, sampling settings; prompt
slots rounded up to `bucket`, and grown, never shrunk, when a longer prompt comes), at most
`keep` of them held. Before a run uses a new graph, `self_check` runs the first `check_steps`
token steps of the real rollout twice from the same state, eagerly and by replaying the graph,
and compares their tokens (exactly) and logits (to `LOGIT_TOLERANCE`); a mismatch, a capture that
fails (an operation a graph cannot hold, a host synchronisation inside the step) or a model the
loop does not support is the fallback's reason. The capture itself is torch's
(`torch.cuda.CUDAGraph`, after warm-up steps on a side stream), handed in as `capture` so that
the CPU tests can stand in for it (tests/cuda/test_graphs.py).

Its speed on a GPU is unmeasured (docs/scaling.md).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

from grpo.config.errors import ConfigError
from grpo.cuda import fixed_shape, weights
from grpo.cuda.fixed_shape import FixedShapeLoop, prompt_slots_for
from grpo.rollout import Rollout, SamplingParams, StopStrings, generate

log = logging.getLogger(__name__)

MODES = ("auto", "eager", "graphs")
SHAPES_REMEMBERED = 64
"""How many once-seen shapes `auto` remembers (a multi-turn run meets many)."""
"""rollout.cuda_decoding's choices."""
WARMUP_STEPS = 2
"""Eager token steps on a side stream before a capture (lazy initialisation, library handles)."""
LOGIT_TOLERANCE = 1e-2
"""How far the self-check lets a replayed step's logits be from the eager step's (relative to the
largest logit, at least 1): a replay runs the very kernels of the eager step, so anything but
rounding means the graph holds something the step no longer computes."""


class GraphUnusable(Exception):
    """Why a captured graph cannot decode this run (its message is the fallback's reason)."""


def capture_cuda_graph(step: Callable[[], None]) -> Callable[[], None]:
    """`step` (device work on fixed buffers) captured as a torch.cuda.CUDAGraph -> its replay.
    The warm-up runs `step` for real: the caller restores the state after."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_STEPS):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def self_check(loop: FixedShapeLoop, capture: Callable, steps: int) -> Callable[[], None]:
    """The graph of `loop.step`, checked against `loop.step` itself on the prefilled rollout (see
    the module's docstring); the loop is left as prefilled. Raises GraphUnusable."""
    saved = loop.snapshot()
    steps = max(1, min(steps, loop.params.max_new_tokens))
    try:
        expected = _record(loop, loop.step, steps)
        loop.restore(saved)
        replay = capture(loop.step)
        loop.restore(saved)  # the warm-up steps ran for real
        got = _record(loop, replay, steps)
    except Exception as e:  # noqa: BLE001 - any failure to capture or run the step means: not here
        loop.restore(saved)
        raise GraphUnusable(f"capturing the token step failed: {type(e).__name__}: {e}") from e
    loop.restore(saved)
    for t, ((tokens, logits), (tokens2, logits2)) in enumerate(zip(expected, got)):
        if not torch.equal(tokens, tokens2):
            raise GraphUnusable(
                f"the captured step sampled other tokens than the eager one at step {t}"
            )
        scale = max(1.0, float(logits.float().abs().max()))
        gap = float((logits.float() - logits2.float()).abs().max())
        if not gap <= LOGIT_TOLERANCE * scale:  # NaN fails too
            raise GraphUnusable(
                f"the captured step's logits differ from the eager one's by {gap:.3g} at step {t}"
            )
    return replay


def _or_unusable(what: str, fn, *args):
    """fn(*args), any failure of it a reason to decode the engine's way (GraphUnusable): the loop
    meets the run's model here first (its forward, its cache, the memory the buffers take)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever it is, this model does not decode here
        raise GraphUnusable(f"{what} failed: {type(e).__name__}: {e}") from e


def _record(loop: FixedShapeLoop, advance: Callable[[], None], steps: int) -> list:
    out = []
    for _ in range(steps):
        advance()
        out.append((loop.tokens.clone(), loop.logits.clone()))
    return out


class GraphedDecoding:
    """The engine's decoding loop on CUDA (see the module's docstring). `capture(step)` -> replay;
    `capture_cuda_graph` on a GPU."""

    def __init__(
        self,
        mode: str = "auto",
        *,
        capture: Callable = capture_cuda_graph,
        bucket: int = 64,
        check_every: int = fixed_shape.CHECK_EVERY,
        check_steps: int = 4,
        keep: int = 4,
    ):
        if mode not in MODES:
            raise ValueError(f"cuda decoding mode {mode!r}: one of {', '.join(MODES)}")
        self.mode, self.capture, self.bucket = mode, capture, bucket
        self.check_every, self.check_steps, self.keep = check_every, check_steps, keep
        self.weights = weights.DecodingCopy()
        self.loops: OrderedDict[tuple, tuple[FixedShapeLoop, Callable]] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()
        """Shapes decoded once the engine's way, to be captured if they come again."""
        self.fallback: str | None = None
        """Why this run decodes the engine's way (set once, with the one warning)."""

    def generate(
        self,
        model,
        prompts: list[list[int]],
        num_generations: int,
        params: SamplingParams,
        *,
        eos_token_ids,
        pad_token_id: int,
        seeds=None,
        stop: StopStrings | None = None,
    ) -> Rollout:
        args = (model, prompts, num_generations, params)
        kwargs = dict(
            eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, seeds=seeds, stop=stop
        )
        if (
            self.mode == "eager"
            or self.fallback is not None
            or not prompts
            or params.max_new_tokens == 0
        ):
            return generate(*args, **kwargs)
        width = max(len(p) for p in prompts)
        reason = weights.unsupported_reason(model) or fixed_shape.unsupported_reason(
            model, width + params.max_new_tokens
        )
        if reason is None and self._first_sight(len(prompts) * num_generations, params):
            return generate(*args, **kwargs)
        if reason is None:
            try:
                return self._decode(
                    model,
                    prompts,
                    num_generations,
                    params,
                    seeds,
                    stop,
                    list(eos_token_ids),
                    pad_token_id,
                    width,
                )
            except GraphUnusable as e:
                reason = str(e)
        self._fall_back(reason)
        return generate(*args, **kwargs)

    def _decode(self, model, prompts, G, params, seeds, stop, eos, pad, width) -> Rollout:
        device = next(model.parameters()).device
        bf16 = (
            torch.is_autocast_enabled(device.type)
            and torch.get_autocast_dtype(device.type) == torch.bfloat16
        )
        dtype = torch.bfloat16 if bf16 else model.get_output_embeddings().weight.dtype
        decoder = _or_unusable(
            "copying the weights for decoding", self.weights.refreshed, model, dtype
        )
        if any(loop.model is not decoder for loop, _ in self.loops.values()):
            self.loops.clear()  # a new copy (another policy or dtype): the old loops read the old one
        # the copy is in the compute dtype already: every cast stays out of the step
        with torch.autocast(device.type, enabled=False):
            key = (len(prompts) * G, params, tuple(sorted(set(eos))), pad)
            held = self._held(key, width)
            if held is None:  # a new shape: its buffers, its prefill and its graph, all checked
                loop = _or_unusable(
                    "allocating the loop's buffers",
                    FixedShapeLoop,
                    decoder,
                    len(prompts) * G,
                    prompt_slots_for(width, self.bucket),
                    params,
                    eos,
                    pad,
                    self.check_every,
                )
                full_ids, full_mask = _or_unusable("the prefill", loop.start, prompts, G, seeds)
                replay = self_check(loop, self.capture, self.check_steps)
                self.loops[key] = (loop, replay)
            else:
                loop, replay = held
                full_ids, full_mask = loop.start(prompts, G, seeds)
            loop.run(replay, stop)
            return loop.finish(full_ids, full_mask)

    def _first_sight(self, rows: int, params: SamplingParams) -> bool:
        """In `auto`, whether this shape (rows, sampling settings) is new: it is decoded the
        engine's way and remembered, and captured when it comes again. A training or evaluation
        rollout recurs every step; a multi-turn run's later turns (fewer rows, fewer tokens each
        turn) mostly do not, and capturing each would cost more than it saves."""
        if self.mode != "auto":
            return False
        shape = (rows, params)
        if shape in self.seen or any(key[:2] == shape for key in self.loops):
            self.seen.pop(shape, None)
            return False
        self.seen[shape] = None
        while len(self.seen) > SHAPES_REMEMBERED:
            self.seen.popitem(last=False)
        return True

    def _held(self, key: tuple, width: int):
        """The held (loop, replay) of this shape if its prompt slots take `width` tokens; else
        None, with room made for a new one (the shape's old loop and the oldest let go)."""
        held = self.loops.get(key)
        if held is not None and held[0].prompt_slots >= width:
            self.loops.move_to_end(key)
            return held
        self.loops.pop(key, None)
        while len(self.loops) >= self.keep:
            self.loops.popitem(last=False)
        return None

    def _fall_back(self, reason: str) -> None:
        if self.mode == "graphs":
            raise ConfigError(
                f"rollout.cuda_decoding=graphs: the captured decoding loop cannot decode this run ({reason}); "
                "set rollout.cuda_decoding=auto (falls back with a warning) or eager"
            )
        self.fallback = reason
        self.loops.clear()
        self.weights.release()
        log.warning(
            "rollout.cuda_decoding=auto: decoding with transformers' modules, as rollout.cuda_decoding=eager "
            "does, for the rest of the run: %s",
            reason,
        )
