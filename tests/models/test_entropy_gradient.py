"""The tiled output layer's entropy is differentiable (the entropy bonus needs its gradient), and
its gradient equals the plain full-logits computation's; when no loss uses the entropy the
log-prob's gradient is unchanged."""

import pytest
import torch

from grpo.models.logprobs import token_logprobs_from_hidden


def _plain(hidden, layer, targets, temperature, softcap):
    z = layer(hidden).double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature,softcap,bias", [(1.0, None, False), (0.7, 3.0, True)])
def test_entropy_gradient_matches_the_plain_computation(temperature, softcap, bias):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = torch.nn.Linear(8, 37, bias=bias).double()
    targets = torch.randint(0, 37, (9,), generator=gen)
    g_logp = torch.randn(9, generator=gen, dtype=torch.float64)
    g_entropy = torch.randn(9, generator=gen, dtype=torch.float64)
    params = [hidden, *layer.parameters()]

    logp, entropy = token_logprobs_from_hidden(
        hidden,
        layer,
        targets,
        temperature=temperature,
        softcap=softcap,
        chunk_size=4,
        vocab_block=16,
    )
    ours = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), params)
    p_logp, p_entropy = _plain(hidden, layer, targets, temperature, softcap)
    plain = torch.autograd.grad(
        (p_logp * g_logp).sum() + (p_entropy * g_entropy).sum(), params, retain_graph=True
    )
    torch.testing.assert_close(entropy.double(), p_entropy, atol=1e-5, rtol=1e-5)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    # the entropy's part is not zero: the comparison tests it
    only_logp = torch.autograd.grad((p_logp * g_logp).sum(), hidden)[0]
    assert (ours[0].double() - only_logp).abs().max() > 1e-3


def test_unused_entropy_leaves_the_logprob_gradient_alone():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    layer = torch.nn.Linear(8, 20, bias=False).double()
    targets = torch.randint(0, 20, (6,), generator=gen)
    logp, entropy = token_logprobs_from_hidden(hidden, layer, targets, chunk_size=4)
    assert entropy.requires_grad
    (ours,) = torch.autograd.grad(logp.sum(), hidden)
    p_logp, _ = _plain(hidden, layer, targets, 1.0, None)
    (plain,) = torch.autograd.grad(p_logp.sum(), hidden)
    torch.testing.assert_close(ours.double(), plain, atol=1e-6, rtol=1e-6)
