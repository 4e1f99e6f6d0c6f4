import pytest
import torch

from grpo.config.errors import ConfigError
from grpo.rollout import Rollout, SamplingParams, StopStrings, generate
from grpo.rollout.hf import (
    CDF_BLOCK,
    first_exceeding,
    penalise_repetitions,
    sample_from,
    sample_next_token,
    sample_with_logprobs,
)


def _prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in ["abc", "hello world", "1+2="]]


def _gen(model, tokenizer, prompts, G, params, **kw):
    return generate(
        model,
        prompts,
        G,
        params,
        eos_token_ids=[tokenizer.eos_token_id, kw.pop("extra_eos", tokenizer.eos_token_id)],
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )


def _early_stop_token(model, tokenizer, prompts, max_new_tokens):
    """A token that greedy decoding emits early in some rows and never in others."""
    free = generate(
        model,
        prompts,
        1,
        SamplingParams(max_new_tokens, temperature=0),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    early = [set(r[: max_new_tokens // 2].tolist()) for r in free.completion_ids]
    anywhere = [set(r.tolist()) for r in free.completion_ids]
    for token in sorted(set().union(*early)):
        if any(token in r for r in early) and not all(token in r for r in anywhere):
            return token
    pytest.skip("no token separates the rows for this random model")


def test_prefix_sharing_and_compaction_match_plain_greedy(model, tokenizer, assert_same_greedy):
    """Sharing the prompt's KV cache and dropping finished rows change nothing under greedy decoding."""
    prompts = _prompts(tokenizer)
    stop_token = _early_stop_token(model, tokenizer, prompts, 24)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    results = {
        (share, compact): _gen(
            model,
            tokenizer,
            prompts,
            3,
            params,
            share_prefix=share,
            compact=compact,
            extra_eos=stop_token,
        )
        for share in (True, False)
        for compact in (True, False)
    }
    plain = results[(False, False)]
    # some rows stop early and some run to the end, so compaction really happens
    assert plain.truncated.any() and not plain.truncated.all()
    for key, r in results.items():
        # other batch shapes (a prefill per prompt or per row, fewer rows after compaction): MKL and
        # oneDNN block each shape their own way, so logits equal to float32 rounding, the same tokens
        # but at a tie (the rows that took its other side are compared no further)
        diverged = assert_same_greedy(model, r, plain, atol=1e-5, msg=str(key))
        same = [i for i in range(len(r.truncated)) if i not in diverged]
        assert torch.equal(r.completion_mask[same], plain.completion_mask[same]), key
        assert torch.equal(r.truncated[same], plain.truncated[same]), key


def test_greedy_matches_transformers_generate(model, tokenizer, assert_same_greedy):
    prompts = ["abc", "hello world", "1+2="]
    eos = [tokenizer.eos_token_id, 30]
    ours = generate(
        model,
        [tokenizer(p)["input_ids"] for p in prompts],
        1,
        SamplingParams(20, temperature=0),
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    ref = model.generate(
        **enc,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    ref = ref[:, enc["input_ids"].shape[1] :]
    lengths = ours.completion_mask.sum(-1).tolist()
    # transformers' own decoding loop, cache and masks: logits equal to float32 rounding, the same
    # tokens but at a tie (transformers pads after EOS; we stop at EOS: compared up to ours)
    diverged = assert_same_greedy(
        model, ours, [ref[i, :n].tolist() for i, n in enumerate(lengths)], atol=1e-5
    )
    for i, n in enumerate(lengths):
        if n < 20 and i not in diverged:
            assert ours.completion_ids[i, n - 1].item() in eos
            assert not ours.truncated[i]


def test_generate_decodes_with_the_steps_it_is_handed(model, tokenizer):
    """`decoding(model, rows, max_length)` opens once per rollout, for all its rows and positions,
    its steps compute every logit, and it closes before generate returns; the default is
    transformers' modules (plain_decoding), with the same completions."""
    import contextlib

    from grpo.rollout.hf import TransformersSteps

    prompts, opened, calls, closed = _prompts(tokenizer), [], [], []

    class Counting(TransformersSteps):
        def __call__(self, *args):
            calls.append(1)
            return super().__call__(*args)

    @contextlib.contextmanager
    def decoding(m, rows, max_length):
        opened.append((m, rows, max_length))
        yield Counting(m)
        closed.append(1)

    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    ours = _gen(model, tokenizer, prompts, 2, params, decoding=decoding)
    assert opened == [(model, 6, max(map(len, prompts)) + 5)] and closed == [1]
    assert len(calls) == 5  # the prefill and every step but the last sample
    plain = _gen(model, tokenizer, prompts, 2, params)
    assert torch.equal(ours.completion_ids, plain.completion_ids)


def test_rollout_shapes_mask_and_truncation(model, tokenizer):
    prompts = _prompts(tokenizer)
    gen = torch.Generator().manual_seed(0)
    r = _gen(model, tokenizer, prompts, 4, SamplingParams(10, temperature=1.0), seeds=gen)
    assert r.completion_ids.shape[0] == 12 and r.prompt_ids.shape[0] == 12
    # rows i*G..i*G+G-1 share prompt i
    for i in range(3):
        assert (r.prompt_ids[i * 4 : (i + 1) * 4] == r.prompt_ids[i * 4]).all()
    lengths = r.completion_mask.sum(-1)
    # mask is a prefix of ones; padding after it
    for row, n in zip(r.completion_mask, lengths):
        assert row[:n].all() and not row[n:].any()
    assert (r.truncated == (lengths == 10)).all() or (r.truncated <= (lengths == 10)).all()
    assert (r.completion_ids[r.completion_mask == 0] == tokenizer.pad_token_id).all()


def test_ignore_eos_generates_exact_length(model, tokenizer):
    r = _gen(
        model,
        tokenizer,
        _prompts(tokenizer),
        2,
        SamplingParams(7, temperature=0, ignore_eos=True),
        extra_eos=30,
    )
    assert (r.completion_mask.sum(-1) == 7).all() and r.truncated.all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_holds_eos_back_for_that_many_tokens(model, tokenizer, temperature):
    """The token each prompt's greedy completion starts with made its EOS: every completion ends
    at once; with min_new_tokens=3 none ends before its fourth token, and no EOS is among its
    first three."""
    prompts = _prompts(tokenizer)
    first = _gen(model, tokenizer, prompts, 1, SamplingParams(1, temperature=0, ignore_eos=True))
    eos = sorted(set(first.completion_ids[:, 0].tolist()))
    kw = dict(eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, seeds=[1, 2, 3])
    plain = generate(model, prompts, 2, SamplingParams(8, temperature=0), **kw)
    assert (plain.completion_mask.sum(-1) == 1).all()  # greedy: EOS first, every row
    held = generate(
        model, prompts, 2, SamplingParams(8, temperature=temperature, min_new_tokens=3), **kw
    )
    lengths = held.completion_mask.sum(-1)
    assert (lengths >= 4).all()
    assert not torch.isin(held.completion_ids[:, :3], torch.tensor(eos)).any()


def test_min_new_tokens_from_the_config_and_trls_generation_kwargs(tmp_path):
    from grpo import GRPOConfig
    from grpo.config import loading

    for name in ("min_new_tokens", "min_tokens"):  # transformers' name and vLLM's
        args = GRPOConfig(output_dir=str(tmp_path), generation_kwargs={name: 5})
        assert args.to_config(num_rows=8).rollout.min_new_tokens == 5
    with pytest.raises(ConfigError, match="rollout.min_new_tokens: must be in \\[0, "):
        loading.from_dict({"rollout": {"max_completion_length": 4, "min_new_tokens": 5}})


def test_same_greedy_check_fails_on_anything_but_a_tie(model, tokenizer, assert_same_greedy):
    """The check the greedy comparisons above use: equal tokens pass, a token the model ranks
    well below the best fails, and so does a completion cut short; a tie within atol passes."""
    params = SamplingParams(8, temperature=0, ignore_eos=True)
    a = _gen(model, tokenizer, _prompts(tokenizer), 2, params)
    rows = a.completion_ids.tolist()
    assert assert_same_greedy(model, a, rows, atol=1e-5) == []
    prompt = a.prompt_ids[3][a.prompt_mask[3].bool()].tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + rows[3][:4]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    gap = float(logits.max() - logits[second])
    assert gap > 1e-3  # a clear choice for this model
    other = [list(r) for r in rows]
    other[3][4:] = [second] + other[3][5:]
    assert assert_same_greedy(model, a, other, atol=2 * gap) == [3]  # within atol: taken for a tie
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_greedy(model, a, other, atol=1e-5)
    with pytest.raises(AssertionError, match="ends where the other goes on"):
        assert_same_greedy(
            model, a, [r[:5] if i == 0 else r for i, r in enumerate(rows)], atol=1e-5
        )


def test_sampling_is_deterministic_given_generator(model, tokenizer):
    params = SamplingParams(12, temperature=1.0, top_p=0.9, top_k=20)
    a = _gen(
        model, tokenizer, _prompts(tokenizer), 3, params, seeds=torch.Generator().manual_seed(5)
    )
    b = _gen(
        model, tokenizer, _prompts(tokenizer), 3, params, seeds=torch.Generator().manual_seed(5)
    )
    c = _gen(
        model, tokenizer, _prompts(tokenizer), 3, params, seeds=torch.Generator().manual_seed(6)
    )
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_a_prompts_completions_depend_on_its_seed_not_its_batch(model, tokenizer):
    """What makes a data-parallel run sample what one process samples: each prompt's G
    completions come from its own seed, whatever other prompts share the batch (and however
    long they run), with prefix sharing and compaction on or off."""
    params = SamplingParams(10, temperature=1.0)
    prompts = _prompts(tokenizer)
    seeds = [11, 22, 33][: len(prompts)]
    whole = _gen(model, tokenizer, prompts, 3, params, seeds=seeds)
    for i in range(len(prompts)):
        alone = _gen(
            model, tokenizer, [prompts[i]], 3, params, seeds=[seeds[i]], compact=i % 2 == 0
        )
        rows = slice(3 * i, 3 * i + 3)
        width = alone.completion_ids.shape[1]
        # exact: a prompt alone is a batch of another shape, so its logits may differ in the last bits,
        # but a draw changes only if its uniform lies that close to a step of the CDF (the nearest
        # of these 540 draws is 1e-5 away); the logprobs are compared to float32 rounding
        assert torch.equal(alone.completion_ids, whole.completion_ids[rows, :width]), i
        assert torch.equal(alone.completion_mask, whole.completion_mask[rows, :width]), i
        torch.testing.assert_close(
            alone.sampling_logprobs, whole.sampling_logprobs[rows, :width], rtol=0, atol=1e-5
        )
    other = _gen(model, tokenizer, prompts, 3, params, seeds=[seeds[0] + 1, *seeds[1:]])
    # the seed does decide
    assert not torch.equal(other.completion_ids[:3], whole.completion_ids[:3])


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    top1 = sample_next_token(logits, SamplingParams(1, temperature=1.0, top_k=1), g)
    assert (top1 == 0).all()
    top2 = sample_next_token(logits, SamplingParams(1, temperature=1.0, top_k=2), g)
    assert set(top2.tolist()) == {0, 1}
    # top_p=0.7: tokens 0 (0.5) and 1 (0.3) are needed to reach 0.7; 2 and 3 never appear
    nucleus = sample_next_token(logits, SamplingParams(1, temperature=1.0, top_p=0.7), g)
    assert set(nucleus.tolist()) == {0, 1}
    counts = torch.bincount(nucleus, minlength=4).float() / len(nucleus)
    assert abs(counts[0].item() - 0.5 / 0.8) < 0.05


def test_min_p_keeps_the_tokens_transformers_keeps():
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    # min_p 0.2: the floor is 0.2 x 0.5 = 0.1, so token 3 (0.05) goes
    tokens, logprobs = sample_with_logprobs(logits, SamplingParams(1, min_p=0.2), g)
    kept = MinPLogitsWarper(0.2)(None, logits[:1].clone()).isfinite()[0]
    assert set(tokens.tolist()) == set(kept.nonzero().squeeze(-1).tolist()) == {0, 1, 2}
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert abs(counts[0].item() - 0.5 / 0.95) < 0.03
    # the reported logprob is the unfiltered one, as for top-k and top-p
    torch.testing.assert_close(logprobs, logits[0, tokens])


def test_repetition_penalty_is_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    ids = torch.tensor([[0, 1, 1]])
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
    ours = penalise_repetitions(logits, seen, 2.0)
    theirs = RepetitionPenaltyLogitsProcessor(2.0)(ids, logits.clone())
    assert torch.equal(ours, theirs)
    assert ours.tolist() == [[1.0, -2.0, 0.5, -3.0, 1.0]]


def test_generation_with_a_repetition_penalty_matches_transformers(
    model, tokenizer, assert_same_greedy
):
    # prompts of one length: transformers would also penalise a left-padded prompt's padding
    prompts = ["abab", "1+2="]
    eos = [tokenizer.eos_token_id]
    ours = generate(
        model,
        [tokenizer(p)["input_ids"] for p in prompts],
        1,
        SamplingParams(16, temperature=0, repetition_penalty=1.8),
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    enc = tokenizer(prompts, return_tensors="pt")
    ref = model.generate(
        **enc,
        max_new_tokens=16,
        do_sample=False,
        repetition_penalty=1.8,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )[:, enc["input_ids"].shape[1] :]
    plain = generate(
        model,
        [tokenizer(p)["input_ids"] for p in prompts],
        1,
        SamplingParams(16, temperature=0),
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    for i, n in enumerate(ours.completion_mask.sum(-1).tolist()):
        a, b = ours.completion_ids[i, :n].tolist(), ref[i, :n].tolist()
        t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if t is None:
            continue
        # two code paths' logits differ in their last bits: a different token only at a tie
        context = enc["input_ids"][i].tolist() + a[:t]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context])).logits[0, -1:].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[0, context] = True
        penalised = penalise_repetitions(logits, seen, 1.8)[0]
        assert (penalised.max() - penalised[[a[t], b[t]]]).max() <= 1e-5, (i, t, a, b)
    # and the penalty changed what was generated (a random tiny model repeats itself)
    assert not torch.equal(ours.completion_ids, plain.completion_ids)


def test_stop_strings_end_completion(tokenizer):
    stop = StopStrings(tokenizer, ["\n\n"])
    ids = torch.tensor([tokenizer("ab\n\n")["input_ids"], tokenizer("abcd")["input_ids"]])
    assert stop(ids).tolist() == [True, False]


def test_concat_pads_widths(tokenizer):
    a = Rollout(
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 2, dtype=torch.long),
        torch.ones(2, 2, dtype=torch.long),
        torch.tensor([True, False]),
    )
    b = Rollout(
        torch.ones(1, 5, dtype=torch.long),
        torch.ones(1, 5, dtype=torch.long),
        torch.ones(1, 4, dtype=torch.long),
        torch.ones(1, 4, dtype=torch.long),
        torch.tensor([False]),
    )
    c = Rollout.concat([a, b], pad_token_id=0)
    assert c.prompt_ids.shape == (3, 5) and c.completion_ids.shape == (3, 4)
    assert c.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert c.completion_mask[0].tolist() == [1, 1, 0, 0]


def test_sampling_frequencies_match_probabilities():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = torch.log(probs).repeat(20000, 1)
    draws = sample_next_token(
        logits, SamplingParams(1, temperature=1.0), torch.Generator().manual_seed(1)
    )
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[1] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_two_level_sampling_frequencies_across_blocks():
    """Weights spread over several CDF blocks and a partial last block: frequencies match,
    zero-weight entries (including whole blocks) are never drawn, unnormalised weights are fine."""
    V = 3 * CDF_BLOCK + 37
    weights = torch.zeros(V)
    # block 1 is all zeros
    picks = {
        5: 1.0,
        CDF_BLOCK - 1: 2.0,
        2 * CDF_BLOCK + 500: 3.0,
        V - 1: 4.0,
    }
    for i, w in picks.items():
        weights[i] = w
    draws = sample_from(weights.repeat(40000, 1), torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=V).float() / len(draws)
    assert set(draws.unique().tolist()) == set(picks)
    for i, w in picks.items():
        assert abs(freq[i].item() - w / 10) < 0.01, (i, freq[i].item())


def test_sampling_matches_a_flat_inverse_cdf_in_distribution():
    """Random dense weights over four CDF blocks: the most likely entries' frequencies against
    their probabilities."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4 * CDF_BLOCK, generator=g) * 3
    probs = torch.softmax(logits, -1)[0]
    draws = sample_next_token(logits.repeat(50000, 1), SamplingParams(1, temperature=1.0), g)
    freq = torch.bincount(draws, minlength=probs.numel()).float() / len(draws)
    top = probs.topk(20).indices
    torch.testing.assert_close(freq[top], probs[top], atol=0.006, rtol=0)


def test_each_draw_lands_on_a_positive_weight():
    """The first cumulative weight strictly above the target: zero-weight entries (flat steps
    of the CDF, here at 0, 3 and 5) are skipped at both ends and in the middle."""
    cdf = torch.tensor([[0.0, 0.25, 0.75, 0.75, 1.0, 1.0]])
    draws = {
        u: first_exceeding(cdf, torch.tensor([[u]])).item()
        for u in (0.0, 0.5, 0.75, 1.0 - 2.0**-24)
    }
    assert draws == {0.0: 1, 0.5: 2, 0.75: 4, 1.0 - 2.0**-24: 4}


def test_a_hybrid_models_recurrent_cache_is_prefilled_per_row(tokenizer, assert_same_greedy):
    # NemotronH's linear-attention (Mamba) layers keep a recurrent state that transformers' cache
    # cannot repeat or select rows of: no prefix sharing or compaction there, the same tokens
    transformers = pytest.importorskip("transformers")
    defaults = transformers.NemotronHConfig().to_dict()
    small = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
    }
    config = transformers.NemotronHConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{k: v for k, v in small.items() if k in defaults},
    )
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    prompts = ["abab", "1+2="]
    ours = generate(
        model,
        [tokenizer(p)["input_ids"] for p in prompts],
        2,
        SamplingParams(6, temperature=0),
        eos_token_ids=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    enc = tokenizer(prompts, return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(
            **enc,
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )[:, enc["input_ids"].shape[1] :]
    lengths = ours.completion_mask.sum(-1).tolist()
    # other batch shapes: logits equal to float32 rounding, the same tokens but at a tie
    assert_same_greedy(model, ours, [ref[i // 2, :n].tolist() for i, n in enumerate(lengths)], 1e-5)


def test_a_generate_replaced_on_the_model_is_what_samples(model, tokenizer, assert_same_greedy):
    """A model whose generate was replaced on the object (a wrapper, a test's stand-in) is sampled
    with it; the class's own generate bound there gives grpo's own greedy tokens."""
    from types import MethodType, SimpleNamespace

    from grpo.rollout.hf import TransformersEngine

    cfg = SimpleNamespace(
        rollout=SimpleNamespace(stop_strings=[]), training=SimpleNamespace(bf16=False)
    )
    engine = TransformersEngine(model, tokenizer, cfg)
    prompts = _prompts(tokenizer)
    params = SamplingParams(12, temperature=0)
    ours = engine.generate(prompts, 1, params)
    model.generate = MethodType(type(model).generate, model)
    try:
        theirs = engine.generate(prompts, 1, params)
        assert theirs.sampling_logprobs is None
        lengths = ours.completion_mask.sum(-1).tolist()
        # transformers' loop and grpo's: the same tokens but at a tie within float32 rounding
        diverged = assert_same_greedy(
            model,
            ours,
            [theirs.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)],
            atol=1e-5,
        )
        theirs_lengths = theirs.completion_mask.sum(-1).tolist()
        assert all(theirs_lengths[i] == n for i, n in enumerate(lengths) if i not in diverged)
        # a stand-in's output: EOS ends a completion (what follows is padding), none truncates it
        eos, pad = engine.eos_token_ids[0], tokenizer.pad_token_id
        asked = []

        def fake_generate(input_ids, **kwargs):
            asked.append((input_ids.shape, kwargs["max_new_tokens"], kwargs["do_sample"]))
            tails = torch.tensor([[5, 6, eos, pad], [7, 8, 9, 10]] * (input_ids.shape[0] // 2))
            return torch.cat([input_ids, tails], dim=-1)

        model.generate = fake_generate
        rollout = engine.generate(prompts[:1], 2, SamplingParams(4, temperature=1.0), [3])
        assert asked == [((2, len(prompts[0])), 4, True)]
        assert rollout.completion_ids.tolist() == [[5, 6, eos, pad], [7, 8, 9, 10]]
        assert rollout.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
        assert rollout.truncated.tolist() == [False, True]
    finally:
        del model.generate
