"""The fixed-shape decoding loop (grpo.cuda.fixed_shape) run eagerly, the twin of the captured
loop: the tokens of the hf engine's own loop under greedy decoding and under sampling with the
same seeds, for tiny Llama, Qwen2 and Gemma 3 models, with and without LoRA, with prompt sharing
(G > 1), EOS and stop strings; no host read inside a token step, one every CHECK_EVERY steps.

Why the tokens are the same though the arithmetic is not bitwise the same: the loop's attention
runs over a padded buffer (prompt slots rounded up, the completion's slots not yet written) where
the engine's runs over a cache that grows, and over a batch that never shrinks where the engine
drops finished rows. The masked slots get probability exactly 0 (softmax of -inf, checked
bitwise below), but the products that sum over the slots block the longer sum their own way, so
on this CPU the float32 attention output differs in its last bits (also checked below). The
logits then agree to float32 rounding (1e-5 here, checked per step), the greedy tokens are the
same except where two candidates are within that of each other (`assert_same_greedy`: a tie,
compared no further), and a sampled token would differ only if its uniform number fell within
rounding of a step of the CDF, which the fixed seeds here do not do (the sampler is the engine's
own function, fed the same numbers)."""

import pytest
import torch
import torch.nn.functional as F

from grpo.cuda import fixed_shape
from grpo.cuda.fixed_shape import FixedShapeLoop, decode_eagerly, unsupported_reason
from grpo.cuda.weights import DecodingCopy
from grpo.rollout import NonFiniteProbabilities, SamplingParams, StopStrings, TransformersSteps

ARCHITECTURES = ("llama", "qwen2", "gemma3")  # the tiny models of tests/cuda/conftest.py
LOGIT_ATOL = 1e-5


def _loop_rollout(model, prompts, G, params, tokenizer, **kw):
    """The loop eagerly, from the decoding copy of `model` (float32 here: LoRA merged)."""
    decoder = DecodingCopy().refreshed(model, torch.float32)
    return decode_eagerly(
        decoder,
        prompts,
        G,
        params,
        eos_token_ids=kw.pop("eos_token_ids", [tokenizer.eos_token_id]),
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )


def _same_rollout(a, b, rows=None):
    rows = list(range(len(a.truncated))) if rows is None else rows
    assert torch.equal(a.completion_ids[rows], b.completion_ids[rows])
    assert torch.equal(a.completion_mask[rows], b.completion_mask[rows])
    assert torch.equal(a.truncated[rows], b.truncated[rows])
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)


def _early_token(rollout):
    """A token some rows produce in their first half and others never: as an extra EOS it ends
    some completions early and leaves others to run (the engine then compacts its batch)."""
    T = rollout.completion_ids.shape[1]
    early = [set(r[: T // 2].tolist()) for r in rollout.completion_ids]
    anywhere = [set(r.tolist()) for r in rollout.completion_ids]
    for token in sorted(set().union(*early)):
        if not all(token in r for r in anywhere):
            return token
    pytest.skip("no token separates the rows for this random model")


def test_masked_slots_get_probability_exactly_zero_but_the_sums_reorder():
    """The claim the comparison rests on, checked on this CPU in float32: a softmax over extra
    -inf scores gives the masked slots exactly 0, and the other slots their probabilities to
    rounding, not bitwise (the sum of the exponentials is vectorised over a longer row, in
    another order); attention over extra masked slots is likewise the same to rounding. This is
    why the tokens are compared exactly but at ties, and the logits to a tolerance."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 13, generator=gen)
    padded = torch.cat(
        [torch.full((6, 5), float("-inf")), scores, torch.full((6, 20), -torch.inf)], 1
    )
    probs, padded_probs = torch.softmax(scores, -1), torch.softmax(padded, -1)
    assert not padded_probs[:, :5].any() and not padded_probs[:, 18:].any()  # exactly 0
    torch.testing.assert_close(padded_probs[:, 5:18], probs, rtol=1e-6, atol=0)
    q, k, v = (torch.randn(6, 2, n, 8, generator=gen) for n in (1, 13, 13))
    extra = [torch.randn(6, 2, n, 8, generator=gen) for n in (5, 20, 5, 20)]
    allowed = torch.cat(
        [
            torch.zeros(5, dtype=torch.bool),
            torch.ones(13, dtype=torch.bool),
            torch.zeros(20, dtype=torch.bool),
        ]
    )
    out = F.scaled_dot_product_attention(q, k, v)
    out_padded = F.scaled_dot_product_attention(
        q,
        torch.cat([extra[0], k, extra[1]], 2),
        torch.cat([extra[2], v, extra[3]], 2),
        attn_mask=allowed[None, None, None, :],
    )
    torch.testing.assert_close(out_padded, out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_step_logits_are_the_engines_to_float_rounding(arch, tiny, prompts, tokenizer):
    """Every step's logits, the loop's (prompt slots rounded up to 16: more masked slots) against
    the engine's steps fed the same tokens (no row ends, so the engine's batch keeps its rows)."""
    model = tiny(arch)
    G, T = 2, 10
    params = SamplingParams(T, temperature=0, ignore_eos=True)
    loop = FixedShapeLoop(
        model, len(prompts) * G, 16, params, [tokenizer.eos_token_id], tokenizer.pad_token_id
    )
    loop.start(prompts, G, None)
    ours = []
    for _ in range(T):
        ours.append(loop.logits.clone())
        loop.step()
    from grpo.models import position_ids_from_mask
    from grpo.rollout import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    steps = TransformersSteps(model)
    with torch.no_grad():
        logits = steps(ids, mask, position_ids_from_mask(mask))
        steps.repeat_interleave(G)
        theirs = [logits.repeat_interleave(G, 0)]
        attn, pos = mask.repeat_interleave(G, 0), mask.sum(-1).repeat_interleave(G, 0)
        for t in range(T - 1):
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            theirs.append(steps(loop.tokens[:, t : t + 1], attn, pos[:, None]))
            pos = pos + 1
    for t, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=LOGIT_ATOL, msg=f"{arch} step {t}")


@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_are_the_engines(
    arch, with_lora, tiny, prompts, tokenizer, engine_rollout, assert_same_greedy
):
    """G = 3 completions per prompt from one prefill each, some ending early at an EOS, the rest
    running to the end: the engine's tokens, masks and truncation flags but at a tie."""
    model = tiny(arch, with_lora)
    params = SamplingParams(20, temperature=0)
    eos = [tokenizer.eos_token_id, _early_token(engine_rollout(model, prompts, 3, params))]
    theirs = engine_rollout(model, prompts, 3, params, eos_token_ids=eos)
    assert theirs.truncated.any() and not theirs.truncated.all()  # the engine did compact
    for bucket in (1, 16):
        ours = _loop_rollout(model, prompts, 3, params, tokenizer, eos_token_ids=eos, bucket=bucket)
        diverged = assert_same_greedy(model, ours, theirs, atol=LOGIT_ATOL, msg=f"bucket {bucket}")
        _same_rollout(ours, theirs, [i for i in range(len(ours.truncated)) if i not in diverged])


SAMPLING = {
    "plain": SamplingParams(24, temperature=1.0),
    "filtered": SamplingParams(
        24,
        temperature=0.8,
        top_k=30,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.3,
        min_new_tokens=3,
    ),
}


@pytest.mark.parametrize("setting", sorted(SAMPLING))
@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sampled_tokens_are_the_engines_under_the_same_seeds(
    arch, with_lora, setting, tiny, prompts, tokenizer, engine_rollout
):
    """Sampling from per-prompt seeds, with an extra EOS that ends some completions early: the
    same tokens, lengths and truncation, the sampling logprobs to float rounding."""
    model = tiny(arch, with_lora)
    params, seeds = SAMPLING[setting], [11, 12, 13]
    eos = [
        tokenizer.eos_token_id,
        _early_token(engine_rollout(model, prompts, 3, params, seeds=seeds)),
    ]
    theirs = engine_rollout(model, prompts, 3, params, seeds=seeds, eos_token_ids=eos)
    ours = _loop_rollout(model, prompts, 3, params, tokenizer, seeds=seeds, eos_token_ids=eos)
    _same_rollout(ours, theirs)
    torch.testing.assert_close(ours.sampling_logprobs, theirs.sampling_logprobs, rtol=0, atol=1e-5)
    # and a group's completions depend on its prompt's seed alone, as the engine's do
    alone = _loop_rollout(
        model, prompts[1:2], 3, params, tokenizer, seeds=seeds[1:2], eos_token_ids=eos
    )
    assert torch.equal(
        alone.completion_ids, ours.completion_ids[3:6, : alone.completion_ids.shape[1]]
    )


@pytest.mark.parametrize("check_every", [1, 3, 8])
def test_stop_strings_end_a_completion_where_the_engine_ends_it(
    check_every, tiny, prompts, tokenizer, engine_rollout
):
    """A stop string found at a check ends its completion at the token where it appeared, however
    many steps the loop ran past it before looking (the checks come every `check_every` steps)."""
    model = tiny("llama")
    params, seeds = SamplingParams(24, temperature=1.0), [5, 6, 7]
    free = engine_rollout(model, prompts, 3, params, seeds=seeds)
    texts = tokenizer.batch_decode(free.completion_ids, skip_special_tokens=True)
    stop_text = next(
        (t[9:11] for t in texts if len(t) > 12 and sum(t[9:11] in u for u in texts) < len(texts)),
        None,
    )
    if stop_text is None:
        pytest.skip("no stop string separates the rows for this random model")
    stop = StopStrings(tokenizer, [stop_text])
    theirs = engine_rollout(model, prompts, 3, params, seeds=seeds, stop=stop)
    assert (~theirs.truncated).any()  # the stop string ended some completion
    ours = _loop_rollout(
        model, prompts, 3, params, tokenizer, seeds=seeds, stop=stop, check_every=check_every
    )
    _same_rollout(ours, theirs)


def test_a_token_step_never_reads_the_device_and_the_loop_reads_it_once_per_check(
    tiny, prompts, tokenizer, monkeypatch
):
    """Inside `step` no operation that makes the host wait for the device (a scalar read, a
    nonzero, a boolean-mask index, ...: seen by a dispatch mode); `run` reads the device once
    every CHECK_EVERY steps, and once a rollout's every row has ended it stops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    syncing = {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten.item.default,
        aten.equal.default,
        aten.unique_consecutive.default,
        aten._unique2.default,
    }

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            bool_index = func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]
            )
            if (
                func in syncing
                or bool_index
                or (func is aten.repeat_interleave.Tensor and "output_size" not in kwargs)
            ):
                self.seen.append(str(func))
            return func(*args, **kwargs)

    model = tiny("qwen2")
    params = SamplingParams(
        20, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2, min_new_tokens=2
    )
    loop = FixedShapeLoop(model, 6, 16, params, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    loop.start(prompts[:2], 3, [1, 2])
    syncs = Syncs()
    with syncs:
        for _ in range(5):
            loop.step()
    assert syncs.seen == []
    loop.start(prompts[:2], 3, [1, 2])
    reads = []
    loop.run(loop.step, None, read=lambda x: reads.append(x.shape) or x.cpu())
    assert len(reads) == -(-20 // fixed_shape.CHECK_EVERY)  # 3 reads for 20 tokens
    # every row ends at once (token 0 is the only candidate... as EOS): one read, then no more steps
    loop = FixedShapeLoop(
        model,
        6,
        16,
        SamplingParams(20, temperature=0),
        list(range(len(tokenizer))),
        tokenizer.pad_token_id,
    )
    loop.start(prompts[:2], 3, None)
    steps = []
    reads.clear()
    loop.run(lambda: steps.append(loop.step()), None, read=lambda x: reads.append(1) or x.cpu())
    assert len(reads) == 1 and len(steps) == fixed_shape.CHECK_EVERY
    assert loop.lengths.tolist() == [1] * 6 and loop.done.all()


def test_non_finite_scores_raise_as_the_engine_raises(tiny, prompts, tokenizer, engine_rollout):
    model = tiny("llama")
    with torch.no_grad():
        model.lm_head.weight[5].fill_(float("nan"))
    for params in (SamplingParams(6, temperature=0), SamplingParams(6, temperature=1.0)):
        with pytest.raises(NonFiniteProbabilities):
            engine_rollout(model, prompts, 2, params, seeds=[1, 2, 3])
        with pytest.raises(NonFiniteProbabilities):
            _loop_rollout(model, prompts, 2, params, tokenizer, seeds=[1, 2, 3])


def test_what_the_loop_does_not_cover_is_named(tiny):
    assert unsupported_reason(tiny("llama"), 300) is None
    assert unsupported_reason(tiny("gemma3", window=256), 256) is None
    assert "sliding window of 4" in unsupported_reason(tiny("gemma3", window=4), 30)
    model = tiny("qwen2")
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation 'flash_attention_2'" in unsupported_reason(model, 30)
    model.config.model_type = "mamba"
    assert "architecture 'mamba'" in unsupported_reason(model, 30)
