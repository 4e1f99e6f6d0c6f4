import pytest
import torch

from grpo.models.logprobs import (
    OutputLayerKernels,
    completion_logprobs,
    reference_logprobs,
    token_logprobs_from_hidden,
)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    N, Lp, T = 4, 6, 7
    prompt_ids = torch.randint(5, 95, (N, Lp), generator=g)
    prompt_mask = torch.ones(N, Lp, dtype=torch.long)
    prompt_mask[0, :3] = 0  # left padding
    prompt_mask[2, :1] = 0
    completion_ids = torch.randint(5, 95, (N, T), generator=g)
    completion_mask = torch.ones(N, T, dtype=torch.long)
    completion_mask[1, 4:] = 0  # right padding
    completion_mask[3, 1:] = 0  # a one-token completion
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.mark.parametrize(
    "chunk_size, vocab_block",
    # one tile; token chunks only; vocabulary blocks only (one that does not divide V); both
    [(4096, None), (1, None), (3, None), (16, None), (4096, 7), (4096, 32), (3, 7), (16, 41)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tiled_equals_full_logits_values_and_gradients(model, chunk_size, vocab_block, temperature):
    model = model.double()
    pi, pm, ci, cm = _batch()
    weights = torch.randn(ci.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    model.zero_grad()
    logp, entropy = completion_logprobs(
        model,
        pi,
        pm,
        ci,
        cm,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
    )
    (logp * weights).sum().backward()
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    ref = reference_logprobs(model, pi, pm, ci, cm, temperature=temperature)
    (ref * weights).sum().backward()

    # logp is float32 by design
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)
    assert (logp[cm == 0] == 0).all() and (entropy[cm == 0] == 0).all()
    for name, p in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("vocab_block", [None, 5, 30])
def test_entropy_matches_definition(model, vocab_block):
    """Entropy accumulated across vocabulary blocks (online log-sum-exp) equals the definition."""
    pi, pm, ci, cm = _batch()
    _, entropy = completion_logprobs(model, pi, pm, ci, cm, chunk_size=5, vocab_block=vocab_block)
    logits = model(
        input_ids=torch.cat([pi, ci], 1),
        attention_mask=torch.cat([pm, cm], 1),
        position_ids=(torch.cat([pm, cm], 1).cumsum(-1) - 1).clamp(min=0),
    ).logits
    logits = logits[:, pi.shape[1] - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    expected = -(logp.exp() * logp).sum(-1) * cm
    torch.testing.assert_close(entropy, expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab_block", [None, 4])
def test_softcap_and_bias_gradients_match_autograd(vocab_block):
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 11, bias=True).double()
    hidden = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (9,))
    softcap, temperature = 3.0, 0.8

    logp, _ = token_logprobs_from_hidden(
        hidden,
        layer,
        targets,
        temperature=temperature,
        softcap=softcap,
        chunk_size=4,
        vocab_block=vocab_block,
    )
    logp.sum().backward()
    ours = (hidden.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())

    hidden.grad = None
    layer.zero_grad()
    z = layer(hidden)
    z = softcap * torch.tanh(z / softcap) / temperature
    expected = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
    expected.sum().backward()
    torch.testing.assert_close(logp.double(), expected, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours, (hidden.grad, layer.weight.grad, layer.bias.grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bf16_autocast_close_to_fp32(model):
    pi, pm, ci, cm = _batch()
    full, _ = completion_logprobs(model, pi, pm, ci, cm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = completion_logprobs(model, pi, pm, ci, cm)
    assert low.dtype == torch.float32
    assert (low - full).abs().max() < 0.1


def _grouped_batch(G=3, seed=0):
    """Two prompts of different lengths, each repeated G times (a group), varied completion lengths."""
    pi, pm, ci, cm = _batch(seed)
    pi, pm = pi[:2].repeat_interleave(G, 0), pm[:2].repeat_interleave(G, 0)
    ci, cm = ci[:1].repeat(2 * G, 1), cm[:1].repeat(2 * G, 1)
    g = torch.Generator().manual_seed(seed + 1)
    ci = torch.randint(5, 95, ci.shape, generator=g)
    lengths = torch.randint(1, ci.shape[1] + 1, (2 * G,), generator=g)
    cm = (torch.arange(ci.shape[1])[None] < lengths[:, None]).long()
    return pi, pm, ci, cm


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shared_prompt_pass_equals_plain(model, gemma3_tiny, arch):
    """Prefilling each group's prompt once (keys/values reused by its G completions) changes
    neither the log-probabilities nor their gradients."""
    if arch == "gemma3":
        model = gemma3_tiny()
    model = model.double()
    pi, pm, ci, cm = _grouped_batch()
    weights = torch.randn(ci.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    results = {}
    for share in (True, False):
        model.zero_grad()
        logp, _ = completion_logprobs(model, pi, pm, ci, cm, chunk_size=7, share_prompts=share)
        (logp * weights).sum().backward()
        results[share] = (
            logp,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    model.zero_grad()
    ref = reference_logprobs(model, pi, pm, ci, cm)
    torch.testing.assert_close(results[True][0].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-6, rtol=1e-6)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("vocab_block", [None, 13])
def test_weight_grad_in_place_accumulates_the_autograd_gradient(vocab_block):
    """With weight_grad_in_place, the output weight's gradient is added into its existing .grad
    (on top of what it holds, the same tensor) instead of being returned to autograd; hidden-state
    gradients are unchanged. Without an allocated .grad, or without gradients, autograd's own."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(12, 8, requires_grad=True)
    targets = torch.randint(0, 50, (12,))
    upstream = torch.randn(12)
    in_place = OutputLayerKernels(weight_grad_in_place=True)

    logp, _ = token_logprobs_from_hidden(
        hidden, layer, targets, chunk_size=5, vocab_block=vocab_block
    )
    (logp * upstream).sum().backward()
    expected_w, expected_h = layer.weight.grad.clone(), hidden.grad.clone()

    hidden.grad = None
    layer.weight.grad = buffer = torch.full_like(layer.weight, 0.5)
    logp2, _ = token_logprobs_from_hidden(
        hidden, layer, targets, chunk_size=5, vocab_block=vocab_block, kernels=in_place
    )
    (logp2 * upstream).sum().backward()
    torch.testing.assert_close(logp2, logp)
    assert layer.weight.grad is buffer  # written in place, not replaced
    # 0.5 + the gradient once: autograd got nothing for the weight (else it would be added twice)
    torch.testing.assert_close(buffer, expected_w + 0.5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, expected_h, rtol=1e-5, atol=1e-6)

    # no .grad to add into: autograd's gradient, the same values
    hidden.grad = layer.weight.grad = None
    logp3, _ = token_logprobs_from_hidden(
        hidden, layer, targets, chunk_size=5, vocab_block=vocab_block, kernels=in_place
    )
    (logp3 * upstream).sum().backward()
    torch.testing.assert_close(layer.weight.grad, expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, expected_h, rtol=1e-5, atol=1e-6)

    # a pass without gradients leaves .grad alone
    before = layer.weight.grad.clone()
    with torch.no_grad():
        logp4, _ = token_logprobs_from_hidden(
            hidden, layer, targets, chunk_size=5, vocab_block=vocab_block, kernels=in_place
        )
    torch.testing.assert_close(logp4, logp.detach())
    assert torch.equal(layer.weight.grad, before)


@pytest.mark.parametrize("chunk_size, vocab_block", [(4, 16), (9, 7), (4096, None)])
@pytest.mark.parametrize("in_place", [False, True])
def test_bf16_tiles_equal_plain_bf16_product(chunk_size, vocab_block, in_place):
    """Under bf16 autocast (the logits from a bf16 product, everything after it in float32)
    the tiled pass, which reuses its tile buffers across tiles of different shapes
    (a last token chunk and vocabulary block smaller than the others), equals the
    plain computation with the same bf16 product: values, entropy and gradients."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(9, 16, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    upstream = torch.randn(9)

    z = (hidden.bfloat16() @ layer.weight.bfloat16().t()).float()
    expected = torch.log_softmax(z, -1)
    expected_entropy = -(expected.exp() * expected).sum(-1)
    expected = expected.gather(-1, targets[:, None]).squeeze(-1)
    (expected * upstream).sum().backward()
    expected_h, expected_w = hidden.grad.clone(), layer.weight.grad.clone()

    hidden.grad, layer.weight.grad = None, None
    buffer = torch.zeros_like(layer.weight) if in_place else None
    layer.weight.grad = buffer  # with `in_place`, the backward adds the weight's gradient into it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = token_logprobs_from_hidden(
            hidden,
            layer,
            targets,
            chunk_size=chunk_size,
            vocab_block=vocab_block,
            kernels=OutputLayerKernels(weight_grad_in_place=in_place),
        )
    (logp * upstream).sum().backward()
    if in_place:
        assert layer.weight.grad is buffer
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, rtol=1e-5, atol=1e-5)
    # the gradients' products are bf16 in both; the sums over vocabulary blocks are float32 here
    torch.testing.assert_close(hidden.grad, expected_h, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(layer.weight.grad, expected_w, rtol=1e-2, atol=1e-3)
