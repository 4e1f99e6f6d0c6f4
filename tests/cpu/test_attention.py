import pytest
import torch
import torch.nn.functional as F

from grpo.cpu import attention
from grpo.models import logprobs
from grpo.models.logprobs import completion_logprobs
from grpo.models.tiny import tiny_model
from grpo.rollout import SamplingParams, generate


def _models(tokenizer, gemma3_tiny, arch):
    """Two copies of one model, the second switched to the grouped attention."""
    if arch == "llama":

        def make():
            return tiny_model(tokenizer, hidden_size=64, num_layers=2, seed=3)
    else:

        def make():
            return gemma3_tiny(num_attention_heads=4, num_key_value_heads=2)

    plain, ours = make().eval(), make().eval()
    assert plain.config._attn_implementation == "sdpa"
    assert attention.use_grouped_attention(ours)
    assert ours.config._attn_implementation == attention.NAME
    assert plain.config._attn_implementation == "sdpa"  # per model, not global
    return plain, ours


def _decode_logits(model, ids, mask, steps, tokens=None):
    """Next-token logits of a prefill and `steps` single-token decoding steps, and the tokens fed:
    greedy, or `tokens` [steps, B, 1] (another model's choices: where two paths' logits differ in
    their last bits, each one's own argmax could take the other side of a tie)."""
    argument = logprobs.cache_argument(model)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, logits, fed = getattr(out, argument), [out.logits[:, -1]], []
    for t in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[t]
        fed.append(nxt)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=nxt, attention_mask=mask, use_cache=True, **{argument: cache})
        cache = getattr(out, argument)
        logits.append(out.logits[:, -1])
    return torch.stack(logits), torch.stack(fed)


def _record_query_shapes(monkeypatch) -> list[tuple[int, ...]]:
    """The query shape of every torch sdpa call from now on (the test's end undoes it)."""
    shapes, sdpa = [], F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        shapes.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return shapes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_decoding_attention_equals_sdpa(tokenizer, gemma3_tiny, arch, padded, monkeypatch):
    """Same logits at every decoding step, with and without padding (no mask at all in the
    unpadded case), past a sliding window; and the grouped layout really ran."""
    plain, ours = _models(tokenizer, gemma3_tiny, arch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 90, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    expected, tokens = _decode_logits(plain, ids, mask, steps=10)

    query_shapes = _record_query_shapes(monkeypatch)
    got, _ = _decode_logits(ours, ids, mask, steps=10, tokens=tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    heads, kv_heads = ours.config.num_attention_heads, ours.config.num_key_value_heads
    assert (
        3,
        kv_heads,
        heads // kv_heads,
        ours.config.head_dim if arch == "gemma3" else 16,
    ) in query_shapes


@torch.no_grad()
def test_greedy_generation_unchanged(tokenizer, gemma3_tiny, assert_same_greedy):
    plain, ours = _models(tokenizer, gemma3_tiny, "gemma3")
    # equal lengths: no mask
    prompts = [tokenizer(t)["input_ids"] for t in ["abcd", "1+2=", "wxyz"]]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    a, b = (
        generate(
            m,
            prompts,
            2,
            params,
            eos_token_ids=[tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )
        for m in (plain, ours)
    )
    # sdpa and the grouped layout: logits equal to float32 rounding, so the same tokens but at a tie
    assert_same_greedy(plain, b, a, atol=1e-5)


def test_other_attention_implementations_left_alone(tokenizer):
    model = tiny_model(tokenizer, hidden_size=64, num_layers=1)
    model.set_attn_implementation("eager")
    assert not attention.use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_loss_pass_equals_sdpa_values_and_gradients(tokenizer, gemma3_tiny, arch, monkeypatch):
    """The loss pass (several queries per row, a mask: left-padded prompts, right-padded
    completions, prompts shared by their group) gives the same log-probabilities and
    parameter gradients, and runs the grouped layout."""
    plain, ours = _models(tokenizer, gemma3_tiny, arch)
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(5, 90, (2, 6), generator=g).repeat_interleave(3, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[:3, :2] = 0
    completion_ids = torch.randint(5, 90, (6, 9), generator=g)
    completion_mask = (torch.arange(9)[None] < torch.tensor([9, 4, 7, 1, 9, 6])[:, None]).long()
    results = []
    for model in (plain, ours):
        logp, _ = completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask
        )
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        results.append((logp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)

    query_shapes = _record_query_shapes(monkeypatch)
    with torch.no_grad():
        completion_logprobs(ours, prompt_ids, prompt_mask, completion_ids, completion_mask)
    kv_heads, groups = (
        ours.config.num_key_value_heads,
        ours.config.num_attention_heads // ours.config.num_key_value_heads,
    )
    # 8 = completion width - 1
    assert any(s[1] == kv_heads and s[2] == groups * 8 for s in query_shapes), query_shapes


def test_saved_checkpoint_does_not_name_the_attention(tokenizer, tmp_path):
    """A checkpoint must load anywhere, without grpo's registration."""
    model = tiny_model(tokenizer, hidden_size=64, num_layers=1)
    attention.use_grouped_attention(model)
    model.save_pretrained(tmp_path)
    assert attention.NAME not in (tmp_path / "config.json").read_text()
