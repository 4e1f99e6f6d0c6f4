"""The CUDA layer's decoding (grpo.cuda.graphs.GraphedDecoding) on the CPU, with stand-ins for
the capture: a graph is captured once per shape and checked against the eager step before a run
uses it; a mismatch, a capture that fails, or a model the loop does not cover falls back to the
engine's own loop with one warning naming the reason; `graphs` makes that an error. On a GPU
(GRPO_TEST_DEVICE=cuda) the last test captures a real torch.cuda.CUDAGraph."""

import logging

import pytest
import torch

from grpo.config import loading
from grpo.config.errors import ConfigError
from grpo.config.rollout_rewards import RolloutConfig
from grpo.cuda import graphs
from grpo.cuda.graphs import GraphedDecoding
from grpo.cuda.layer import CUDALayer
from grpo.rollout import SamplingParams, TransformersEngine

SAMPLED = SamplingParams(12, temperature=1.0, top_k=40)


class Captures:
    """A stand-in for capture_cuda_graph: the step itself, run as its replay, counted; or a
    replay that corrupts what the step computed, or a capture that raises."""

    def __init__(self, kind: str = "faithful"):
        self.kind, self.count = kind, 0

    def __call__(self, step):
        self.count += 1
        if self.kind == "failing":
            raise RuntimeError("operation not permitted when stream is capturing")
        if self.kind == "faithful":
            return step
        loop = step.__self__

        def corrupted():
            step()
            loop.logits.mul_(-1.0)  # a graph that holds a stale or wrong computation

        return corrupted


def _rollout(decoding, model, prompts, tokenizer, params=SAMPLED, seeds=(1, 2, 3)):
    return decoding.generate(
        model,
        prompts,
        2,
        params,
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        seeds=list(seeds)[: len(prompts)],
    )


def _same(a, b):
    return torch.equal(a.completion_ids, b.completion_ids) and torch.equal(
        a.completion_mask, b.completion_mask
    )


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == graphs.__name__]


def test_a_faithful_graph_is_captured_once_per_shape_and_decodes_the_engines_tokens(
    tiny, prompts, tokenizer, engine_rollout, caplog, assert_same_greedy
):
    model = tiny("llama")
    captures = Captures()
    decoding = GraphedDecoding("auto", capture=captures, bucket=8, keep=2)
    with caplog.at_level(logging.WARNING):
        first = _rollout(decoding, model, prompts, tokenizer)
        assert captures.count == 0  # a shape's first rollout is the engine's: it may not recur
        again = _rollout(decoding, model, prompts, tokenizer, seeds=(4, 5, 6))
        shorter = _rollout(decoding, model, prompts[:1] * 3, tokenizer)  # fits the same slots
        assert captures.count == 1
        longer = _rollout(decoding, model, [list(range(4, 24))] * 3, tokenizer)  # 20 > 16 slots
        assert captures.count == 2
        _rollout(decoding, model, prompts, tokenizer, params=SamplingParams(12, 0))
        greedy = _rollout(decoding, model, prompts, tokenizer, params=SamplingParams(12, 0))
        assert captures.count == 3  # other sampling settings: another graph, when they recur
    assert _warnings(caplog) == [] and decoding.fallback is None
    assert len(decoding.loops) == decoding.keep  # the oldest shape's loop was let go
    for ours, prompt_rows, params, seeds in (
        (first, prompts, SAMPLED, [1, 2, 3]),
        (again, prompts, SAMPLED, [4, 5, 6]),
        (shorter, prompts[:1] * 3, SAMPLED, [1, 2, 3]),
        (longer, [list(range(4, 24))] * 3, SAMPLED, [1, 2, 3]),
        (greedy, prompts, SamplingParams(12, 0), [1, 2, 3]),
    ):
        theirs = engine_rollout(model, prompt_rows, 2, params, seeds=seeds)
        if params.temperature == 0:  # two code paths: equal but for ties within rounding
            assert_same_greedy(model, ours, theirs, atol=1e-5)
        else:  # a sampled token differs only at a uniform within rounding of a CDF step
            # (tests/cuda/test_fixed_shape.py's docstring), which these seeds do not draw
            assert _same(ours, theirs)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("corrupted", "the captured step's logits differ from the eager one's by"),
        ("failing", "capturing the token step failed: RuntimeError: operation not permitted"),
    ],
)
def test_a_graph_that_disagrees_or_fails_falls_back_with_one_warning(
    kind, reason, tiny, prompts, tokenizer, engine_rollout, caplog
):
    model = tiny("qwen2", with_lora=True)
    captures = Captures(kind)
    decoding = GraphedDecoding("auto", capture=captures)
    with caplog.at_level(logging.WARNING):
        rollouts = [_rollout(decoding, model, prompts, tokenizer) for _ in range(3)]
    warned = _warnings(caplog)
    assert len(warned) == 1 and reason in warned[0], warned
    assert "rollout.cuda_decoding" in warned[0]
    assert captures.count == 1  # decided once for the run
    assert decoding.fallback is not None and decoding.loops == {}
    assert decoding.weights.model is None  # the copy's memory let go
    reference = engine_rollout(model, prompts, 2, SAMPLED, seeds=[1, 2, 3])
    for r in rollouts:  # the engine's own loop, its very tokens and logprobs
        assert _same(r, reference) and torch.equal(r.sampling_logprobs, reference.sampling_logprobs)


def test_a_model_the_loop_does_not_cover_falls_back_naming_why(
    tiny, prompts, tokenizer, engine_rollout, caplog
):
    model = tiny("gemma3", window=4)  # shorter than the rollout
    captures = Captures()
    decoding = GraphedDecoding("auto", capture=captures)
    with caplog.at_level(logging.WARNING):
        ours = _rollout(decoding, model, prompts, tokenizer)
        _rollout(decoding, model, prompts, tokenizer)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "a sliding window of 4 positions" in warned[0]
    assert captures.count == 0
    assert _same(ours, engine_rollout(model, prompts, 2, SAMPLED, seeds=[1, 2, 3]))


def test_graphs_refuse_to_fall_back_and_eager_never_captures(tiny, prompts, tokenizer):
    model = tiny("llama")
    with pytest.raises(ConfigError, match=r"rollout\.cuda_decoding=graphs: .*logits differ"):
        _rollout(
            GraphedDecoding("graphs", capture=Captures("corrupted")), model, prompts, tokenizer
        )
    captures = Captures()
    eager = GraphedDecoding("eager", capture=captures)
    _rollout(eager, model, prompts, tokenizer)
    assert captures.count == 0 and eager.weights.model is None
    with pytest.raises(ValueError, match="one of auto, eager, graphs"):
        GraphedDecoding("fast")
    field = RolloutConfig.__dataclass_fields__["cuda_decoding"]
    assert field.default == "auto"
    for mode in graphs.MODES:  # every mode the loop knows is a value the config accepts
        loading.from_dict({}, [f"rollout.cuda_decoding={mode}"])


def test_the_engine_decodes_with_the_layers_loop_under_its_autocast(tiny, prompts, tokenizer):
    """The hf engine hands the whole rollout to the CUDA layer's loop (a DecodingLoop); under
    bf16 autocast the loop decodes from a bf16 copy, with autocast off inside."""
    model = tiny("llama")
    layer = CUDALayer("auto")
    layer.decoding.capture = Captures()
    cfg = loading.from_dict({}, ["training.device=cpu"])
    engine = TransformersEngine(model, tokenizer, cfg, decoding=layer.decoding)
    engine.generate(prompts, 2, SAMPLED, seeds=[1, 2, 3])  # a shape's first: the engine's loop
    out = engine.generate(prompts, 2, SAMPLED, seeds=[1, 2, 3])
    assert layer.decoding.capture.count == 1 and out.sampling_logprobs is not None
    assert layer.decoding.weights.model.model.embed_tokens.weight.dtype == torch.float32
    engine.bf16 = True  # as training.bf16 would set it on a GPU
    bf16 = engine.generate(prompts, 2, SAMPLED, seeds=[1, 2, 3])
    assert layer.decoding.weights.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.completion_ids.shape[0] == 6 and layer.decoding.fallback is None
    assert layer.output_layer_kernels(True).weight_grad_in_place


@pytest.mark.gpu
def test_a_real_cuda_graph_passes_the_self_check_and_decodes_the_eager_tokens(
    tiny, prompts, tokenizer
):
    """On a GPU: the token step captured by torch.cuda.CUDAGraph, replayed for every token,
    gives the tokens of the same loop run eagerly from the same bf16 copy."""
    from grpo.cuda.fixed_shape import decode_eagerly

    model = tiny("qwen2").cuda()
    decoding = GraphedDecoding("graphs")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = _rollout(decoding, model, prompts, tokenizer)
    copy = decoding.weights.model
    with torch.autocast("cuda", enabled=False):
        eager = decode_eagerly(
            copy,
            prompts,
            2,
            SAMPLED,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
            seeds=[1, 2, 3],
            bucket=decoding.bucket,
        )
    assert _same(ours, eager)
